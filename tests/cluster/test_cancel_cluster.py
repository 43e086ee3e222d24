"""``ddp-hpc cancel`` against a real Slurm: a running script job (2 nodes) and one task of a sweep
(a job array) are cancelled with scancel through ``ddp_hpc.slurm.cli``; status, run from another
directory, then says CANCELLED, and the job records keep it."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from ddp_hpc import records

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
SLEEPER = """\
import time, ddp_hpc
for i in range(3000):
    ddp_hpc.report(step=i, total=3000)
    time.sleep(0.2)
"""
SLOW = ["data.dataset=tests.cluster.status_helpers:slow_synthetic", "data.kwargs.delay=0.05",
        "data.kwargs.size=4096", "train.epochs=50"]


@pytest.fixture(scope="module")
def env(slurm_cluster):
    return dict(slurm_cluster.env, DDP_HPC_HOME=str(slurm_cluster.shared_dir / "cancel-home"),
                PYTHONPATH=str(REPO))


@pytest.fixture(scope="module")
def work(slurm_cluster):
    d = slurm_cluster.shared_dir / "cancel-work"
    d.mkdir(exist_ok=True)
    (d / "sleeper.py").write_text(SLEEPER)
    return d


def ddp_hpc(c, env, cwd, *args, ok=True, timeout=120):
    p = c.run([PY, "-m", "ddp_hpc", *args], cwd=str(cwd), env=env, timeout=timeout)
    if ok:
        assert p.returncode == 0, p.stdout + p.stderr
    return p


def wait_running(c, job_id, timeout=120):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if c.queue_state(job_id) == "RUNNING":
            return
        time.sleep(1)
    raise AssertionError(f"job {job_id} not RUNNING after {timeout} s: {c.queue_state(job_id)}")


def test_cancel_a_running_job_and_one_array_task(slurm_cluster, env, work):
    c = slurm_cluster
    p = ddp_hpc(c, env, work, "submit", "--backend", "sbatch", "-N", "2", "-G", "1", "-t", "10",
                "--log-dir", str(work / "runs"), "sleeper.py")
    job = p.stdout.strip().splitlines()[-1]
    wait_running(c, job)
    out = ddp_hpc(c, env, work, "cancel", job).stdout
    assert f"job {job}: scancel sent; Slurm says CANCELLED" in out, out
    st = ddp_hpc(c, env, REPO, "status", job).stdout
    assert "State:      CANCELLED" in st, st
    assert str(records.load_record(job, environ=env).final["state_name"]) == "CANCELLED"

    p = ddp_hpc(c, env, REPO, "submit", "--backend", "sbatch", "-N", "1", "-G", "1", "-t", "10",
                "jobs/demo.yaml", "--sweep", "train.seed=0,1", "--", f"log.dir={work / 'runs'}", *SLOW)
    array = p.stdout.strip().splitlines()[-1]
    wait_running(c, f"{array}_1", timeout=180)
    out = ddp_hpc(c, env, work, "cancel", f"{array}_1").stdout
    assert f"job {array}_1: scancel sent; Slurm says CANCELLED" in out, out
    assert c.queue_state(f"{array}_0") in ("RUNNING", "PENDING", "CONFIGURING")  # the other task goes on
    st = ddp_hpc(c, env, REPO, "status", f"{array}_1").stdout
    assert "State:      CANCELLED" in st, st
    ddp_hpc(c, env, work, "cancel", array)
    table = ddp_hpc(c, env, REPO, "status").stdout
    rows = [ln for ln in table.splitlines() if ln.startswith(f"{array}_")]
    assert len(rows) == 2 and all(" CANCELLED " in r for r in rows), table
    finals = records.load_record(array, environ=env).final
    assert {k: v["state_name"] for k, v in finals.items()} == {"0": "CANCELLED", "1": "CANCELLED"}


def test_cancel_of_an_id_slurm_does_not_know(slurm_cluster, env, work):
    p = ddp_hpc(slurm_cluster, env, work, "cancel", "999999", ok=False)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Slurm does not know job 999999" in p.stderr and "HINT:" in p.stderr
