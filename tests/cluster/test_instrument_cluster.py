"""A plain script (no ddp_hpc in it) on the real test cluster, 2 nodes x 1 task: its rank 1
stops answering in its own code while rank 0 waits in DDP's all-reduce. Status shows the job
STALLED within the stall threshold, names rank 1 with its stack, and ``--stacks`` shows where
every rank is: all from ddp_hpc.exec's instrumentation (docs/scripts.md). One task a node: each
rank process costs ~2 s of CPU to import torch, and the wording for several waiting ranks
("ranks 0-2 wait in ...") is checked by tests/test_status_timing.py."""

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


def test_a_plain_script_whose_rank1_hangs_is_stalled_naming_rank1_with_its_stack(slurm_cluster):
    """Only test of a plain script's hang named with its stacks on real Slurm, through the
    instrumentation alone (the stall takes its minimum of 60 s to show)."""
    c = slurm_cluster
    d = c.shared_dir / f"instrument-{time.monotonic_ns()}"
    d.mkdir()
    env = dict(c.env, DDP_HPC_HOME=str(d / "home"), PYTHONPATH=str(REPO))
    # no restarts: the supervisor's hang limit would heal the hang (tests/cluster/test_hang_cluster.py);
    # this is what status shows of a hang that nothing heals
    p = c.run([PY, "-m", "ddp_hpc.submit", "--backend", "sbatch", "-N", "2", "-G", "1", "-t", "10",
               "--max-restarts", "0",
               "--log-dir", str(d / "runs"), SCRIPT, "--stuck-rank", "1", "--stuck-at", "14",
               "--steps", "100000", "--step-sleep", "0.25"], cwd=str(d), env=env)
    assert p.returncode == 0, p.stderr
    job = p.stdout.split()[-1]
    t0, row, detail = time.monotonic(), {}, ""
    try:
        while time.monotonic() - t0 < 170:
            time.sleep(5)      # each status is a Python process; the stall shows >= 60 s after the hang
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
    assert "hang: rank 1 in stuck_in_user_code (plain_ddp.py:" in detail
    assert "rank 0 waits in DDP's all-reduce (backward)" in detail
    assert "rank 1 was in plain_ddp.py:" in detail and "in stuck_in_user_code" in detail
    assert re.search(r"Progress:   s\d+, loss [\d.]+, [\d.]+ samples/s, [\d.]+ steps/s", detail)
    assert [ln.split(" on ")[0] for ln in stacks.splitlines() if ln.startswith("rank ")] == [
        "rank 0", "rank 1"], stacks
