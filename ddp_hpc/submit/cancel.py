"""``ddp-hpc cancel JOBID...``: stop jobs, local or on Slurm, and keep CANCELLED in their records.

- A local job (``local-...``): every process of the job by the pids its record keeps (the
  driver, and each rank on every pretend node with its process group: the script under
  ``ddp_hpc.exec``, DataLoader workers), each checked against the start time recorded beside its
  pid so a process that reused a pid is left alone; SIGTERM first (the training core and
  ``ddp_hpc.preemption`` write a checkpoint), SIGKILL whatever is left after ``--grace`` seconds.
  The record then keeps CANCELLED as the job's final state (each array task that had not ended).
- A Slurm job or array task (``123``, ``123_4``): ``scancel`` (through ``ddp_hpc.slurm.cli``);
  status keeps the CANCELLED that the scheduler then reports in the record.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

from ddp_hpc import records
from ddp_hpc.errors import HintError, report
from ddp_hpc.launch.tree import recorded_processes, stop_processes
from ddp_hpc.slurm.cli import SlurmCLI, SlurmError
from ddp_hpc.slurm.states import JobState, parse_state
from ddp_hpc.status.collect import collect
from ddp_hpc.status.targets import StatusTarget, is_slurm_id, job_targets
from ddp_hpc.submit.slurm import clean_slurm_env
from ddp_hpc.text import HelpFormatter, plural, prog

__all__ = ["cancel", "cancel_record", "main"]

#: seconds between SIGTERM and SIGKILL for a local job
GRACE_S = 5.0
#: how long `cancel` waits for Slurm to report a cancelled job's end, to say and keep it
SLURM_SETTLE_S = 10.0
#: the ``source`` of the final states `cancel` keeps in the record
CANCEL = "ddp-hpc cancel"


class CancelError(HintError, LookupError):
    """A job that cannot be cancelled as asked; names the id, the hint says what to do."""


def cancel(job_id: str, grace: float = GRACE_S, cli: SlurmCLI | None = None) -> str:
    """Stop job ``job_id`` (a local id, a Slurm job or array task id); returns what was done, in
    one line. Raises :class:`CancelError` / ``records.JobRecordError`` / ``SlurmError``."""
    job_id = str(job_id).strip()
    try:
        rec = records.load_record(job_id)
    except records.JobRecordError:
        if not is_slurm_id(job_id):
            raise
        rec = None  # a Slurm job ddp_hpc did not submit: scancel knows it or says it does not
    if rec is not None and (rec.backend == "local" or rec.id.startswith("local-")):
        if rec.id != job_id:
            raise CancelError(f"{job_id!r} names one task of the local job {rec.id}; the tasks of a "
                              "local sweep run one after another under one driver.",
                              f"cancel the whole job: `{prog('cancel')} {rec.id}`.")
        return cancel_record(rec, grace)
    return _cancel_slurm(job_id, rec, cli)


def cancel_record(rec: records.JobRecord, grace: float = GRACE_S) -> str:
    """Stop every process of a local job's record (SIGTERM, SIGKILL after ``grace`` seconds) and
    keep CANCELLED as the final state of each of its runs that had not ended."""
    pids = [int(p) for p in rec.pids or []]
    procs = recorded_processes(pids, rec.pid_times, not_before=rec.submitted_at)
    if not procs:
        ended = _ended_state(rec)
        return f"job {rec.id}: no process of it runs any more" + (f" ({ended}); nothing to stop" if ended
                                                                  else "; nothing to stop")
    ranks = [p.pid for p in procs if pids and p.pid != pids[0]]
    killed = stop_processes(procs, grace, groups=ranks)
    _keep_cancelled(rec)
    how = (f", {plural(len(killed), 'process')} SIGKILLed after {grace:g} s" if killed
           else " (SIGTERM)")
    return f"job {rec.id}: CANCELLED, stopped {plural(len(procs), 'process')}{how}"


def _ended_state(rec: records.JobRecord) -> str | None:
    finals = [rec.final] if not rec.array else list((rec.final or {}).values())
    states = sorted({str(f.get("state")) for f in finals if isinstance(f, dict)})
    return ", ".join(states) or None


def _keep_cancelled(rec: records.JobRecord) -> None:
    """CANCELLED as the final state of every run that has none or whose driver saw the SIGTERM;
    a run that had completed or failed before keeps its state. The pids are cleared."""
    fresh = _reload(rec)
    now = time.time()
    keys = [str(t.get("task_id")) for t in fresh.array] if fresh.array else [None]
    finals = {}
    for key in keys:
        old = records.final_of(fresh, key)
        if old and parse_state(old.get("state")).state not in (JobState.CANCELLED, JobState.UNKNOWN):
            continue
        started = (old or {}).get("started_at") or (fresh.submitted_at if key is None else None)
        finals[key] = records.local_final("CANCELLED", started, now, CANCEL,
                                          reason=f"stopped with `{prog('cancel')}`")
    if finals:
        records.store_final(fresh, finals)
    fresh = _reload(fresh)
    fresh.pids, fresh.pid_times = [], []
    records.update_record(fresh)


def _reload(rec: records.JobRecord) -> records.JobRecord:
    return records.load_record(rec.id, cluster=rec.cluster)


def _cancel_slurm(job_id: str, rec, cli: SlurmCLI | None) -> str:
    cli = cli or SlurmCLI(env=clean_slurm_env(os.environ)[0])
    if not cli.available():
        raise CancelError(f"job {job_id} is a Slurm job, but `scancel` is not on PATH here.",
                          "run `ddp-hpc cancel` on a login node of the cluster that runs the job.")
    if rec is None:  # scancel takes an id it does not know without a word: ask first
        known = _states(job_id, rec, cli)
        if all(st.job_state is JobState.UNKNOWN for st in known):
            raise CancelError(f"no job record with id {job_id!r}, and Slurm does not know job {job_id} "
                              "(squeue, sacct).",
                              f"check the id with `{prog('status')}` (ddp_hpc's jobs) or squeue.")
    cli.cancel(job_id)
    state = _settled_state(job_id, rec, cli)
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
    p = argparse.ArgumentParser(
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
