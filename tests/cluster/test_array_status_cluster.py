"""Status of a job array on the real test cluster: ``ddp-hpc submit --sweep`` of a tiny script (6
tasks, half of them exit with status 3), then ``ddp-hpc status`` from another directory shows each
task's own state, asks squeue once and sacct at most once per refresh (logged by wrappers around
them on PATH), and ``--logs`` of a task shows the script's own output.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
TINY = """import argparse, sys, time
p = argparse.ArgumentParser()
p.add_argument("--code", type=int)
p.add_argument("--nap", type=float)
a = p.parse_args()
print(f"tiny task code={a.code} nap={a.nap}", flush=True)
time.sleep(a.nap)
sys.exit(a.code)
"""
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


@pytest.fixture
def where(slurm_cluster):
    """A working directory on the shared filesystem, a private DDP_HPC_HOME, and squeue / sacct
    wrappers on PATH that log each call before running the real command."""
    d = slurm_cluster.shared_dir / f"array-status-{time.monotonic_ns()}"
    wrappers = d / "wrappers"
    wrappers.mkdir(parents=True)
    calls = d / "calls.log"
    for name in ("squeue", "sacct"):
        real = shutil.which(name, path=slurm_cluster.env.get("PATH"))
        assert real, f"{name} not on the cluster's PATH"
        w = wrappers / name
        w.write_text(f'#!/bin/sh\necho "{name} $*" >> "{calls}"\nexec "{real}" "$@"\n')
        w.chmod(0o755)
    env = {**slurm_cluster.env, "DDP_HPC_HOME": str(d / "home"), "PYTHONPATH": str(REPO),
           "PATH": f"{wrappers}{os.pathsep}{slurm_cluster.env.get('PATH', os.environ['PATH'])}"}
    (d / "tiny.py").write_text(TINY)
    (d / "elsewhere").mkdir()
    return d, env, calls


def status(c, d, env, *args):
    p = c.run([PY, "-m", "ddp_hpc.status", *args], cwd=str(d / "elsewhere"), env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    return p


def test_each_array_task_has_its_state_for_one_squeue_and_one_sacct(slurm_cluster, where):
    c, (d, env, calls) = slurm_cluster, where
    p = c.run([PY, "-m", "ddp_hpc.submit", "--backend", "sbatch", "--nodes", "1", "--gpus", "1", "--time", "5",
               "--job-name", "arr", "--sweep", "code=0,3", "--sweep", "nap=1,4,8", str(d / "tiny.py")],
              cwd=str(d), env=env, timeout=300)
    assert p.returncode == 0, p.stderr + p.stdout
    job = p.stdout.strip().splitlines()[-1].split()[0]
    want = {f"{job}_{i}": ("COMPLETED" if i < 3 else "FAILED") for i in range(6)}
    seen: dict[str, set[str]] = {t: set() for t in want}
    deadline, rows = time.monotonic() + 240, []
    while time.monotonic() < deadline:
        calls.write_text("")
        rows = [r for r in json.loads(status(c, d, env, "--json").stdout) if r["id"] in want]
        logged = calls.read_text().splitlines()
        # one refresh: one squeue; sacct at most once (and sacct -c once where slurmdbd is absent)
        assert sum(ln.startswith("squeue ") for ln in logged) == 1, logged
        assert sum(ln.startswith("sacct ") and "--completion" not in ln for ln in logged) <= 1, logged
        assert sum("--completion" in ln for ln in logged) <= 1, logged
        for r in rows:
            seen[r["id"]].add(r["state_name"])
        if len(rows) == 6 and all(r["state_name"] in ENDED for r in rows):
            break
        time.sleep(1.5)
    assert {r["id"]: r["state_name"] for r in rows} == want, (seen, rows)
    # the text table, asked again (ended tasks' rows from the cache): the same states, one line each
    calls.write_text("")
    table = status(c, d, env, "--limit", "0").stdout.splitlines()
    for task, state in want.items():
        line = next(ln for ln in table if ln.startswith(task + " "))
        assert f" {state} " in line or f" {state}" in line, (task, line)
    assert sum(ln.startswith("squeue ") for ln in calls.read_text().splitlines()) == 1
    # a failed task: its exit status said once, and --logs shows the script's own output
    detail = status(c, d, env, f"{job}_4").stdout
    assert "exited with status 3" in detail and "Exited: " not in detail and "None" not in detail, detail
    logs = status(c, d, env, f"{job}_4", "--logs").stdout
    assert "tiny task code=3 nap=4.0" in logs, logs
