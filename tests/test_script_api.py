"""The helpers for users' own scripts: ddp_hpc.preemption, ddp_hpc.checkpoint, ddp_hpc.report, and
the examples that use them, run as real jobs of 2 pretend nodes x 1 rank under ``ddp-hpc launch`` +
``ddp_hpc.exec`` (none of them is about ranks sharing a node; the 2 x 2 layout under the wrapper:
tests/test_exec.py, and the README's ``submit -N 2 -G 2`` of examples/preemptible.py)."""
from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_exec import DROP, EXEC, clean_env, events, kinds, wait_for
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_hpc import checkpoint, preemption, progress
from ddp_hpc.env import free_port
from ddp_hpc.launch import run_local, start_local
from ddp_hpc.train.checkpoint import list_checkpoints

ROOT = Path(__file__).resolve().parents[1]
PREEMPTIBLE = str(ROOT / "examples" / "preemptible.py")


# ----------------------------------------------------------------------------- preemption, 2 x 1
@pytest.mark.timeout(240)
def test_usr2_to_one_rank_stops_every_rank_at_the_same_step_and_a_rerun_resumes(tmp_path):
    """The only real script run (ddp_hpc.preemption under the wrapper) where one rank (rank 1, not
    rank 0, on the other pretend node) gets the signal and every rank stops at the same step; the
    rerun resumes from that step."""
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    argv = [*EXEC, "--", sys.executable, PREEMPTIBLE, "--steps", "2000", "--sleep", "0.02", "--ckpt-dir", str(ckpt)]
    run = start_local(argv, nodes=2, procs_per_node=1, log_dir=logs, env=clean_env())
    try:
        wait_for(lambda: "step" in kinds(logs, 1), timeout=120, what="rank 1's first step")
        os.kill(run.procs[1].pid, signal.SIGUSR2)      # rank 1's wrapper, which passes it on
        codes = [p.wait(timeout=120) for p in run.procs]
    finally:
        run.kill(grace=0)
    assert codes == [75] * 2, [(logs / f"rank{r}.out").read_text()[-1500:] for r in range(2)]
    stops = {}
    for r in range(2):
        ev = events(logs, r)
        (preempt,), end = [e for e in ev if e["event"] == "preempt"], ev[-1]
        assert (end["event"], end["status"], end["exit_code"]) == ("end", "preempted", 75)
        assert preempt["reason"] == "preemption" and "error" not in kinds(logs, r)
        assert preempt["signal"] == ("SIGUSR2" if r == 1 else None)     # only rank 1 got it
        assert end["step"] is not None and end["step"] <= preempt["step"]
        stops[r] = preempt["step"]
    (step,) = set(stops.values())                                 # every rank stopped at one step
    assert [s for s, _ in list_checkpoints(ckpt)] == [step]
    assert f"stopped at step {step} of 2000" in (logs / "rank0.out").read_text()

    res = run_local([*EXEC, "--", sys.executable, PREEMPTIBLE, "--steps", str(step + 3), "--ckpt-dir", str(ckpt)],
                    nodes=2, procs_per_node=1, log_dir=logs, env=clean_env())
    assert res.ok, (logs / "rank0.out").read_text()[-2000:]
    assert f"2 ranks, {step + 3} steps (resumed from step {step})" in (logs / "rank0.out").read_text()
    assert events(logs, 0)[-1]["status"] == "completed" and events(logs, 0)[-1]["step"] == step + 3


@pytest.mark.timeout(180)
@pytest.mark.parametrize("example, words", [
    ("lightning_style.py", "lightning_style: 2 ranks, 40 steps, final loss"),
    ("preemptible.py", "preemptible: 2 ranks, 50 steps, final loss"),      # a fresh run: no "resumed"
])
def test_example_runs_2x1_under_launch_and_exec(tmp_path, example, words):
    ddp_hpc = Path(sys.executable).with_name("ddp-hpc")
    p = subprocess.run([str(ddp_hpc), "launch", "--nodes", "2", "--procs-per-node", "1", "--log-dir",
                        str(tmp_path / "logs"), "--", *EXEC, "--", sys.executable, str(ROOT / "examples" / example),
                        "--ckpt-dir", str(tmp_path / "ckpt")],
                       cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=170)
    assert p.returncode == 0 and words in p.stdout, p.stdout + p.stderr
    for r in range(2):
        assert events(tmp_path / "logs", r)[-1]["status"] == "completed"
        assert "step" in kinds(tmp_path / "logs", r)
    assert len(list_checkpoints(tmp_path / "ckpt")) == 1


