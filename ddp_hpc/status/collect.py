"""The status of many jobs at once: each job's backend asked to describe it (the scheduler once
per source for all of its jobs), each job resolved (`ddp_hpc.status.assemble`: its state decided
by `ddp_hpc.judge.decide`, its detail view; the table's row from the kept facts or the row cache
where they stand in for the logs, `ddp_hpc.status.rowcache`), and the final states seen kept in
the records in one batch.

The result, one :class:`JobStatus` per job, is a plain value that the views render as a table
row, a detail page or JSON; nothing here prints. A record of a job array becomes one status per
array task (each task has its own log directory).
"""
from __future__ import annotations

import contextlib
import gc
import time

from ddp_hpc import backends, records
from ddp_hpc.backends.base import Backend
from ddp_hpc.judge.decide import Described
from ddp_hpc.status import rowcache
from ddp_hpc.status.assemble import resolve
from ddp_hpc.status.job import JobStatus
from ddp_hpc.status.targets import JobSources, StatusTarget

__all__ = ["collect", "JobStatus", "StatusTarget"]


def collect(targets: list[StatusTarget], cli=None, cli_note: str | None = None, history: bool = False,
            now: float | None = None, only: str | None = None, brief: bool = False,
            lanes: bool = False) -> list[JobStatus]:
    """Status of every target. Each target's backend describes its jobs, many at once (the Slurm
    backends together: one squeue and one sacct call however many jobs and array tasks; a local
    job's recorded processes); ``cli``: the SlurmCLI the scheduler is asked through (None: it is
    not asked, and ``cli_note`` says why in each job's sources). ``only`` names the one source to
    ask (squeue | sacct | "sacct -c" | logs), for comparing them. A terminal state the scheduler
    reports is kept in the job's record (`records.store_finals`, all at once). ``brief``: the
    table's rows (`Resolved.row`: no failure attribution, per-rank endings or step times; an
    ended job's from the kept facts or the row cache, `rowcache.table_row`), else the detail view
    (`Resolved.detail`; ``lanes``: with every rank's lane in its picture, for ``--html``)."""
    now = time.time() if now is None else now
    described = describe(targets, cli, cli_note, history, only)
    out, finals = [], {}
    with _no_cycle_collection():
        cache = rowcache.load() if brief else None
        for t in targets:
            sources = JobSources(t, described[t.id], now, only)
            if cache is not None:
                st, final = rowcache.table_row(sources, cache)
            else:
                job = resolve(sources)
                st, final = job.detail(lanes), job.final_to_keep()
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


def describe(targets: list[StatusTarget], cli=None, cli_note: str | None = None, history: bool = False,
             only: str | None = None) -> dict[str, Described]:
    """What each target's backend tells of it (`Backend.describe`): the targets grouped by the
    backends that describe them together (``describes_with``), one call per group. A backend
    whose describe raises (a plugin's scheduler client that fails) leaves its jobs to their
    records and logs, with a note that says why, and the others' jobs show as ever."""
    offline = None if cli is not None else (cli_note or "")
    made: dict[str, Backend] = {}
    groups: dict[str, tuple[Backend, list[StatusTarget]]] = {}
    for t in targets:
        key = str(t.record.backend) if t.record is not None else ("local-" if t.id.startswith("local-") else "")
        backend = made.get(key)
        if backend is None:
            backend = made[key] = backends.of_record(t.record, job_id=t.id, client=cli, offline=offline)
        groups.setdefault(backend.describes_with, (backend, []))[1].append(t)
    out: dict[str, Described] = {}
    for backend, group in groups.values():
        try:
            out.update(backend.describe(group, history=history, only=only))
        except Exception as exc:   # a backend's own scheduler client failing: the other jobs still show
            why = (f"{backend.name}: could not describe its jobs ({type(exc).__name__}: {exc}); "
                   "state from the record and the logs")
            out.update({t.id: Described(True, tried=(why,)) for t in group})
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
