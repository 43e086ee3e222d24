"""``ddp-hpc records register`` (``python -m ddp_hpc.records register``): a record for a job that
ddp_hpc did not submit, written by its own batch script (``slurm/train.sbatch``), so that
``ddp-hpc status`` lists it like the jobs ``ddp-hpc submit`` recorded."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Mapping

from ddp_hpc.env import job_facts
from ddp_hpc.errors import report
from ddp_hpc.records import JobRecord, JobRecordError, load_record, write_record
from ddp_hpc.text import ArgumentParser, HelpFormatter, prog

__all__ = ["record_from_slurm", "register", "parser", "main"]


def record_from_slurm(log_dir: str, config: str | None, overrides: list[str],
                      environ: Mapping[str, str] | None = None) -> JobRecord:
    """A record for the Slurm job this batch script runs in (``sbatch slurm/train.sbatch``), from
    the job-level facts sbatch sets (`ddp_hpc.env.job_facts`); its id is the job key."""
    facts = job_facts(environ)
    if not facts.job_id:
        raise JobRecordError("no SLURM_JOB_ID: `register` runs inside a Slurm batch script.",
                             "call it from the batch script (slurm/train.sbatch does).")
    return JobRecord(
        id=facts.key or facts.job_id, cluster=facts.cluster, name=facts.name or "ddp_hpc",
        backend="sbatch-script", nodes=facts.num_nodes, gpus_per_node=facts.gpus_per_node, time_limit=None,
        log_dir=os.path.abspath(log_dir), config=config, overrides=list(overrides),
        submitted_at=time.time(), cwd=facts.submit_dir or os.getcwd())


def register(log_dir: str, config: str | None, overrides: list[str]) -> Path | None:
    """Write the record of this batch script's job; None when a requeued job already has it."""
    rec = record_from_slurm(log_dir, config, overrides)
    try:
        if load_record(rec.id, cluster=rec.cluster).log_dir == rec.log_dir:
            return None  # a requeued job keeps its first record
    except JobRecordError:
        pass
    return write_record(rec)


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog("records"), formatter_class=HelpFormatter,
                                description="Record the Slurm job this batch script runs in, so "
                                            "`ddp-hpc status` lists it (slurm/train.sbatch calls this).")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", help="what to do")
    reg = sub.add_parser("register", formatter_class=HelpFormatter,
                         help="write a record for $SLURM_JOB_ID (once per job; a requeue keeps it)",
                         description="Write a record for the Slurm job this batch script runs in.")
    reg.add_argument("--log-dir", required=True, help="the job's log directory ($DDP_HPC_LOG_DIR)")
    reg.add_argument("config", nargs="?", help="the job's config file")
    reg.add_argument("overrides", nargs="*", help="its key=value overrides")
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m ddp_hpc.records register --log-dir DIR [CONFIG [key=value ...]]``."""
    args = parser().parse_args(argv)
    try:
        path = register(args.log_dir, args.config, args.overrides)
    except (JobRecordError, OSError, ValueError) as e:
        report(prog("records"), e)
        return 1
    if path is not None:
        print(f"ddp_hpc: job record {path}")
    return 0
