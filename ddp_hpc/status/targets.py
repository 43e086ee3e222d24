"""Which jobs to look at: job records (``$DDP_HPC_HOME/jobs``, written by ddp_hpc.submit) become
targets, each with its id and log directory; a job array's record becomes one target per task.
``JobSources`` is what one target is resolved from before any log is read (its target, what its
backend described).

``collect`` asks each target's backend to describe it (many at once) and puts the answers together.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from ddp_hpc import records
from ddp_hpc.backends import is_slurm_id
from ddp_hpc.errors import HintError
from ddp_hpc.judge.decide import Described
from ddp_hpc.records import JobRecord
from ddp_hpc.slurm.query import SourceState


class StatusError(HintError):
    """A request status cannot answer; the message names the value, the hint the fix."""


@dataclass
class StatusTarget:
    """A job to look at: its id, the record it came from (if any) and its log directory;
    ``task_id``: the array task id of a target made from an array record (``123_4`` -> ``"4"``)."""

    id: str
    record: records.JobRecord | None = None
    log_dir: str | None = None
    task_id: str | None = field(init=False, default=None)

    def __post_init__(self):
        if self.record is not None and self.record.array and "_" in self.id:
            self.task_id = self.id.rsplit("_", 1)[-1]


@dataclass(frozen=True)
class JobSources:
    """What one job is resolved from, before any log is read: its target (id, record, log
    directory), what its backend described (``Described``: the scheduler's answer, or its
    processes; the notes of the sources tried), ``now``, and ``only`` (the one source the user
    asked for). Made once per job, it holds the facts its readers ask for as plain values: the
    record and array task, the scheduler's answer (``sched``: None when the job has none, it does
    not list it, or was not asked) and the terminal state the record keeps of it (``final``)."""

    target: StatusTarget
    described: Described
    now: float
    only: str | None = None
    record: JobRecord | None = field(init=False)
    task_id: str | None = field(init=False)
    sched: SourceState | None = field(init=False)
    final: dict | None = field(init=False)

    def __post_init__(self):
        facts = {"record": self.target.record, "task_id": self.target.task_id, "sched": self.described.scheduler,
                 "final": records.final_of(self.target.record, self.target.task_id)}
        for name, value in facts.items():
            object.__setattr__(self, name, value)


def targets_from_records(recs) -> list[StatusTarget]:
    """One target per record, or per array task for job arrays."""
    out = []
    for rec in recs:
        if rec.array:
            for task in rec.array:
                tid = task.get("task_id")
                out.append(StatusTarget(f"{rec.id}_{tid}", rec, task.get("log_dir") or rec.log_dir))
        else:
            out.append(StatusTarget(str(rec.id), rec, rec.log_dir))
    return out


def job_targets(job_id: str, log_dir: str | None, cluster: str | None = None) -> list[StatusTarget]:
    """The targets for ``status JOBID``: from the job record (this cluster's first: ids repeat
    across clusters), or a bare Slurm id (and ``log_dir``) when there is no record. A non-Slurm id
    without a record and without ``log_dir`` raises the record's JobRecordError."""
    try:
        rec = _load(job_id, cluster)
    except records.JobRecordError:
        if log_dir or is_slurm_id(job_id):
            return [StatusTarget(job_id, None, log_dir)]
        raise
    tasks = targets_from_records([rec])
    if "_" in job_id and rec.array:
        tasks = [t for t in tasks if t.id == job_id] or tasks
    for t in tasks if log_dir else ():
        t.log_dir = log_dir
    return tasks


def _load(job_id: str, cluster: str | None):
    """The record of ``job_id`` on ``cluster`` when there is one, else the newest with that id."""
    if cluster:
        try:
            return records.load_record(job_id, cluster=cluster)
        except records.JobRecordError:
            pass
    return records.load_record(job_id)


def submitted_here(cwd: str | None, here: str | None) -> bool:
    """Whether a job whose record says ``cwd`` was submitted from ``here`` or a directory below
    it (a checkout's jobs, wherever in it they were submitted); True when either is not known."""
    if not cwd or not here:
        return True
    cwd, here = os.path.realpath(cwd), os.path.realpath(here)
    return cwd == here or cwd.startswith(here.rstrip(os.sep) + os.sep)


def recent_targets(limit: int, here: str | None = None) -> list[StatusTarget]:
    """Targets of the ``limit`` newest records (all for 0), newest first; with ``here``, of the
    records submitted from that directory or one below it (``status --here``) alone."""
    recs = [r for r in reversed(records.list_records()) if here is None or submitted_here(r.cwd, here)]
    return targets_from_records(recs[:limit] if limit else recs)
