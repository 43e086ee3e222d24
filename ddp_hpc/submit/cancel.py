"""``ddp-hpc cancel JOBID...``: stop jobs, local or on Slurm, and keep CANCELLED in their records.

- A local job (``local-...``): every process of the job by the pids its record keeps (the
  driver, and each rank on every pretend node with its process group: the script under
  ``ddp_hpc.exec``, DataLoader workers), each checked against the start time recorded beside its
  pid so a process that reused a pid is left alone (a pid recorded without a start time is never
  signalled, and the answer says so: ``ddp_hpc.launch.tree.recorded_processes``); SIGTERM first (the training core and
  ``ddp_hpc.preemption`` write a checkpoint), SIGKILL whatever is left after ``--grace`` seconds.
  The record then keeps CANCELLED as the job's final state (each array task that had not ended).
- A Slurm job or array task (``123``, ``123_4``): ``scancel`` (through ``ddp_hpc.slurm.cli``);
  status keeps the CANCELLED that the scheduler then reports in the record.

Which of the two is the job's backend's business (``ddp_hpc.backends``: ``cancel``); then, where a
scheduler tells, what it says of the job's end (``ddp-hpc status``, which keeps it in the record).
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from ddp_hpc import backends, records
from ddp_hpc.backends.base import GRACE_S, CancelError
from ddp_hpc.errors import HintError, report
from ddp_hpc.slurm.cli import SlurmCLI, SlurmError
from ddp_hpc.slurm.query import SACCT, SACCT_C, SQUEUE
from ddp_hpc.status.collect import collect
from ddp_hpc.status.targets import StatusTarget, job_targets
from ddp_hpc.text import ArgumentParser, HelpFormatter, prog

__all__ = ["cancel", "main", "CancelError"]

#: the sources that are a scheduler's word on a job (not its record, processes or logs)
SCHEDULER_SOURCES = (SQUEUE, SACCT, SACCT_C)
#: how long `cancel` waits for Slurm to report a cancelled job's end, to say and keep it: a job
#: that checkpoints on SIGTERM (the training core does) ends only once its save is written, and a
#: busy node took more than 10 s for a small one
SLURM_SETTLE_S = 30.0


def cancel(job_id: str, grace: float = GRACE_S, cli: SlurmCLI | None = None) -> str:
    """Stop job ``job_id`` (a local id, a Slurm job or array task id) through the backend that
    submitted it (a Slurm job without a record: a Slurm backend); returns what was done, in one
    line, and what the scheduler then said of the job's end. ``cli``: the SlurmCLI to ask
    (None: the backend's own). Raises :class:`CancelError` / ``records.JobRecordError`` /
    ``SlurmError``."""
    job_id = str(job_id).strip()
    try:
        rec = records.load_record(job_id)
    except records.JobRecordError:
        if not backends.is_slurm_id(job_id):
            raise
        rec = None  # a Slurm job ddp_hpc did not submit: scancel knows it or says it does not
    backend = backends.of_record(rec, job_id=job_id, client=cli)
    done = backend.cancel(rec, job_id, grace)
    said = _settled_state(job_id, rec, getattr(backend, "client", None))
    return done + (f"; {said}" if said else "")


def _states(job_id: str, rec, cli: SlurmCLI | None) -> list:
    """What status says of the job now (one status per array task of a record)."""
    return collect(job_targets(job_id, None) if rec is not None else [StatusTarget(job_id)], cli)


def _settled_state(job_id: str, rec, cli: SlurmCLI | None) -> str | None:
    """What the scheduler says of the job once it reports it ended (status keeps it in the
    record), waiting up to `SLURM_SETTLE_S`; None when it did not end in that time, or when no
    scheduler tells (a job whose processes ran here: its backend's line said it all)."""
    end = time.monotonic() + SLURM_SETTLE_S
    while True:
        st = _states(job_id, rec, cli)
        if not any(s.source in SCHEDULER_SOURCES for s in st):
            return None
        if all(s.job_state.terminal for s in st):
            return "Slurm says " + ", ".join(sorted({s.state for s in st}))
        if time.monotonic() > end:
            return None
        time.sleep(0.5)


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=prog("cancel"), formatter_class=HelpFormatter,
        description="Stop jobs: a local job's every process (SIGTERM, then SIGKILL after --grace "
                    "seconds), a Slurm job or array task with scancel. Status then says CANCELLED.")
    p.add_argument("job_ids", nargs="+", metavar="JOBID",
                   help="a job id as submit printed it: local-..., 12345, or an array task 12345_4")
    p.add_argument("--grace", type=float, default=GRACE_S, metavar="S",
                   help="seconds a local job's processes get to stop after SIGTERM before SIGKILL")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``ddp-hpc cancel JOBID... [--grace S]``: 0 when every job was stopped (or had ended), 2
    for an id that names no job, 1 when Slurm refused."""
    args = parser().parse_args(argv)
    if args.grace < 0:
        report(prog("cancel"), HintError(f"--grace {args.grace:g} is negative.", "give seconds >= 0."))
        return 2
    rc = 0
    for job_id in args.job_ids:
        try:
            print(cancel(job_id, args.grace), flush=True)
        except (records.JobRecordError, CancelError) as exc:
            report(prog("cancel"), exc)
            rc = 2
        except SlurmError as exc:
            report(prog("cancel"), exc)
            rc = rc or 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
