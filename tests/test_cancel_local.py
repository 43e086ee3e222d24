"""``ddp-hpc cancel`` and the states of local jobs after a stop, with real local jobs: the local
backend's driver and rank processes, their job records and run logs (no Slurm; the cluster test
is tests/cluster/test_cancel_cluster.py)."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ddp_hpc import records
from ddp_hpc.judge.nodefiles import rank_events
from ddp_hpc.launch.tree import recorded_alive

#: each rank starts a grandchild (it must die with the job), then reports a step every 0.1 s
SCRIPT = """\
import os, subprocess, sys, time
import ddp_hpc
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
with open(os.path.join(os.environ["DDP_HPC_LOG_DIR"], f"child{os.environ['RANK']}.pid"), "w") as f:
    f.write(str(child.pid))
for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 600):
    ddp_hpc.report(step=i, total=600)
    time.sleep(0.1)
"""


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_HPC_HOME", str(tmp_path / "home"))
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "job.py").write_text(SCRIPT)
    return tmp_path


def env_for(home):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["DDP_HPC_HOME"] = str(home / "home")
    env["PATH"] = str(Path(sys.executable).parent)  # no Slurm here
    return env


def ddp_hpc(home, *args, timeout=60, check=True):
    p = subprocess.run([sys.executable, "-m", "ddp_hpc", *args], cwd=home / "work", env=env_for(home),
                       capture_output=True, text=True, timeout=timeout)
    if check:
        assert p.returncode == 0, p.stdout + p.stderr
    return p


def elapsed_s(status_text: str) -> int:
    """The seconds of the detail view's ``Elapsed:    HH:MM:SS`` line."""
    h, m, s = re.search(r"^Elapsed:\s+(\d+):(\d\d):(\d\d)", status_text, re.M).groups()
    return int(h) * 3600 + int(m) * 60 + int(s)


def within(status_text: str, t0: float) -> bool:
    """The job's elapsed time is more than 0 and no more than the test saw pass since ``t0``
    (before the submission), whatever the load: a start-up may take long on a busy machine."""
    return 0 < elapsed_s(status_text) <= time.monotonic() - t0 + 1


def submit(home, *extra):
    """A detached local job of 2 pretend nodes x 1 rank; returns (job id, record) once both ranks
    reported a step."""
    p = ddp_hpc(home, "submit", "--backend", "local", "-N", "2", "-G", "1", "--log-dir", str(home / "runs"),
                "job.py", *extra)
    job_id = p.stdout.strip().splitlines()[-1]
    rec = wait_steps(job_id)
    return job_id, rec


def wait_steps(job_id, timeout=120):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        rec = records.load_record(job_id)
        if len(rec.pids or []) == 3 and all(any(e["event"] == "step" for e in rank_events(rec.log_dir, r).events)
                                             for r in (0, 1)):
            return rec
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not start: {records.load_record(job_id)}")


def job_processes(rec):
    """Every process of the job: the driver, the ranks, their scripts and the grandchildren."""
    pids = list(rec.pids) + [int((Path(rec.log_dir) / f"child{r}.pid").read_text()) for r in (0, 1)]
    for pid in rec.pids[1:]:
        pids += [c.pid for c in psutil.Process(pid).children(recursive=True)]
    return sorted(set(pids))


def alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_cancel_stops_every_process_and_status_says_cancelled(home):
    t0 = time.monotonic()
    job_id, rec = submit(home)
    procs = job_processes(rec)
    assert len(procs) >= 7 and all(alive(p) for p in procs)  # driver, 2 wrappers, 2 scripts, 2 children
    p = ddp_hpc(home, "cancel", job_id, "--grace", "5")
    assert f"job {job_id}: CANCELLED" in p.stdout
    assert not [pid for pid in procs if alive(pid)]
    rec = records.load_record(job_id)
    assert rec.final["state_name"] == "CANCELLED" and rec.pids == []
    out = ddp_hpc(home, "status", job_id).stdout
    assert "State:      CANCELLED" in out and "FAILED" not in out, out
    assert within(out, t0), out
    table = ddp_hpc(home, "status").stdout
    assert " CANCELLED " in table, table
    again = ddp_hpc(home, "cancel", job_id)
    assert "no process of it runs any more (CANCELLED)" in again.stdout


