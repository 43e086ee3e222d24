"""The supervisor's health check on the real test cluster: a node whose node-local scratch takes no
file is excluded before the first start, its spare takes its place, the job completes on the other
nodes, and status says why (ddp_hpc.supervise.health; the checks themselves:
tests/test_supervise_health.py).

Each node of the test cluster has its own folder behind ``local_dir`` (the same path on every
node); the job's TMPDIR points there, and on one node a file stands where the folder should be:
unwritable even for root, whom the jobs run as."""

from __future__ import annotations

import shutil
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


def test_a_node_whose_scratch_takes_no_file_is_excluded_before_the_start(slurm_cluster):
    c = slurm_cluster
    name = f"health-scratch-{time.monotonic_ns()}"
    d = c.shared_dir / name
    d.mkdir()
    good1, bad, good2 = c.spare_nodes[:3]   # the job takes the whole partition: 2 nodes and 1 spare
    backing = {n: c.state_dir / "local" / n / name for n in (good1, bad, good2)}
    try:
        for n, path in backing.items():
            path.write_text("not a folder") if n == bad else path.mkdir()
        env = dict(c.env, DDP_HPC_HOME=str(d / "home"), PYTHONPATH=str(REPO), TMPDIR=str(c.local_dir / name))
        p = c.run([PY, "-m", "ddp_hpc.submit", "--backend", "sbatch", "-p", c.spare_partition, "-t", "10",
                   "-G", "1", "-N", "2", "--spare-nodes", "1", "-J", "health",
                   str(REPO / "examples" / "preemptible.py"), "--steps", "4", "--ckpt-dir", str(d / "ckpt")],
                  cwd=str(d), env=env)
        assert p.returncode == 0, p.stderr
        job = p.stdout.split()[-1]
        log_dir = wait_for("the log directory", lambda: next((d / "runs").glob("health-*"), None), 60)
        state = c.wait(job, timeout=300)
        status = c.run([PY, "-m", "ddp_hpc.status", job], cwd="/", env=env, timeout=120).stdout
        print(status)
    finally:
        for path in backing.values():
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    assert state == "COMPLETED", status
    why = f"{c.local_dir / name} not writable (Not a directory)"
    [row] = read_health(log_dir)
    assert row["health_check"] == 0 and row["excluded"] == {bad: why}, row
    assert row["nodes_after"] == [good1, good2] and row["not_started"] is None, row
    hosts = {e["host"] for r in (0, 1) for e in read_events(log_dir / f"rank{r}.events.jsonl").events}
    assert hosts == {good1, good2}, hosts
    assert f"{bad} excluded: {why}" in status, status
    assert f"started on {good1}, {good2}" in status, status
