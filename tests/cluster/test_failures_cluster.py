"""What status says when a rank dies without a Python exception, on the real test cluster (the
demo job through ``submit --backend sbatch``): a rank killed with SIGKILL (what the OOM killer
does), a rank stopped with SIGSTOP (a hang: STALLED while it lasts, then blamed as stuck with its
peers' stacks), and a rank whose data loader is slow (named as a straggler). Each test prints how
long the job took to end and what status said.

The killed and the stopped rank run 2 nodes x 1 task (rank 1 on the second node): each rank
process costs ~2 s of CPU to import torch, and one peer on another node shows the fault as well
as three. The straggler needs 2 nodes x 2 tasks: a median of 4 ranks to be slower than, and a
slow rank whose node-mate is not (a slow rank, not a slow node)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from ddp_hpc.judge.nodefiles import rank_events

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
SLOW = ["data.dataset=tests.cluster.status_helpers:slow_synthetic", "data.kwargs.delay=0.01",
        "data.kwargs.size=8192", "log.every_n_steps=2", "train.epochs=1", "data.eval_split=0.0"]


@pytest.fixture
def env(slurm_cluster):
    d = slurm_cluster.shared_dir / f"failures-{time.monotonic_ns()}"
    d.mkdir()
    return dict(slurm_cluster.env, DDP_HPC_HOME=str(d / "home"), PYTHONPATH=str(REPO)), d


def _submit(c, env, name, overrides, gpus: int = 1) -> tuple[str, Path]:
    e, d = env
    p = c.run([PY, "-m", "ddp_hpc.submit", "--backend", "sbatch", "-N", "2", "-G", str(gpus), "-t", "10",
               "--max-restarts", "0", "-J", name,
               str(REPO / "jobs" / "demo.yaml"), "--", f"log.dir={d / 'runs'}",
               *overrides], cwd=str(REPO), env=e)
    assert p.returncode == 0, p.stderr
    job = p.stdout.split()[-1]
    return job, next((d / "runs").glob(f"{name}-*"))


def _status(c, env, *args) -> str:
    p = c.run([PY, "-m", "ddp_hpc.status", *args], cwd="/", env=env[0], timeout=120)
    return p.stdout + p.stderr


def _start(c, job: str, log_dir: Path, rank: int, steps: int = 4, timeout: float = 180,
           ranks: int = 2) -> dict:
    """Rank ``rank``'s start event, once every rank has written ``steps`` step events. The
    ``timeout`` runs from when the job left the queue: while the other tests' jobs (or a heal of
    the cluster) keep it PENDING, its ranks have not begun (a loaded check run kept one pending
    past the whole timeout); the test's own timeout bounds the wait."""
    deadline, asked, queued = time.monotonic() + timeout, 0.0, None
    while time.monotonic() < deadline:
        evs = {r: rank_events(log_dir, r).events for r in range(ranks)}
        if all(sum(e["event"] == "step" for e in evs[r]) >= steps for r in range(ranks)):
            return next(e for e in evs[rank] if e["event"] == "start")
        if time.monotonic() - asked > 5:           # squeue every 5 s, not at every look
            asked = time.monotonic()
            p = c.run(["squeue", "-h", "-j", job, "-o", "%T %r"], timeout=30)
            queued = p.stdout.strip() or "no longer queued"
            if queued.startswith("PENDING"):
                deadline = time.monotonic() + timeout
        time.sleep(0.5)
    counts = {r: sum(e["event"] == "step" for e in evs[r]) for r in range(ranks)}
    pytest.fail(f"training did not get under way in {log_dir}: job {job} {queued} (squeue), "
                f"step events by rank {counts}")


def test_sigkill_of_one_rank_is_named_killed(slurm_cluster, env):
    """Only test of a rank killed by a signal (no supervisor restarts) blamed by status, its peer
    named a consequence."""
    c = slurm_cluster
    job, log_dir = _submit(c, env, "f-kill", SLOW)
    start = _start(c, job, log_dir, 1)
    os.kill(start["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    state = c.wait(job, timeout=240)
    detail = _status(c, env, job)
    print(f"ended {time.monotonic() - t0:.1f} s after SIGKILL ({state})\n{detail}")
    first = next(ln for ln in detail.splitlines() if ln.startswith("First failure:"))
    assert first.startswith(f"First failure: rank 1 on {start['host']} killed by signal 9 (SIGKILL)")
    assert "lost its peer rank 1" in detail


def test_sigstop_of_one_rank_is_stalled_then_stuck(slurm_cluster, env):
    """Only test of a frozen rank (no stack of its own) shown STALLED while it lasts and blamed as
    stuck once its peer's collective times out; the stall takes its minimum of 60 s to show."""
    c = slurm_cluster
    job, log_dir = _submit(c, env, "f-stop", [*SLOW, "train.collective_timeout_s=90"])
    start = _start(c, job, log_dir, 1)
    os.kill(start["pid"], signal.SIGSTOP)
    t0 = time.monotonic()
    stalled = None
    try:
        while time.monotonic() - t0 < 87 and stalled is None:   # frozen: named >= ~68 s
            time.sleep(3)
            row = json.loads(c.run([PY, "-m", "ddp_hpc.status", job, "--json"], cwd="/",
                                   env=env[0], timeout=120).stdout)
            if (row.get("stall") or {}).get("no_stack"):   # stalled, and the silent rank named
                stalled = (time.monotonic() - t0, _status(c, env, job))
        state = c.wait(job, timeout=240)
    finally:
        try:
            os.kill(start["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass
    detail = _status(c, env, job)
    print(f"STALLED shown {stalled[0] if stalled else -1:.0f} s after SIGSTOP:\n"
          f"{stalled[1] if stalled else '-'}\nended {time.monotonic() - t0:.1f} s after SIGSTOP "
          f"({state})\n{detail}")
    assert stalled is not None, detail
    assert "State:      RUNNING, STALLED" in stalled[1]
    assert "rank 1 wrote no stack while the others did" in stalled[1]
    first = next(ln for ln in detail.splitlines() if ln.startswith("First failure:"))
    assert first.startswith(f"First failure: rank 1 on {start['host']} stuck"), detail
    assert "timed out waiting for rank 1" in detail and "    rank 0 was in " in detail   # its peer's stack


def test_a_rank_with_a_slow_loader_is_named(slurm_cluster, env):
    """Only test of a straggler (a slow data loader) named by status from real ranks' events."""
    c = slurm_cluster
    job, log_dir = _submit(c, env, "f-slow", [
        *SLOW, "data.dataset=tests.cluster.status_helpers:one_slow_rank", "data.kwargs.size=4096",
        "data.kwargs.delay=0.002", "data.kwargs.slow_rank=3", "data.kwargs.slow_delay=0.01"], gpus=2)
    state = c.wait(job, timeout=300)
    detail = _status(c, env, job)
    print(f"{state}\n{detail}")
    assert state == "COMPLETED"
    line = next(ln for ln in detail.splitlines() if "slower waiting for data" in ln)
    assert "rank 3 on" in line