# ----------------------------------------------------------------------------- requeue, one process
REQUEUE_SCRIPT = """
import os, signal, sys
from ddp_hpc import checkpoint, preemption, report
import torch
preemption.install()
report(step=7, total=10)
os.kill(os.getpid(), getattr(signal, sys.argv[1]))
assert preemption.requested()
checkpoint.save(sys.argv[2], torch.nn.Linear(2, 1), step=7)
preemption.requeue()
print("not reached")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig, requeued", [("SIGUSR1", True), ("SIGTERM", False)])
def test_requeue_under_slurm_only_for_the_preemption_signal(tmp_path, sig, requeued):
    """A Slurm job's rank (faked: a torchrun-style rank with SLURM_JOB_ID, and an ``scontrol`` that
    records its arguments): the job's signal (USR1 here) requeues it, SIGTERM does not."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    fake = bin_dir / "scontrol"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="4242", RANK="0", LOCAL_RANK="0",
                    WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                    DDP_HPC_LOG_DIR=str(tmp_path / "logs"), DDP_HPC_PREEMPT_SIGNAL="USR1")
    p = subprocess.run([sys.executable, "-c", REQUEUE_SCRIPT, sig, str(tmp_path / "ckpt")], env=env,
                       capture_output=True, text=True, timeout=110)
    assert p.returncode == 75 and "not reached" not in p.stdout, p.stderr
    ev = {e["event"]: e for e in events(tmp_path / "logs", 0)}
    assert (ev["preempt"]["signal"], ev["preempt"]["step"]) == (sig, 7)
    assert ev["checkpoint"]["step"] == 7
    if requeued:
        assert calls.read_text().split() == ["requeue", "4242"] and ev["requeue"]["job_id"] == "4242"
    else:
        assert not calls.exists() and "requeue" not in ev
        assert "not requeuing: SIGTERM" in (tmp_path / "logs" / "rank0.log").read_text()


@pytest.fixture
def fresh_flag(monkeypatch):
    """ddp_hpc.preemption with no handler installed; the process's handlers restored afterwards."""
    monkeypatch.setattr(preemption, "_flag", None)
    for k in [k for k in os.environ if DROP.match(k)]:
        monkeypatch.delenv(k)
    yield
    if preemption._flag is not None:
        preemption._flag.restore()


def test_requested_is_local_without_torch_distributed(fresh_flag):
    assert not preemption.requested()
    flag = preemption._flag
    assert preemption.install() is flag                      # idempotent
    os.kill(os.getpid(), signal.SIGUSR2)
    assert preemption.requested() and flag.requeue_wanted
    assert preemption.requested()                            # stays true


def test_sigterm_is_requested_but_no_requeue(fresh_flag):
    preemption.install()
    os.kill(os.getpid(), signal.SIGTERM)
    assert preemption.requested() and not preemption._flag.requeue_wanted


def test_preempt_signal(fresh_flag, monkeypatch):
    assert preemption.preempt_signal() == "USR2"
    assert [preemption.preempt_signal(s) for s in ("usr1", "SIGUSR1", "B:USR1@90")] == ["USR1"] * 3
    monkeypatch.setenv("DDP_HPC_PREEMPT_SIGNAL", "USR1")
    assert preemption.preempt_signal() == "USR1"
    assert preemption.install().preempt_signum == signal.SIGUSR1
    with pytest.raises(AttributeError):
        preemption.preempt_signal("NOPE")


# ----------------------------------------------------------------------------- checkpoint
@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))


