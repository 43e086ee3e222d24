"""A job resolved from its sources: its state (decided by `ddp_hpc.judge.decide`, the one place
that does, in the order it documents: the backend's description, the record's final state, the
run logs) and its row.

The row's facts (progress, loss, device, eval metrics, how the newest run ended) always come
from the logs. Two shortcuts stand in for reading them, for the job table only, and only where
they answer what the sources would:

4. **kept facts** (`ddp_hpc.judge.kept`, in the record's final state): what the table shows of
   an ended job's logs, while the files they were read from are unchanged (or gone);
5. **the row cache** (`ddp_hpc.status.rowcache`): an ended job's whole row, while everything it
   was made from (the record, the log directory's files, the scheduler's answer) is unchanged.

Kept facts and cached rows are copies of what the sources gave, so they are asked first (they
are cheapest) but never tell anything the sources would not.

`resolve` gives one `Resolved` job (`ddp_hpc.status.assemble`); the table's row (`Resolved.row`)
and the detail view (`Resolved.detail`) are two views over it, put together there. A job whose
end a Slurm source reported, or a job without a scheduler whose processes status found gone, also
gives the final state to keep in its record (`Resolved.final_to_keep`).
"""
from __future__ import annotations

from ddp_hpc.judge import decide, kept
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
    """Sources 1 and 2 (`decide.told`): the state the scheduler or the record tells; None when
    the logs must."""
    return decide.told(s.described, s.final, s.only)


def kept_facts(s: JobSources) -> KeptLogs | None:
    """Source 4: the table's facts of an ended job's logs as its record keeps them, while they
    hold; None: read the logs (a job that runs, no or stale facts)."""
    if s.sched is not None and s.sched.info.job_state.active:
        return None
    final = s.final
    if not final or "logs" not in final or not parse_state(final.get("state")).job_state.terminal:
        return None
    return kept.kept_logs(final["logs"], s.target.log_dir)


def _read_logs(s: JobSources, told: SourceState | None, table: bool) -> RunLogs:
    """The logs as the view needs them: the table reads the other ranks' endings only (a running
    Slurm job's recent steps too, for its stall), and rank 0's file alone of a job that completed
    with its elapsed time told (the others' endings tell nothing the row shows)."""
    known = told.info.job_state if told is not None else None
    running = table and s.described.scheduled and known is JobState.RUNNING
    clean = known is JobState.COMPLETED and bool(told.elapsed)
    return RunLogs(s.target.log_dir, ends_only=table and not running, window=running, rank0_only=table and clean)


def resolve(s: JobSources, table: bool = False, logs: RunLogs | KeptLogs | None = None) -> Resolved:
    """The job resolved from its sources in the module's order. ``table``: read only what the
    table's row needs; ``logs``: the kept facts that stand in for the logs (source 4)."""
    told = told_without_logs(s)
    logs = logs or _read_logs(s, told, table)
    rec = s.record
    decision = decide.decide(s.described, s.final, logs, only=s.only, task_id=s.task_id,
                             submitted_at=rec.submitted_at if rec is not None else None, now=s.now)
    state = decision.state
    if state.info.job_state is JobState.RUNNING:  # its stall is judged from every rank's recent steps
        logs.widen()
    return Resolved(s, state, logs, list(s.described.notes), decision.keep)


def table_row(s: JobSources, cache: rowcache.RowCache) -> tuple[JobStatus, dict | None]:
    """(the table's row, the final state to keep in the record): from the kept facts of an
    ended job (4), else the row cache (5) while the row's inputs are unchanged, else resolved
    (and cached when the job ended, unless its record is to keep it: the next table then takes
    the row from the kept facts)."""
    facts = kept_facts(s)
    key = None
    keeps_final = (s.described.scheduled and s.record is not None and bool(s.record.path)
                   and src.scheduler_ended(s.sched))
    if facts is None and not keeps_final:
        key = cache.key(s.target, s.sched, s.only, uses_final=_record_tells(s))
        if (row := cache.get(key)) is not None:
            return JobStatus.from_dict(row), None
    r = resolve(s, table=True, logs=facts)
    st = r.row()
    if key is not None:
        cache.put(key, st.to_dict())
    return st, r.final_to_keep()


def _record_tells(s: JobSources) -> bool:
    """The record's final state gives the job's state (`decide.told` answers from it): then it
    is part of what the job's row is made from."""
    told = told_without_logs(s)
    return told is not None and told.source == src.RECORD
