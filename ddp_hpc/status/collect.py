"""The status of many jobs at once: the scheduler asked once per source for all of them, each
job resolved (`ddp_hpc.status.resolve`: its state from its sources in one order, its row or its
detail view), and the final states seen keep in the records in one batch.

The result, one :class:`JobStatus` per job, is a plain value that the views render as a table
row, a detail page or JSON; nothing here prints. A record of a job array becomes one status per
array task (each task has its own log directory).
"""
from __future__ import annotations

import contextlib
import gc
import time

from ddp_hpc import records
from ddp_hpc.slurm.query import SourceState, cluster_or_reason, query_slurm
from ddp_hpc.status import rowcache
from ddp_hpc.status import sources as src
from ddp_hpc.status.job import JobStatus
from ddp_hpc.status.resolve import resolve, table_row
from ddp_hpc.status.targets import JobSources, StatusTarget

__all__ = ["collect", "JobStatus", "StatusTarget"]


def collect(targets: list[StatusTarget], cli=None, cli_note: str | None = None, history: bool = False,
            now: float | None = None, only: str | None = None, brief: bool = False,
            lanes: bool = False) -> list[JobStatus]:
    """Status of every target; Slurm ones are queried in one batch per source (one squeue and
    one sacct call however many jobs and array tasks). ``only`` names the one source to ask
    (squeue | sacct | "sacct -c" | logs), for comparing them. A terminal state the scheduler
    reports is kept in the job's record (`records.store_finals`, all at once). ``brief``: the
    table's rows (`Resolved.row`: no failure attribution, per-rank endings or step times; an
    ended job's from the kept facts or the row cache, `resolve.table_row`), else the detail view
    (`Resolved.detail`; ``lanes``: with every rank's lane in its picture, for ``--html``)."""
    now = time.time() if now is None else now
    cluster, down = (cluster_or_reason(cli) if cli is not None and any(not t.local for t in targets)
                     else (None, None))
    foreign = {t.id for t in targets if not t.local and cluster and t.record is not None
               and t.record.cluster not in (None, "", cluster)}
    slurm_ids = [t.id for t in targets if not t.local and t.id not in foreign]
    expect = {t.id: {"name": t.record.name, "submitted_at": t.record.submitted_at}
              for t in targets if t.record is not None}
    found: dict[str, SourceState] = {}
    tried: list[str] = [cli_note] if cli_note else []
    if only == src.LOGS:
        tried.append("logs: asked for with --source logs")
    elif slurm_ids and cli is not None:
        found, more = query_slurm(slurm_ids, cli, expect, history=history,
                                      controller_down=down, only=only)
        tried += more
    out, finals = [], {}
    with _no_cycle_collection():
        cache = rowcache.load() if brief else None
        for t in targets:
            sources = JobSources(t, found.get(t.id), tried, now, only)
            if cache is not None:
                st, final = table_row(sources, cache)
            else:
                job = resolve(sources)
                st, final = job.detail(lanes), job.final_to_keep()
            if t.id in foreign:
                st.notes.append(f"submitted on cluster {t.record.cluster!r}, not this one ({cluster!r}): "
                                "the scheduler was not asked (job ids repeat across clusters)")
            if final is not None and t.record is not None and t.record.path:
                finals.setdefault(id(t.record), (t.record, {}))[1][t.task_id] = final
            out.append(st)
        try:
            records.store_finals(finals.values())
        except OSError:  # a read-only job store: status still answers
            pass
        if cache is not None:
            cache.save()
    return out


@contextlib.contextmanager
def _no_cycle_collection():
    """Python's cycle collector paused while jobs' logs are read and judged: the hundreds of
    thousands of event dicts of a big job (freed by reference counting, no cycles) made it scan
    the heap again and again, a third of the time of an 8,192-rank job's status; and over
    thousands of jobs the statuses and kept rows that pile up made every collection longer."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