def test_cancel_leaves_alone_a_process_that_took_a_recorded_pid(home, tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = psutil.Process(other.pid).create_time()
        records.write_record(dict(
            id="local-old-1", cluster=os.uname().nodename, name="old", backend="local", nodes=1,
            gpus_per_node=1, time_limit=None, log_dir=str(tmp_path / "gone"), config=None, overrides=[],
            cwd=str(tmp_path), submitted_at=started - 200, pids=[other.pid], pid_times=[started - 100]))
        p = ddp_hpc(home, "cancel", "local-old-1")
        assert "no process of it runs any more" in p.stdout
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_cancel_never_signals_a_pid_recorded_without_a_start_time(home, tmp_path):
    """A rank that had ended when its pids were recorded has no start time beside its pid; a
    process started later under that pid (after the submission) is a stranger: left alone, and
    the answer says so."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = psutil.Process(other.pid).create_time()
        records.write_record(dict(
            id="local-old-2", cluster=os.uname().nodename, name="old", backend="local", nodes=1,
            gpus_per_node=1, time_limit=None, log_dir=str(tmp_path / "gone"), config=None, overrides=[],
            cwd=str(tmp_path), submitted_at=started - 200, pids=[other.pid], pid_times=[None]))
        p = ddp_hpc(home, "cancel", "local-old-2")
        assert "no process of it runs any more" in p.stdout
        assert (f"left alone 1 pid recorded without a start time ({other.pid}): whatever runs there "
                "now is not the job's") in p.stdout
        assert other.poll() is None
        # the same one check tells status what still runs (ddp_hpc.launch.tree)
        here = os.uname().nodename
        assert recorded_alive([other.pid], [None], here) is False
        assert recorded_alive([other.pid], [started], here) is True
        assert recorded_alive([other.pid], [started], "another-host") is None
    finally:
        other.kill()
        other.wait()


def test_cancel_of_an_unknown_id_says_so(home):
    p = ddp_hpc(home, "cancel", "local-nope-1", check=False)
    assert p.returncode == 2
    assert "ddp-hpc cancel: error: no job record with id 'local-nope-1'" in p.stderr
    assert "HINT:" in p.stderr


def test_ctrl_c_of_a_waited_job_is_interrupted_not_failed(home):
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "ddp_hpc", "submit", "--backend", "local", "--wait", "-N", "2",
                             "-G", "1", "--log-dir", str(home / "runs"), "job.py"], cwd=home / "work",
                            env=env_for(home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not records.list_records() and time.monotonic() < deadline:
            time.sleep(0.1)
        rec = wait_steps(records.list_records()[-1].id)
        time.sleep(2)
        proc.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends the submit command
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    assert "interrupted (Ctrl-C" in out
    st = ddp_hpc(home, "status", rec.id).stdout
    assert "State:      INTERRUPTED by SIGINT" in st and "FAILED" not in st, st
    assert "0-1 interrupted (SIGINT)" in st
    assert within(st, t0), st


def test_term_to_the_driver_is_cancelled_and_a_lost_driver_is_judged_by_the_end_events(home):
    job_id, rec = submit(home)
    os.kill(rec.pids[0], signal.SIGTERM)  # `kill DRIVER`: the driver stops the ranks, keeps the state
    psutil.wait_procs([psutil.Process(rec.pids[0])], timeout=20)
    st = ddp_hpc(home, "status", job_id).stdout
    assert "State:      CANCELLED by SIGTERM" in st and "source: record" in st, st

    job_id, rec = submit(home)
    os.kill(rec.pids[0], signal.SIGKILL)  # the driver gone without a word; then the ranks stopped
    for pid in rec.pids[1:]:
        os.killpg(pid, signal.SIGTERM)
    psutil.wait_procs([psutil.Process(p) for p in rec.pids[1:] if alive(p)], timeout=20)
    st = ddp_hpc(home, "status", job_id).stdout
    assert "State:      CANCELLED by SIGTERM" in st and "processes gone without an end event" not in st, st
    assert records.load_record(job_id).final["state_name"] == "CANCELLED"  # kept for later


def test_a_completed_job_whose_logs_were_removed_stays_completed(home):
    t0 = time.monotonic()
    p = ddp_hpc(home, "submit", "--backend", "local", "--wait", "-N", "2", "-G", "1", "--log-dir",
                str(home / "runs"), "job.py", "25")
    assert "completed" in p.stderr
    rec = records.list_records()[-1]
    for f in Path(rec.log_dir).iterdir():
        f.unlink()
    Path(rec.log_dir).rmdir()
    st = ddp_hpc(home, "status", rec.id).stdout
    assert "State:      COMPLETED" in st and "FAILED" not in st, st
    assert f"log directory {rec.log_dir} is gone; final state from the record" in st
    assert within(st, t0), st


def test_job_cancel_from_python(home, monkeypatch):
    import ddp_hpc as api

    monkeypatch.chdir(home / "work")
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    job = api.submit_job(["job.py"], nodes=2, gpus=1, backend="local", log_dir=str(home / "runs"))
    rec = wait_steps(job.job_id)
    procs = job_processes(rec)
    job.cancel(grace=5)
    assert not [pid for pid in procs if alive(pid)]
    assert job.state() == "CANCELLED"


def ev(rank, t, event, **kw):
    return {"time": t, "event": event, "rank": rank, "job_id": "x", "restart": 0, "host": "h", **kw}


def test_a_stall_before_a_cancel_stays_the_first_failure(home, tmp_path):
    """Rank 1 stopped reporting at step 40 while rank 0 went on to step 200; then the job was
    cancelled and both wrote their end: status still names rank 1."""
    t0 = time.time() - 600
    log_dir = tmp_path / "runs" / "stalled"
    log_dir.mkdir(parents=True)
    stop = t0 + 200.5
    for rank, last in ((0, 200), (1, 40)):
        evs = [ev(rank, t0, "start", world_size=2, num_nodes=2, local_rank=0, pid=1, launcher="exec/local")]
        evs += [ev(rank, t0 + s, "step", step=s, total_steps=1000) for s in range(1, last + 1)]
        evs.append(ev(rank, stop + rank * 0.1, "end", status="killed", signal="SIGTERM", exit_code=None, step=last))
        (log_dir / f"rank{rank}.events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))
    rec = records.JobRecord(
        id="local-stalled-1", cluster=os.uname().nodename, name="stalled", backend="local", nodes=2,
        gpus_per_node=1, time_limit=None, log_dir=str(log_dir), config=None, overrides=[], cwd=str(tmp_path),
        submitted_at=t0 - 1, pids=[], final=records.local_final("CANCELLED", t0 - 1, stop, "ddp-hpc cancel"))
    records.write_record(rec)
    st = ddp_hpc(home, "status", "local-stalled-1").stdout
    assert "State:      CANCELLED" in st, st
    assert "First failure: rank 1 stopped first: no event for 00:02:40 before the stop (last step 40; " \
           "the others reached step 200)" in st, st


HUNG = ('Current thread 0x00007f3b3a1c9740 "MainThread" (most recent call first):\n'
        '  File "/usr/lib/python3.11/time.py", line 1 in sleep\n'
        '  File "/work/hang.py", line 31 in main\n')
WAITING = ('Current thread 0x00007f3b3a1c9740 "MainThread" (most recent call first):\n'
           '  File "/venv/lib/python3.11/site-packages/torch/autograd/graph.py", line 979 in _engine_run_backward\n'
           '  File "/work/hang.py", line 27 in main\n')


def stalled_job(tmp_path, job_id, stacks):
    """A local job of 4 ranks that all stepped to 92; then every rank went silent (rank 3 stuck,
    the others waiting for it in DDP's all-reduce), their watchdogs wrote ``stacks`` (rank ->
    stack text) at 60 s, and 74 s after the last step the job was cancelled (every rank's end)."""
    t0 = time.time() - 600
    log_dir = tmp_path / "runs" / job_id
    log_dir.mkdir(parents=True)
    stop = t0 + 92 + 74
    for rank in range(4):
        evs = [ev(rank, t0, "start", world_size=4, num_nodes=2, local_rank=rank % 2, pid=1, launcher="exec/local")]
        evs += [ev(rank, t0 + s, "step", step=s, total_steps=1000) for s in range(1, 93)]
        if rank in stacks:
            evs.append(ev(rank, t0 + 92 + 60, "stack", reason="stalled: no step for 60 s", step=92,
                          stack=stacks[rank]))
        evs.append(ev(rank, stop + rank * 0.1, "end", status="killed", signal="SIGTERM", exit_code=None, step=92))
        (log_dir / f"rank{rank}.events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))
    rec = records.JobRecord(
        id=job_id, cluster=os.uname().nodename, name="hang", backend="local", nodes=2,
        gpus_per_node=2, time_limit=None, log_dir=str(log_dir), config=None, overrides=[], cwd=str(tmp_path),
        submitted_at=t0 - 1, pids=[], final=records.local_final("CANCELLED", t0 - 1, stop, "ddp-hpc cancel"))
    records.write_record(rec)


def test_a_hang_before_a_cancel_keeps_its_diagnosis_when_every_rank_was_silent(home, tmp_path):
    """The usual hang: rank 3 sleeps, ranks 0-2 wait for it in the all-reduce, so every rank is
    silent; after the cancel the stacks written during the silence still name rank 3."""
    stalled_job(tmp_path, "local-hang-1", {0: WAITING, 1: WAITING, 2: WAITING, 3: HUNG})
    js = json.loads(ddp_hpc(home, "status", "local-hang-1", "--json").stdout)
    assert js["state_name"] == "CANCELLED" and js["failure"] is not None, js
    f = js["failure"]
    assert (f["rank"], f["ranks"], f["kind"]) == (3, [3], "stuck")
    assert "hang: rank 3 in main (hang.py:31); ranks 0-2 wait in DDP's all-reduce (backward)" in f["summary"]
    assert f["peer_stacks"] == [{"ranks": [0, 1, 2], "summary": "graph.py:979 in _engine_run_backward, "
                                                                "from hang.py:27 in main"}]
    text = ddp_hpc(home, "status", "local-hang-1").stdout
    assert ("First failure: rank 3 hung outside a collective while the others waited in one: no event for "
            "00:01:14 before the stop (last step 92); hang: rank 3 in main (hang.py:31)") in text, text


def test_a_frozen_rank_before_a_cancel_is_the_one_that_wrote_no_stack(home, tmp_path):
    stalled_job(tmp_path, "local-hang-2", {0: WAITING, 1: WAITING, 2: WAITING})
    f = json.loads(ddp_hpc(home, "status", "local-hang-2", "--json").stdout)["failure"]
    assert (f["rank"], f["ranks"]) == (3, [3]) and "wrote no stack while the others did" in f["summary"]


def test_a_whole_job_hang_before_a_cancel_says_no_rank_stopped_first(home, tmp_path):
    stalled_job(tmp_path, "local-hang-3", {})
    f = json.loads(ddp_hpc(home, "status", "local-hang-3", "--json").stdout)["failure"]
    assert f["ranks"] == [0, 1, 2, 3]
    assert f["summary"].startswith("ranks 0-3 all went silent together: the whole job hung, no rank stopped first")


HANG = """\
import os, time
import torch, torch.distributed as dist
import ddp_hpc
dist.init_process_group("gloo")
rank = dist.get_rank()
for i in range(100000):
    if rank == 1 and i == 30:
        time.sleep(100000)   # stuck in the user's own code
    t = torch.ones(1)
    dist.all_reduce(t)       # the other rank waits here for it
    ddp_hpc.report(step=i, total=100000)
    time.sleep(0.05)
"""


@pytest.mark.slow
def test_a_real_hang_cancelled_keeps_its_diagnosis(home):
    """A real local job of 2 ranks: rank 1 sleeps forever at step 30, rank 0 waits for it in the
    all-reduce. Once both ranks' watchdogs wrote their stacks (at the stall threshold, 60 s), the
    job is cancelled; status then still names rank 1 and the hang (issue 30, item 15)."""
    (home / "work" / "hang.py").write_text(HANG)
    p = ddp_hpc(home, "submit", "--backend", "local", "-N", "2", "-G", "1", "--log-dir", str(home / "runs"), "hang.py")
    job_id = p.stdout.strip().splitlines()[-1]
    rec = wait_steps(job_id, timeout=60)
    def stacked():
        return all(any(e["event"] == "stack" for e in rank_events(rec.log_dir, r).events) for r in (0, 1))
    end = time.monotonic() + 150
    while time.monotonic() < end and not stacked():
        time.sleep(1)
    assert stacked(), "the watchdogs wrote no stacks"
    ddp_hpc(home, "cancel", job_id, "--grace", "5")
    js = json.loads(ddp_hpc(home, "status", job_id, "--json").stdout)
    assert js["state_name"] == "CANCELLED" and js["failure"] is not None, js["failure"]
    f = js["failure"]
    assert (f["rank"], f["ranks"], f["kind"]) == (1, [1], "stuck"), f
    assert "hang: rank 1 in <module> (hang.py:8); rank 0 waits in all_reduce" in f["summary"], f["summary"]
    text = ddp_hpc(home, "status", job_id).stdout
    assert "First failure: rank 1 hung outside a collective while the others waited in one" in text, text
