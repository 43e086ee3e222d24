"""The supervisor's health check on the real test cluster leaves healthy nodes alone (issue 38,
bug 5): nodes whose node-local scratch is a 1 MB tmpfs, where a plain script's job never writes a
checkpoint, are not excluded; the job completes on the nodes it asked for and status says nothing
of a health check (the exclusions themselves, a lost GPU or a growing ECC count:
tests/test_supervise_health.py; which folders apply to which job: tests/test_do_no_harm_health.py).

Each node of the test cluster has its own folder behind ``local_dir`` (the same path on every
node, slurmd's own mount namespace); the job's TMPDIR points there, and on every node of the
partition a 1 MB tmpfs is mounted at that path inside its slurmd's namespace. (A file in the
folder's place is no test: the step then saw TMPDIR=/tmp, as slurmstepd does with a TMPDIR it
cannot use.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_hpc.judge.nodefiles import rank_events
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


def test_nodes_whose_scratch_is_a_tiny_tmpfs_are_not_excluded(slurm_cluster):
    """Only test that the health check before the first start leaves nodes with a tiny scratch in."""
    c = slurm_cluster
    name = f"health-scratch-{time.monotonic_ns()}"
    d = c.shared_dir / name
    d.mkdir()
    nodes = c.spare_nodes[:3]   # the job takes the whole partition: 2 nodes and 1 spare
    scratch = c.local_dir / name
    mounted = []
    try:
        for n in nodes:
            (c.state_dir / "local" / n / name).mkdir()
            m = _in_node(c, n, "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(scratch))
            assert m.returncode == 0, m.stderr
            mounted.append(n)
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
        for n in mounted:
            _in_node(c, n, "umount", str(scratch))
        for n in nodes:
            shutil.rmtree(c.state_dir / "local" / n / name, ignore_errors=True)
    assert state == "COMPLETED", status
    assert read_health(log_dir) == [], read_health(log_dir)       # nobody excluded
    assert any("all passed" in ln for ln in said), said            # the check ran, and passed
    hosts = {e["host"] for r in (0, 1) for e in rank_events(log_dir, r).events}
    assert hosts == set(nodes[:2]), hosts                          # the spare stayed a spare
    assert "excluded" not in status and "Health check" not in status, status
