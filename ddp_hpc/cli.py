"""``ddp-hpc``: one command for every tool, like ``git`` or ``torchx``.

    ddp-hpc submit --nodes 2 --gpus 2 jobs/demo.yaml --wait
    ddp-hpc status [JOBID]
    ddp-hpc cancel JOBID...
    ddp-hpc --help

Each subcommand is also ``python -m ddp_hpc.<name>``; both spellings run the same ``main``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ddp_hpc.text import ArgumentParser

#: subcommand -> (module with ``main(argv) -> int``, one line of help), in the order of the data flow
COMMANDS: dict[str, tuple[str, str]] = {
    "submit": ("ddp_hpc.submit.cli",
               "submit a job config to Slurm (submitit or a rendered sbatch script) or local processes"),
    "env": ("ddp_hpc.env.cli", "show or check the rank, sizes and master address this task derives"),
    "launch": ("ddp_hpc.launch.cli", "run a command as N pretend nodes x G processes on this machine"),
    "run": ("ddp_hpc.run", "train a job config on this node (the on-node entry under every launcher)"),
    "exec": ("ddp_hpc.exec", "run your own training script as one rank (torchrun variables, signals, run log)"),
    "data": ("ddp_hpc.data.cli", "pack images into LMDB, verify it, stage it to node-local disk"),
    "status": ("ddp_hpc.status.cli", "list jobs, or show one job's state, progress, logs and failing rank"),
    "cancel": ("ddp_hpc.submit.cancel", "stop jobs: a local job's every process, or scancel a Slurm job or task"),
    "records": ("ddp_hpc.records.register", "register a plain sbatch job so status lists it"),
    "testcluster": ("ddp_hpc.testcluster.__main__", "start or stop a real multi-node Slurm on this machine"),
}


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="ddp-hpc", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="PyTorch DDP from a laptop to many Slurm GPU nodes.",
        epilog="commands:\n" + "\n".join(f"  {n:<12} {h}" for n, (_, h) in COMMANDS.items())
        + "\n\n`ddp-hpc COMMAND --help` shows a command's options.")
    p.add_argument("command", metavar="COMMAND", choices=sorted(COMMANDS), help="one of the commands below")
    p.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        parser().print_help()
        return 0 if argv else 2
    ns = parser().parse_args(argv[:1])
    module, _ = COMMANDS[ns.command]
    sys.argv = [f"ddp-hpc {ns.command}", *argv[1:]]
    return importlib.import_module(module).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
