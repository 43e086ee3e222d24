"""The supervisor's fast hang detection on the real test cluster: a plain script on 2 nodes x 1
rank whose rank 1 stops stepping (it sleeps outside any collective, its peer waits in DDP's
all-reduce; gloo's own timeout is 30 minutes) is healed by the hang limit (``--hang-timeout``,
docs/restarts.md): the stacks, taken before the stop, name rank 1, the job completes in the same
allocation, and status shows the restart with its phases. One rank a node: each rank process
costs ~2 s of CPU to import torch, and one peer on another node waits as three would."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from ddp_hpc.judge.nodefiles import rank_events
from ddp_hpc.judge.restarts import read_restarts

from .script_helpers import wait_for

pytestmark = [pytest.mark.cluster]

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable


def test_a_hang_is_healed_by_the_hang_limit_and_status_names_the_rank(slurm_cluster):
    """Only test of a hang outside any collective healed by the hang limit on real Slurm, with
    the restart's phases in status."""
    c = slurm_cluster
    d = c.shared_dir / f"hang-{time.monotonic_ns()}"
    d.mkdir()
    env = dict(c.env, DDP_HPC_HOME=str(d / "home"), PYTHONPATH=str(REPO), HANG_RANK="1", HANG_STEP="12",
               STEPS="24")
    p = c.run([PY, "-m", "ddp_hpc.submit", "--backend", "sbatch", "-t", "10", "-G", "1", "-N", "2",
               "--max-restarts", "1", "--hang-timeout", "10", "-J", "hang", str(REPO / "tests" / "cluster" /
                                                                               "hang_train.py")],
              cwd=str(d), env=env)
    assert p.returncode == 0, p.stderr
    job = p.stdout.split()[-1]
    log_dir = wait_for("the log directory", lambda: next((d / "runs").glob("hang-*"), None), 60)
    state = c.wait(job, timeout=300)
    status = c.run([PY, "-m", "ddp_hpc.status", job], cwd="/", env=env, timeout=120).stdout
    rows = read_restarts(log_dir)
    print(f"{json.dumps(rows, indent=1)}\n{status}")
    assert state == "COMPLETED", status
    [row] = rows
    assert (row["trigger"], row["kind"], row["rank"], row["world_after"]) == ("stalled", "stuck", 1, 2), row
    assert "not in a collective" in row["basis"] and "hang_train.py" in row["why"], row
    asked = [e for e in rank_events(log_dir, 1).events
             if e.get("event") == "stack" and e.get("restart") == 0]
    assert asked and asked[-1]["reason"] == "on request"      # the stacks taken before the stop
    assert re.search(r"restart 1 at .*\(stalled\): rank 1 on \S+: hung in <module> \(hang_train\.py:\d+\)",
                     status), status
    assert re.search(r"restart 1: [\d.]+ s = detect [\d.]+ \+ stop [\d.]+ \+ start [\d.]+ \+ import [\d.]+ \+ "
                     r"rendezvous [\d.]+ \+ step [\d.]+", status), status
