"""A node that dies under a running job, on the real test cluster: every process of the node
running rank 1 (its slurmd, slurmstepd and the rank) killed at once. Slurm marks the node
DOWN after SlurmdTimeout, ends the run NODE_FAIL and requeues it onto nodes that are up; the
restart resumes from the newest checkpoint and status names the node. Then the node comes back
(ReturnToService) and the job is requeued from outside (as an admin or a preemption would):
Slurm places the run on the revived node again, and the batch script's check
(preempt.exclude_failed_nodes, on by default) requeues it off that node with ExcNodeList. The test
prints how long each stage took and what status said.

The job runs in the test cluster's partition ``spare`` (3 nodes of its own): the node it kills
runs nothing of the other tests, which go on meanwhile, and Slurm's placement is this job's alone.
It is 2 nodes x 1 task: a node's ranks vanish together whatever their number, and each rank
process costs ~2 s of CPU to import torch."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from ddp_hpc.judge.nodefiles import rank_events
from ddp_hpc.slurm.cli import SlurmCLI
from ddp_hpc.slurm.hostlist import expand

from .script_helpers import wait_for

# with the tests that use the spare partition's GPUs, one after the other on one worker
pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("spare")]

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
# 2 ranks x 64 samples x 0.01 s: 32 steps of ~0.6 s
SLOW = ["data.dataset=tests.cluster.status_helpers:slow_synthetic", "data.kwargs.delay=0.01",
        "data.kwargs.size=4096", "log.every_n_steps=2", "train.epochs=1", "data.eval_split=0.0",
        "checkpoint.every_steps=5"]


def _job_row(cli: SlurmCLI, job: str) -> dict:
    rows = cli.squeue([job])
    return rows[0] if rows else {}


def _steps(log_dir: Path, restart: int) -> dict[int, int]:
    out = {}
    for r in range(2):
        evs = rank_events(log_dir, r).events
        out[r] = sum(e["event"] == "step" and e.get("restart", 0) == restart for e in evs)
    return out


def _running_on(cli, job, restart):
    row = _job_row(cli, job)
    if row.get("State") == "RUNNING" and int(row.get("RestartCnt") or 0) >= restart:
        return expand(row["NodeList"])
    return None


def test_a_dead_node_is_named_the_job_resumes_elsewhere_and_later_avoids_it(slurm_cluster, tmp_path, request):
    """Only test of a lost node healed by Slurm's own requeue (NODE_FAIL, no supervisor restarts)
    and of the batch script's check that moves a requeued run off a node that failed it."""
    c = slurm_cluster
    c.need_node_failure()
    d = c.shared_dir / f"nodefail-{time.monotonic_ns()}"
    env = dict(c.env, DDP_HPC_HOME=str(d / "home"), PYTHONPATH=str(REPO))
    cli = SlurmCLI(env=c.env)
    assert len(c.spare_nodes) == 3   # 2 for the job, 1 to resume on while the dead node is down
    p = c.run([PY, "-m", "ddp_hpc.submit", "--backend", "sbatch", "-N", "2", "-G", "1", "-t", "10",
               "--max-restarts", "0", "-p", c.spare_partition,
               "-J", "nodefail", str(REPO / "jobs" / "demo.yaml"), "--",
               f"log.dir={d / 'runs'}", *SLOW],
              cwd=str(REPO), env=env)
    assert p.returncode == 0, p.stderr
    job = p.stdout.split()[-1]
    # a failure must not leave the job holding the spare partition for the next test
    request.addfinalizer(lambda: c.run(["scancel", job], timeout=30))
    log_dir = next((d / "runs").glob("nodefail-*"))
    wait_for("6 steps on every rank", lambda: min(_steps(log_dir, 0).values()) >= 6, 180, 0.5)
    dead = next(e for e in rank_events(log_dir, 1).events if e["event"] == "start")["host"]
    t0 = time.monotonic()
    try:
        c.fail_node(dead)
        nodes1 = wait_for("the restart after NODE_FAIL", lambda: _running_on(cli, job, 1), 180, 1.0)
        t_restart = time.monotonic() - t0
        assert dead not in nodes1
        status1 = c.run([PY, "-m", "ddp_hpc.status", job], cwd="/", env=env, timeout=120).stdout
    finally:
        c.revive_node(dead)
    wait_for("restart 1 under way", lambda: min(_steps(log_dir, 1).values()) >= 2, 180, 0.5)
    # the node is back in service; a requeue from outside lets Slurm place the job on it again
    c.run(["scontrol", "requeue", job], timeout=30)
    state = c.wait(job, timeout=400)
    t_end = time.monotonic() - t0
    detail = c.run([PY, "-m", "ddp_hpc.status", job], cwd="/", env=env, timeout=120).stdout
    batch = (log_dir / f"slurm-{job}.out").read_text()
    shown = c.run(["scontrol", "show", "job", "-o", job], timeout=30).stdout
    rank0 = (log_dir / "rank0.log").read_text()
    print(f"node {dead} killed; restart 1 on {nodes1} {t_restart:.0f} s later; job {state} "
          f"{t_end:.0f} s after the kill\n--- status during restart 1:\n{status1}\n--- batch output:\n"
          f"{batch}\n--- status at the end:\n{detail}\n--- {shown}")
    assert state == "COMPLETED"
    assert f"node {dead} failed (NODE_FAIL): rank 1 vanished" in status1
    assert f"first failure: node {dead} failed (NODE_FAIL): rank 1 vanished" in detail
    assert re.search(r"resumed from \S+ckpt-\d+\.pt at step [1-9]", rank0), rank0
    if f"landed on {dead}, which failed an earlier run" not in batch:
        pytest.fail(f"the requeued run was not placed on {dead} again, so the check was not "
                    f"exercised:\n{batch}")
    assert batch.count("which failed an earlier run: requeueing") == 1, batch   # off it at once
    words = dict(w.split("=", 1) for w in shown.split() if "=" in w)
    assert dead in expand(words["ExcNodeList"]) and dead not in expand(words["NodeList"]), shown
