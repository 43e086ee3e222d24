"""``--nodes MIN-MAX`` on the real test cluster: with all but one node of the partition drained,
a job asking for 1-2 nodes starts on the one that is free and runs with it (its ranks are that
node's tasks, from Slurm's variables), instead of waiting for a second node.

The job runs in the partition ``spare`` (3 nodes of its own), on one worker with the other tests
that use it, so draining two of its nodes for a moment disturbs no other test."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from ddp_hpc import records
from ddp_hpc.judge.nodefiles import log_events, rank_events

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("spare")]

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
SHORT = ["train.max_steps=3", "train.epochs=1", "data.kwargs.size=512", "data.eval_split=0.0",
         "checkpoint.every_epochs=0"]


def test_a_node_range_starts_on_the_one_free_node_and_runs_with_it(slurm_cluster):
    """Only test of ``--nodes MIN-MAX`` on real Slurm: the job starts with fewer nodes."""
    c = slurm_cluster
    work = c.shared_dir / f"range-{time.monotonic_ns()}"
    work.mkdir()
    env = {**c.env, "DDP_HPC_HOME": str(work / "home")}
    free, drained = c.spare_nodes[0], ",".join(c.spare_nodes[1:])
    p = c.run(["scontrol", "update", f"nodename={drained}", "state=drain", "reason=ddp_hpc node range test"])
    assert p.returncode == 0, p.stderr
    try:
        p = c.run([PY, "-m", "ddp_hpc.submit", "-p", c.spare_partition, "--nodes", "1-2", "--gpus", "2",
                   "--time", "00:10:00", str(ROOT / "jobs" / "demo.yaml"), "--wait", "--wait-timeout", "180",
                   "--", *SHORT], cwd=str(work), env=env, timeout=240)
    finally:
        c.run(["scontrol", "update", f"nodename={drained}", "state=resume"])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "backend sbatch:" in p.stderr and "--nodes 1-2 is a range" in p.stderr   # auto -> sbatch
    assert "(sbatch, 1-2 nodes x 2 tasks)" in p.stderr
    (rec,) = records.list_records({"DDP_HPC_HOME": str(work / "home")})
    log_dir = Path(rec.log_dir)
    assert "#SBATCH --nodes=1-2\n" in (log_dir / "job.sbatch").read_text()
    starts = [next(e for e in rank_events(log_dir, r).events if e["event"] == "start")
              for r in range(2)]
    assert [(s["world_size"], s["num_nodes"]) for s in starts] == [(2, 1)] * 2
    if c.layout == "netns":                       # each node has its own hostname
        assert {s["host"] for s in starts} == {free}
    assert 2 not in log_events(log_dir)
    ends = [rank_events(log_dir, r).events[-1] for r in range(2)]
    assert [(e["event"], e["status"], e["step"]) for e in ends] == [("end", "completed", 3)] * 2
