"""``python -m ddp_hpc.run CONFIG [key=value ...]``: the on-node entry, identical under every launcher.

    srun python -m ddp_hpc.run jobs/demo.yaml train.epochs=3
    torchrun --nproc-per-node 4 -m ddp_hpc.run jobs/demo.yaml
    python -m ddp_hpc.launch --nodes 1 --procs-per-node 2 -- python -m ddp_hpc.run jobs/demo.yaml

Exit codes: 0 completed (or preempted and requeued: the job will continue), 75 (preempt.exit_code,
EX_TEMPFAIL) preempted and checkpointed but not requeued (outside Slurm: run the same command
again to resume), 2 bad configuration, 1 any other failure (the traceback is in the rank's log
and error event).
"""
from __future__ import annotations

import argparse
import sys

from ddp_hpc.config import ConfigError, load_config
from ddp_hpc.errors import report
from ddp_hpc.text import HelpFormatter, prog

EXIT_OK, EXIT_CONFIG = 0, 2  # any other failure is an uncaught exception: exit status 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog("run"), formatter_class=HelpFormatter,
                                description="Train the job CONFIG on this rank (any launcher).",
                                epilog=__doc__.split("\n", 1)[1])
    p.add_argument("config", metavar="CONFIG", help="YAML job file, e.g. jobs/demo.yaml")
    p.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                   help="optional dotted overrides, e.g. train.batch_size=64 optim.lr=0.01")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        from ddp_hpc.train.api import run_job  # torch: imported once the configuration is good
        result = run_job(cfg)
    except ConfigError as e:
        report(prog("run"), f"bad configuration: {e}")
        return EXIT_CONFIG
    if result.status == "preempted" and not result.requeued:
        return cfg.preempt.exit_code
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
