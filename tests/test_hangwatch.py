"""The hang watchdog (ddp_hpc.runlogs.watchdog): stacks of every thread as a `stack` event, once
per silence before the collective timeout, and on request (SIGURG) while the main thread is busy;
`ddp-hpc status --stacks` on a real local job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ddp_hpc.judge.nodefiles import rank_events
from ddp_hpc.runlogs.watchdog import STACK_SIGNAL, HangWatch, dump_after, format_stacks

ROOT = Path(__file__).resolve().parents[1]


class _Log:
    def __init__(self):
        self.events, self.lines = [], []

    def event(self, name, **fields):
        self.events.append({"event": name, **fields})

    def info(self, msg, console=True):
        self.lines.append(msg)


def _parked_in_here(stop: threading.Event) -> None:
    stop.wait()


def test_dump_after_leaves_a_margin_before_the_timeout():
    assert dump_after(600) == 480 and dump_after(20) == 15 and dump_after(3) == 1.0
    assert dump_after(None) is None and dump_after(0) is None


def test_format_stacks_lists_the_main_thread_first_innermost_frame_first():
    stop, out = threading.Event(), []
    parked = threading.Thread(target=_parked_in_here, args=(stop,), name="parked")
    parked.start()
    dumper = threading.Thread(target=lambda: out.append(format_stacks()), name="dumper")
    try:
        dumper.start()
        dumper.join()
    finally:
        stop.set()
        parked.join()
    text = out[0]
    main_block = text.split("\n\n")[0].splitlines()
    assert main_block[0].startswith("Current thread 0x") and '"MainThread"' in main_block[0]
    assert "threading.py" in main_block[1]   # innermost first: the main thread waits in join()
    assert any("in test_format_stacks_lists_the_main_thread_first" in ln for ln in main_block)
    assert '"parked" (most recent call first):' in text and "in _parked_in_here" in text
    assert '"dumper"' not in text      # the dumping thread leaves itself out


def test_timer_dumps_once_per_silence_and_a_beat_rearms_it():
    log = _Log()
    w = HangWatch(log, dump_after_s=0.5)
    w.start()
    try:
        time.sleep(2.6)
        dumps = [e for e in log.events if e["event"] == "stack"]
        assert len(dumps) == 1 and dumps[0]["reason"].startswith("collective timeout: no step for")
        assert "test_timer_dumps_once_per_silence" in dumps[0]["stack"]
        w.beat(7)
        time.sleep(2.6)
    finally:
        w.stop()
    dumps = [e for e in log.events if e["event"] == "stack"]
    assert len(dumps) == 2 and dumps[1]["step"] == 7
    assert log.lines[0].startswith("stacks of all threads (collective timeout")


@pytest.mark.timeout(30)
def test_stop_wakes_the_thread_instead_of_waiting_out_its_poll(monkeypatch):
    """stop() ends every fit() call: it must not wait for the thread's select to time out (with a
    60 s poll, a stop that only sets the flag blocks past this test's 30 s timeout)."""
    import ddp_hpc.runlogs.watchdog as wd
    monkeypatch.setattr(wd, "POLL_S", 60.0)
    w = HangWatch(_Log(), dump_after_s=None).start()
    thread = w._thread
    deadline = time.monotonic() + 20   # the thread made its wake-up pipe: it is inside its select
    while w._pipe is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    assert thread.is_alive() and w._pipe is not None
    w.stop()
    assert not thread.is_alive() and w._pipe is None
    assert not [e for e in w.log.events if e["event"] == "stack"]   # the wake-up is not a request


def test_sigurg_asks_for_stacks_while_the_main_thread_is_busy():
    log = _Log()
    w = HangWatch(log, dump_after_s=None).start()
    try:
        os.kill(os.getpid(), STACK_SIGNAL)
        deadline = time.monotonic() + 20   # a loaded machine may schedule the thread late
        while not log.events and time.monotonic() < deadline:
            sum(range(100_000))      # busy in Python: the watchdog thread answers anyway
    finally:
        w.stop()
    assert log.events and log.events[0]["reason"] == "on request"
    assert "test_sigurg_asks_for_stacks" in log.events[0]["stack"]


