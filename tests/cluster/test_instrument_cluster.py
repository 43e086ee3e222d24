"""A plain script (no ddp_hpc in it) on the real test cluster, 2 nodes x 2 tasks: its rank 3
stops answering in its own code while the others wait in DDP's all-reduce. Status shows the job
STALLED within the stall threshold, names rank 3 with its stack, and ``--stacks`` shows where
every rank is: all from ddp_hpc.exec's instrumentation (docs/scripts.md)."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "tests" / "scripts" / "plain_ddp.py")
PY = sys.executable


def test_a_plain_script_whose_rank3_hangs_is_stalled_naming_rank3_with_its_stack(slurm_cluster):
    c = slurm_cluster
    d = c.shared_dir / f"instrument-{time.monotonic_ns()}"
    d.mkdir()
    env = dict(c.env, DDP_HPC_HOME=str(d / "home"), PYTHONPATH=str(REPO))
    # no restarts: the supervisor's hang limit would heal the hang (tests/cluster/test_hang_cluster.py);
    # this is what status shows of a hang that nothing heals
    p = c.run([PY, "-m", "ddp_hpc.submit", "--backend", "sbatch", "-N", "2", "-G", "2", "-t", "10",
               "--max-restarts", "0",
               "--log-dir", str(d / "runs"), SCRIPT, "--stuck-rank", "3", "--stuck-at", "14",
               "--steps", "100000", "--step-sleep", "0.25"], cwd=str(d), env=env)
    assert p.returncode == 0, p.stderr
    job = p.stdout.split()[-1]
    t0, row, detail = time.monotonic(), {}, ""
    try:
        while time.monotonic() - t0 < 170:
            time.sleep(3)
            row = json.loads(c.run([PY, "-m", "ddp_hpc.status", job, "--json"], cwd="/", env=env,
                                   timeout=120).stdout)
            if (row.get("stall") or {}).get("hang"):
                break
        detail = c.run([PY, "-m", "ddp_hpc.status", job], cwd="/", env=env, timeout=120).stdout
        stacks = c.run([PY, "-m", "ddp_hpc.status", job, "--stacks"], cwd="/", env=env, timeout=120).stdout
    finally:
        c.run([PY, "-m", "ddp_hpc", "cancel", job], cwd="/", env=env, timeout=120)
    print(f"{time.monotonic() - t0:.0f} s after submission:\n{detail}\n{stacks}")
    stall = row.get("stall") or {}
    assert stall.get("ranks") and stall["silent_for_s"] < stall["threshold_s"] + 30, row.get("stall")
    assert "State:      RUNNING, STALLED" in detail
    assert "hang: rank 3 in stuck_in_user_code (plain_ddp.py:" in detail
    assert "ranks 0-2 wait in DDP's all-reduce (backward)" in detail
    assert "rank 3 was in plain_ddp.py:" in detail and "in stuck_in_user_code" in detail
    assert re.search(r"Progress:   s\d+, loss [\d.]+, [\d.]+ samples/s, [\d.]+ steps/s", detail)
    assert [ln.split(" on ")[0] for ln in stacks.splitlines() if ln.startswith("rank ")] == [
        "rank 0", "rank 1", "rank 2", "rank 3"], stacks
