"""The one place that decides a job's state and its row, from its sources in one order.

A job's state can be told by five sources. They are asked in this order, and the first that
knows answers (``JobStatus.source`` names it):

1. **the scheduler** (`ddp_hpc.slurm.query`: squeue, else sacct, else ``sacct -c``), for a Slurm
   job it lists in any state but UNKNOWN: the one authority on a job that is queued or runs,
   and the freshest word on how it ended. A local job has no scheduler: its record (2) and its
   processes (3) take that part.
2. **the job's record**: the terminal state kept in it (`records.final_of`: what status last saw
   from the scheduler, what the local driver saw when the run ended, ``ddp-hpc cancel``). It
   answers once the scheduler forgot the job or cannot be reached (and not when the user asked
   for one source with ``--source``). For a local job it comes first: the driver wrote it when
   the run ended, and nothing newer can tell.
3. **the run logs** (their ``end`` events; a local job's recorded processes alive or gone): the
   only source left when neither a scheduler nor a record knows the job.

The row's facts (progress, loss, device, eval metrics, how the newest run ended) always come
from the logs. Two shortcuts stand in for reading them, for the job table only, and only where
they answer what 1-3 would:

4. **kept facts** (`ddp_hpc.judge.kept`, in the record's final state): what the table shows of
   an ended job's logs, while the files they were read from are unchanged (or gone);
5. **the row cache** (`ddp_hpc.status.rowcache`): an ended job's whole row, while everything it
   was made from (the record, the log directory's files, the scheduler's answer) is unchanged.

Why this order: a source lower in the list is older news. The scheduler's word is live; the
record keeps what a live source said when the job ended; the logs are what the ranks wrote, which
stops when a rank is killed; kept facts and cached rows are copies of what 1-3 gave, so they are
asked first (they are cheapest) but never tell anything 1-3 would not.

`resolve` gives one `Resolved` job (`ddp_hpc.status.assemble`); the table's row (`Resolved.row`)
and the detail view (`Resolved.detail`) are two views over it, put together there. A job whose
end a Slurm source reported, or a local job whose processes status found gone, also gives the
final state to keep in its record (`Resolved.final_to_keep`).
"""
from __future__ import annotations

from ddp_hpc.judge import kept
from ddp_hpc.judge.kept import KeptLogs
from ddp_hpc.judge.reader import RunLogs
from ddp_hpc.slurm.query import SourceState
from ddp_hpc.slurm.states import JobState, parse_state
from ddp_hpc.status import rowcache
from ddp_hpc.status import sources as src
from ddp_hpc.status.assemble import Resolved
from ddp_hpc.status.job import JobStatus
from ddp_hpc.status.targets import JobSources

__all__ = ["resolve", "table_row", "told_without_logs", "kept_facts"]


def told_without_logs(s: JobSources) -> SourceState | None:
    """Sources 1 and 2: the state the scheduler or the record tells; None when the logs must."""
    if s.target.local:
        final = s.final
        return src.from_final(final, []) if final and parse_state(final.get("state")).state.terminal else None
    if s.sched is not None and s.sched.state.state is not JobState.UNKNOWN:
        return s.sched
    final = s.final if s.only is None else None
    if final:
        return src.from_final(final, s.sched.tried if s.sched else s.tried)
    return s.sched  # the scheduler lists it in a state it does not name: that, not the logs


def kept_facts(s: JobSources) -> KeptLogs | None:
    """Source 4: the table's facts of an ended job's logs as its record keeps them, while they
    hold; None: read the logs (a job that runs, no or stale facts)."""
    if s.sched is not None and s.sched.state.state.active:
        return None
    final = s.final
    if not final or "logs" not in final or not parse_state(final.get("state")).state.terminal:
        return None
    return kept.kept_logs(final["logs"], s.target.log_dir)


def _read_logs(s: JobSources, told: SourceState | None, table: bool) -> RunLogs:
    """The logs as the view needs them: the table reads the other ranks' endings only (a running
    Slurm job's recent steps too, for its stall), and rank 0's file alone of a job that completed
    with its elapsed time told (the others' endings tell nothing the row shows)."""
    known = told.state.state if told is not None else None
    running = table and not s.target.local and known is JobState.RUNNING
    clean = known is JobState.COMPLETED and bool(told.elapsed)
    return RunLogs(s.target.log_dir, ends_only=table and not running, window=running, rank0_only=table and clean)


def resolve(s: JobSources, table: bool = False, logs: RunLogs | KeptLogs | None = None) -> Resolved:
    """The job resolved from its sources in the module's order. ``table``: read only what the
    table's row needs; ``logs``: the kept facts that stand in for the logs (source 4)."""
    told = told_without_logs(s)
    logs = logs or _read_logs(s, told, table)
    notes: list[str] = []
    keep = None
    if told is not None:
        state = told
    elif s.target.local:
        state, keep = src.local_state(s.record, s.task_id, logs, notes, s.now)
    else:
        state = src.from_logs(logs, s.tried, scheduled=True)
    if state.state.state is JobState.RUNNING:  # its stall is judged from every rank's recent steps
        logs.widen()
    return Resolved(s, state, logs, notes, keep)


def table_row(s: JobSources, cache: rowcache.RowCache) -> tuple[JobStatus, dict | None]:
    """(the table's row, the final state to keep in the record): from the kept facts of an
    ended job (4), else the row cache (5) while the row's inputs are unchanged, else resolved
    (and cached when the job ended, unless its record is to keep it: the next table then takes
    the row from the kept facts)."""
    facts = kept_facts(s)
    key = None
    keeps_final = not s.target.local and s.record is not None and bool(s.record.path) and src.scheduler_ended(s.sched)
    if facts is None and not keeps_final:
        key = cache.key(s.target, s.sched, s.only)
        if (row := cache.get(key)) is not None:
            return JobStatus.from_dict(row), None
    r = resolve(s, table=True, logs=facts)
    st = r.row()
    if key is not None:
        cache.put(key, st.to_dict())
    return st, r.final_to_keep()
