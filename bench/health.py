"""The health check's cost, the two ways it could run (ddp_hpc.supervise.health):

    python -m ddp_hpc.testcluster run --nodes 3 --lock-wait 1200 -- .venv/bin/python bench/health.py

- in the rank (the first thing the launched process does): `nodecheck.check` in an already started
  Python, per call;
- as a step of its own before the real one (what the supervisor does): `srun` of
  ``python -m ddp_hpc.supervise.nodecheck`` over every node, one task each, wall time;

against the baseline of the same run: `srun` of ``true`` over the same nodes (what any step costs)
and ``python -c pass`` the same way (Python's start). Run inside an allocation of the test
cluster (it asks for one with salloc when SLURM_JOB_ID is unset). Prints each as seconds and as a
ratio to srun of ``true``; 5 repetitions, the median.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddp_hpc.env import DistEnv  # noqa: E402
from ddp_hpc.supervise import nodecheck  # noqa: E402

REPS = 5


def _timed(argv: list[str]) -> tuple[float, str]:
    t0 = time.monotonic()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return time.monotonic() - t0, p.stdout


def main() -> int:
    if not os.environ.get("SLURM_JOB_ID"):   # ask for the allocation, then run this again inside it
        nodes = os.environ.get("BENCH_NODES", "3")
        return subprocess.call(["salloc", f"--nodes={nodes}", "--ntasks-per-node=1", sys.executable, __file__])
    srun = ["srun", "--ntasks-per-node=1", f"--nodes={os.environ.get('SLURM_JOB_NUM_NODES', '1')}"]
    rows = {}
    for name, argv in (("srun true (baseline)", [*srun, "true"]),
                       ("srun python -c pass", [*srun, sys.executable, "-c", "pass"]),
                       ("srun nodecheck (the supervisor's step)",
                        [*srun, sys.executable, "-m", "ddp_hpc.supervise.nodecheck", "--dir", str(ROOT)])):
        times = []
        for _ in range(REPS):
            secs, out = _timed(argv)
            times.append(secs)
        rows[name] = statistics.median(times)
        if "nodecheck" in name:
            checks = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            rows["  of which the check on each node (max)"] = max((c["seconds"] for c in checks), default=float("nan"))
            print("nodes:", ", ".join(f"{c['node']} ok={c['ok']}" for c in checks))
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
                  master_addr="127.0.0.1", master_port=29500, hostnames=("localhost",), job_id=None,
                  restart_count=0, launcher="single")
    t0 = time.monotonic()
    for _ in range(REPS):
        nodecheck.check(env, os.environ, [str(ROOT)], 1)
    rows["nodecheck.check in the rank (per call)"] = (time.monotonic() - t0) / REPS
    base = rows["srun true (baseline)"]
    print(f"{'what':<45} {'seconds':>8} {'x srun true':>12}")
    for name, secs in rows.items():
        print(f"{name:<45} {secs:8.3f} {secs / base:12.2f}")
    print(f"load average: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