def test_checkpoint_round_trip_without_module_prefix(tmp_path, one_rank_group):
    ddp = DDP(_model(0))
    opt = torch.optim.Adam(ddp.parameters(), lr=0.1)
    ddp(torch.randn(5, 4)).sum().backward()
    opt.step()
    assert checkpoint.load(tmp_path, ddp, opt) is None                     # nothing saved yet
    for step in (10, 20, 30, 40):
        path = checkpoint.save(tmp_path, ddp, opt, step=step, keep_last=2, epoch=1, note="x", hist=[1.5, 2])
    assert path == tmp_path / "ckpt-000000040.pt" and [s for s, _ in list_checkpoints(tmp_path)] == [40, 30]
    saved = torch.load(path, weights_only=True)
    assert not any(k.startswith("module.") for k in saved["model"])
    plain, opt2 = _model(1), None
    opt2 = torch.optim.Adam(plain.parameters(), lr=0.1)
    extras = checkpoint.load(tmp_path, plain, opt2)                      # DDP-saved into a plain model
    assert extras == {"epoch": 1, "note": "x", "hist": [1.5, 2], "step": 40}
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), ddp.module.state_dict().values()))
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    again = DDP(_model(2))                                               # and back into DDP
    assert checkpoint.load(tmp_path / "ckpt-000000030.pt", again)["step"] == 30
    assert all(torch.equal(a, b) for a, b in zip(again.module.state_dict().values(), ddp.module.state_dict().values()))


def test_checkpoint_with_module_prefix_loads_into_a_plain_model(tmp_path, fresh_flag):
    from ddp_hpc.train.checkpoint import save_checkpoint
    src = _model(0)
    state = {"model": {f"module.{k}": v for k, v in src.state_dict().items()}, "optimizer": None,
             "epoch": 0, "batch_in_epoch": 0}
    save_checkpoint(tmp_path, 5, state)
    dst = _model(1)
    assert checkpoint.load(tmp_path, dst) == {"step": 5}
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values()))


def test_checkpoint_refuses_extras_weights_only_cannot_load(tmp_path, fresh_flag):
    with pytest.raises(checkpoint.CheckpointError, match=r"extras\['cfg'\]\[0\] \(object\) cannot be"):
        checkpoint.save(tmp_path, _model(0), step=1, cfg=[object()])
    assert list_checkpoints(tmp_path) == []


# ----------------------------------------------------------------------------- report
def test_report_writes_at_most_one_step_event_per_second(tmp_path, monkeypatch):
    for k in [k for k in os.environ if DROP.match(k)]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("DDP_HPC_LOG_DIR", str(tmp_path))
    monkeypatch.setattr(progress, "_state", progress._State())
    clock = [100.0]
    monkeypatch.setattr(progress, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    try:
        for t, step in [(0.0, 1), (0.3, 2), (0.9, 3), (1.1, 4), (1.5, 5), (1.6, 10)]:
            clock[0] = 100.0 + t
            progress.report(step=step, total=10, loss=torch.tensor(0.5), lr=0.01, epoch=0, acc=0.9)
        assert progress.hang_watch() is not None   # the run log came with its watchdog
    finally:
        last = progress.last_step()
        progress.close()                           # which gives the signal wakeup fd back
    steps = [e for e in events(tmp_path, 0) if e["event"] == "step"]
    assert [e["step"] for e in steps] == [1, 4, 10]           # first, once a second, final
    assert (steps[0]["loss"], steps[0]["lr"], steps[0]["epoch"], steps[0]["total_steps"]) == (0.5, 0.01, 0, 10)
    assert steps[0]["metrics"] == {"acc": 0.9}
    assert last == 10


def test_report_without_a_log_dir_does_nothing(tmp_path, monkeypatch):
    for k in [k for k in os.environ if DROP.match(k)]:
        monkeypatch.delenv(k)
    monkeypatch.setattr(progress, "_state", progress._State())
    monkeypatch.chdir(tmp_path)
    progress.report(step=1, total=2, loss=1.0)
    assert list(tmp_path.iterdir()) == [] and progress.last_step() == 1


def test_docs_name_every_event_key_the_wrapper_writes():
    from ddp_hpc.runlogs.schema import EVENTS
    text = (ROOT / "docs" / "scripts.md").read_text() + (ROOT / "docs" / "architecture.md").read_text()
    for name in ("start", "error", "end"):
        for key in EVENTS[name]:
            assert re.search(rf"\b{key}\b", text), (name, key)
