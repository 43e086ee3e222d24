"""``ddp-hpc env`` / ``python -m ddp_hpc.env``: show or check the environment this task derives.

    srun python -m ddp_hpc.env --check     # one-line diagnostic per task, exit 1 on a problem
    python -m ddp_hpc.env --json           # the derived environment of this process
"""

from __future__ import annotations

import argparse
import json
import os

from ddp_hpc.env.checks import diagnose
from ddp_hpc.env.model import DistEnv
from ddp_hpc.env.sources import this_host
from ddp_hpc.errors import report
from ddp_hpc.slurm import hostlist
from ddp_hpc.text import ArgumentParser, HelpFormatter, prog


def _table(env: DistEnv) -> str:
    rows = env.to_dict()
    rows["hostnames"] = hostlist.compress(env.hostnames) if env.hostnames else ""
    width = max(map(len, rows))
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows.items())


def _task_tag() -> str:
    """``[node task N]``: which of many srun tasks printing at once this is."""
    task = os.environ.get("SLURM_PROCID", os.environ.get("RANK", "?"))
    return f"[{os.environ.get('SLURMD_NODENAME') or this_host()} task {task}]"


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=prog("env"), formatter_class=HelpFormatter,
        description="Print the distributed environment (ranks, sizes, master address and port, launcher) "
                    "this task derives.\n\n  srun python -m ddp_hpc.env --check   # one line per task")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--check", action="store_true", help="one line per task; exit 1 with the reason on a problem")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    env, problems = diagnose(os.environ)
    if problems:
        for problem in problems:
            report(f"{prog('env')} {_task_tag()}", problem)
        return 1
    assert env is not None
    if args.json:
        print(json.dumps({**env.to_dict(), "hostname": this_host()}, sort_keys=True))
    elif args.check:
        print(f"OK rank {env.rank}/{env.world_size} local {env.local_rank}/{env.local_world_size} "
              f"node {env.node_rank}/{env.num_nodes} on {this_host()} master {env.master_addr}:{env.master_port} "
              f"launcher {env.launcher} job {env.job_id}")
    else:
        print(_table(env))
    return 0
