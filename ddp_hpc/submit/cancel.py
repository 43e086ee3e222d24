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

Which of the two is the job's backend's business (``ddp_hpc.backends``: ``cancel``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

from ddp_hpc import backends, records
from ddp_hpc.backends.base import GRACE_S, CancelError, clean_slurm_env
from ddp_hpc.backends.onslurm import scancel
from ddp_hpc.errors import HintError, report
from ddp_hpc.slurm.cli import SlurmCLI, SlurmError
from ddp_hpc.slurm.states import JobState
from ddp_hpc.status.collect import collect
from ddp_hpc.status.targets import StatusTarget, is_slurm_id, job_targets
from ddp_hpc.text import ArgumentParser, HelpFormatter, prog

__all__ = ["cancel", "main", "CancelError"]

#: how long `cancel` waits for Slurm to report a cancelled job's end, to say and keep it: a job
#: that checkpoints on SIGTERM (the training core does) ends only once its save is written, and a
#: busy node took more than 10 s for a small one
SLURM_SETTLE_S = 30.0


def cancel(job_id: str, grace: float = GRACE_S, cli: SlurmCLI | None = None) -> str:
    """Stop job ``job_id`` (a local id, a Slurm job or array task id) through the backend that
    submitted it; returns what was done, in one line. Raises :class:`CancelError` /
    ``records.JobRecordError`` / ``SlurmError``."""
    job_id = str(job_id).strip()
    try:
        rec = records.load_record(job_id)
    except records.JobRecordError:
        if not is_slurm_id(job_id):
            raise
        rec = None  # a Slurm job ddp_hpc did not submit: scancel knows it or says it does not
    cli = cli or SlurmCLI(env=clean_slurm_env(os.environ)[0])
    if rec is None:
        return _cancel_unrecorded(job_id, cli)
    backend = backends.of_record(rec)
    done = backend.cancel(rec, job_id, grace, cli)
    if backend.runs_here:
        return done
    state = _settled_state(job_id, rec, cli)
    return done + (f"; Slurm says {state}" if state else "")


def _cancel_unrecorded(job_id: str, cli: SlurmCLI) -> str:
    """A Slurm job with no record: scancel takes an id it does not know without a word, so ask
    the scheduler first."""
    if cli.available():
        known = _states(job_id, None, cli)
        if all(st.job_state is JobState.UNKNOWN for st in known):
            raise CancelError(f"no job record with id {job_id!r}, and Slurm does not know job {job_id} "
                              "(squeue, sacct).",
                              f"check the id with `{prog('status')}` (ddp_hpc's jobs) or squeue.")
    scancel(job_id, cli)
    state = _settled_state(job_id, None, cli)
    return f"job {job_id}: scancel sent" + (f"; Slurm says {state}" if state else "")


def _states(job_id: str, rec, cli: SlurmCLI) -> list:
    """What status says of the job now (one status per array task of a record)."""
    return collect(job_targets(job_id, None) if rec is not None else [StatusTarget(job_id)], cli)


def _settled_state(job_id: str, rec, cli: SlurmCLI) -> str | None:
    """The job's state once Slurm reports it ended (status keeps it in the record), waiting up to
    `SLURM_SETTLE_S`; None when it did not end in that time."""
    end = time.monotonic() + SLURM_SETTLE_S
    while True:
        st = _states(job_id, rec, cli)
        if all(s.job_state.terminal for s in st) or time.monotonic() > end:
            return ", ".join(sorted({s.state for s in st})) if all(s.job_state.terminal for s in st) else None
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
