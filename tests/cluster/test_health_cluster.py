"""The supervisor's health check on the real test cluster: a node whose node-local scratch has no
room for a checkpoint is excluded before the first start, its spare takes its place, the job
completes on the other nodes, and status says why (ddp_hpc.supervise.health; the checks
themselves: tests/test_supervise_health.py).

Each node of the test cluster has its own folder behind ``local_dir`` (the same path on every
node, slurmd's own mount namespace); the job's TMPDIR points there, and on one node a 1 MB tmpfs
is mounted at that path inside its slurmd's namespace: full for the check, which asks for 100 MB
before a run wrote its first checkpoint. (A file in the folder's place is no test: the step then
saw TMPDIR=/tmp, as slurmstepd does with a TMPDIR it cannot use.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_hpc.judge.reader import read_events
from ddp_hpc.judge.restarts import read_health

from .script_helpers import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("spare")]

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable


def _in_node(c, node: str, *argv: str) -> subprocess.CompletedProcess:
    """``argv`` in ``node``'s mount namespace (its slurmd's, which its job steps share)."""
    pid = (c.state_dir / "run" / f"slurmd-{node}.pid").read_text().strip()
    return subprocess.run(["nsenter", f"--target={pid}", "--mount", *argv], capture_output=True, text=True,
                          timeout=30)


def test_a_node_whose_scratch_is_full_is_excluded_before_the_start(slurm_cluster):
    c = slurm_cluster
    name = f"health-scratch-{time.monotonic_ns()}"
    d = c.shared_dir / name
    d.mkdir()
    good1, bad, good2 = c.spare_nodes[:3]   # the job takes the whole partition: 2 nodes and 1 spare
    scratch = c.local_dir / name
    for n in (good1, bad, good2):
        (c.state_dir / "local" / n / name).mkdir()
    mounted = _in_node(c, bad, "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(scratch))
    assert mounted.returncode == 0, mounted.stderr
    try:
        env = dict(c.env, DDP_HPC_HOME=str(d / "home"), PYTHONPATH=str(REPO), TMPDIR=str(scratch))
        p = c.run([PY, "-m", "ddp_hpc.submit", "--backend", "sbatch", "-p", c.spare_partition, "-t", "10",
                   "-G", "1", "-N", "2", "--spare-nodes", "1", "-J", "health",
                   str(REPO / "examples" / "preemptible.py"), "--steps", "4", "--ckpt-dir", str(d / "ckpt")],
                  cwd=str(d), env=env)
        assert p.returncode == 0, p.stderr
        job = p.stdout.split()[-1]
        log_dir = wait_for("the log directory", lambda: next((d / "runs").glob("health-*"), None), 60)
        state = c.wait(job, timeout=300)
        status = c.run([PY, "-m", "ddp_hpc.status", job], cwd="/", env=env, timeout=120).stdout
        said = [ln for out in log_dir.glob("slurm-*.out") for ln in out.read_text().splitlines()
                if "health check" in ln]
        print(status, *said, sep="\n")
    finally:
        _in_node(c, bad, "umount", str(scratch))
        for n in (good1, bad, good2):
            shutil.rmtree(c.state_dir / "local" / n / name, ignore_errors=True)
    assert state == "COMPLETED", status
    why = f"{scratch} full (0.0 GB free, checkpoint needs 0.1 GB)"
    [row] = read_health(log_dir)
    assert row["health_check"] == 0 and row["excluded"] == {bad: why}, row
    assert row["nodes_after"] == [good1, good2] and row["not_started"] is None, row
    hosts = {e["host"] for r in (0, 1) for e in read_events(log_dir / f"rank{r}.events.jsonl").events}
    assert hosts == {good1, good2}, hosts
    assert f"{bad} excluded: {why}" in status, status
    assert f"started on {good1}, {good2}" in status, status