@pytest.mark.slow
def test_status_stacks_on_a_running_local_job(tmp_path):
    """`ddp-hpc status --stacks` of a real running local job: both ranks of the training core answer."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDP_HPC_"))}
    env.update(DDP_HPC_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT))
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                  if not (Path(p) / "sbatch").exists())
    p = subprocess.run(
        [sys.executable, "-m", "ddp_hpc.submit", "-N", "1", "-G", "2", str(ROOT / "jobs" / "demo.yaml"),
         "train.epochs=1", "data.kwargs.size=8192", f"log.dir={tmp_path / 'runs'}",
         "data.dataset=tests.cluster.status_helpers:slow_synthetic", "data.kwargs.delay=0.02"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    job = p.stdout.split()[-1]
    log_dir = next((tmp_path / "runs").iterdir())
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:   # until training is under way on both ranks
            if all(any(e["event"] == "step" for e in rank_events(log_dir, r).events) for r in (0, 1)):
                break
            time.sleep(0.5)
        s = subprocess.run([sys.executable, "-m", "ddp_hpc.status", job, "--stacks", "--json"],
                           cwd="/", env=env, capture_output=True, text=True, timeout=60)
        assert s.returncode == 0, s.stderr
        got = json.loads(s.stdout)
        assert sorted(got["stacks"]) == ["0", "1"] and got["silent_ranks"] == []
        assert all("in _train_epoch" in ev["stack"] for ev in got["stacks"].values())
    finally:
        subprocess.run([sys.executable, "-c", "import json,os,signal,sys;"
                        "[os.kill(p, signal.SIGTERM) for p in json.load(open(sys.argv[1]))['pids'][:1]]",
                        str(next((tmp_path / "home" / "jobs").glob("*.json")))], env=env)


def test_vitals_tell_a_working_process_from_a_still_one_and_leave_out_the_watchdogs_own_writes(tmp_path):
    """The work a stack answer carries (issue 38, bug 1): CPU spent, bytes written, or a main
    thread seen at several places make a rank busy; a sleeping one is still, also after the
    watchdog itself wrote a big answer in the window."""
    from ddp_hpc.runlogs.vitals import Vitals, working
    still = Vitals()
    still.sample()
    with still.own():                                    # the watchdog's own dump: not the rank's
        (tmp_path / "answer").write_bytes(b"x" * 1_000_000)
    time.sleep(1.2)
    w = still.recent()
    assert w.over_s >= 1.0 and w.io_bytes < 64 * 1024 and working(w.to_dict()) is False
    seen = []   # a spinning process, a fresh window at a time: on a machine saturated by other
    for _ in range(30):   # work it may get under 5 % of a core for a while (a full run: 10 windows
        busy = Vitals()   # in a row, under the check run's load); what it got, it is told it got
        c0 = time.process_time()
        busy.sample()
        end = time.monotonic() + 1.2
        while time.monotonic() < end:
            sum(i * i for i in range(1000))
        seen.append(busy.recent().to_dict())
        assert abs(seen[-1]["cpu_s"] - (time.process_time() - c0)) < 0.05, seen[-1]
        if working(seen[-1]):
            break
    assert working(seen[-1]) is True, seen
    writer = Vitals()
    writer.sample()
    (tmp_path / "ckpt").write_bytes(b"x" * 1_000_000)    # a save: no CPU to speak of, but bytes
    time.sleep(1.0)
    assert writer.recent().io_bytes >= 1_000_000 and working(writer.recent().to_dict()) is True
    assert working(None) is None and working({"over_s": 0.2, "cpu_s": 0, "io_bytes": 0, "places": 1}) is None


def test_a_rank_outside_a_collective_is_named_only_when_still():
    from ddp_hpc.supervise.hang import busy_ranks, find_culprit
    waiting = ('Current thread 0x1 (most recent call first):\n'
               '  File "/x/torch/distributed/distributed_c10d.py", line 10 in barrier\n'
               '  File "/job/train.py", line 9 in <module>\n')
    saving = 'Current thread 0x1 (most recent call first):\n  File "/job/train.py", line 12 in <module>\n'
    hosts = {0: "n1", 1: "n1", 2: "n2"}
    still = {"over_s": 10.0, "cpu_s": 0.01, "io_bytes": 900, "places": 1}
    writes = {**still, "io_bytes": 50_000_000}
    answers = {0: {"stack": saving, "work": writes}, 1: {"stack": waiting, "work": still},
               2: {"stack": waiting, "work": still}}
    assert busy_ranks(answers, hosts) == [0] and find_culprit(answers, hosts) is None
    answers[0]["work"] = still
    hang = find_culprit(answers, hosts)
    assert hang.rank == 0 and "and still (cpu 0.0 s, 0.0 MB read or written, 1 place(s) in 10 s)" in hang.basis
    del answers[2]                                      # rank 2 silent while rank 0 works: asked again later
    answers[0]["work"] = writes
    assert find_culprit(answers, hosts) is None
