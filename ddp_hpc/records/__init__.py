"""Job records: one small JSON file per submission, so `ddp_hpc.status` finds a job from any directory.
(`ddp_hpc.records.register`: the record of a job ddp_hpc did not submit, ``ddp-hpc records register``.)

Why a record at all: Slurm forgets a job soon after it ends (squeue) and without accounting
(sacct) never tells where its logs went; the submitter knows, so it writes it down once.

Where: ``$DDP_HPC_HOME/jobs/<record id>.json`` (default ``~/.ddp_hpc/jobs``). The record id is the
job id (``12345`` or ``local-...``). Slurm job ids restart at 1 whenever a controller's state is
wiped, so an id can come back: a new record never overwrites an old one, it takes the next free
name ``<id>.1.json``, ``<id>.2.json`` ..., and :func:`load_record` returns the newest record with
that id (optionally only on one cluster). Writes are atomic (temp file in the same directory,
fsync, rename), so a reader never sees half a record. A record is rewritten under its lock
(``.<file name>.lock`` beside it, `ddp_hpc.fsutil.locked`) from what its file holds then: the
local driver, ``ddp-hpc cancel``, ``ddp-hpc status`` and the supervisor may write one at once, and
none loses another's fields (:func:`update_record`, :func:`store_final`, :func:`add_alloc_restart`).

The fields are `JobRecord`'s (docs/architecture.md, "Job records"). ``final`` is written by
``ddp_hpc.status`` once the scheduler reports the job ended (Slurm forgets it later; a cluster can
go down), by the local driver when a local run ends, and by ``ddp-hpc cancel``: `store_final`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

from ddp_hpc.errors import HintError
from ddp_hpc.fsutil import atomic_write_json, atomic_write_texts, locked
from ddp_hpc.slurm.states import parse_state
from ddp_hpc.slurm.times import format_duration

__all__ = ["JobRecord", "JobRecordError", "records_dir", "write_record", "update_record", "add_alloc_restart",
           "load_record", "list_records", "final_of", "first_restart", "store_final", "store_finals",
           "local_final"]

_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")


class JobRecordError(HintError, LookupError):
    """A record that is missing or unreadable; the message names the id, the directory and the fix."""


@dataclasses.dataclass
class JobRecord:
    """One submission. ``array``: ``{task_id, overrides, log_dir}`` per task of a job array (then
    ``log_dir`` is the tasks' parent); ``pids``: the local backend's processes; ``script``: the
    rendered sbatch script; ``command``: for the user's own script, module or function (``config``
    None), what every rank runs under ``ddp_hpc.exec`` (``["<function>", "mod:fn"]`` for a function)."""

    id: str
    cluster: str
    name: str
    backend: str
    nodes: int
    gpus_per_node: int
    time_limit: str | None
    log_dir: str
    config: str | None
    overrides: list[str]
    submitted_at: float
    cwd: str
    array: list[dict] | None = None
    pids: list[int] | None = None
    #: when each of ``pids`` started (unix seconds, same order), so a pid reused later is not the job's
    pid_times: list[float | None] | None = None
    script: str | None = None
    command: list[str] | None = None
    #: the job's terminal state as the scheduler last reported it (`store_final`: state, state_name,
    #: source, seen_at, elapsed, time_limit, exit_code, steps, rank_exit_codes, node_list, a local
    #: job's started_at and ended_at); for a job array one such dict per task id (``{"3": {...}}``)
    final: dict | None = None
    #: the restart number of the job's first run in its logs: 0, or one past a resumed stopped run's
    restart_base: int = 0
    #: the in-allocation restarts (ddp_hpc.supervise), one dict each (runlogs.schema.ALLOC_RESTART_KEYS):
    #: when and why, what was excluded, the nodes and world size before and after
    alloc_restarts: list[dict] | None = None
    min_nodes: int | None = None  #: submitted with --nodes MIN-MAX: MIN (``nodes`` is MAX); else None
    #: keys a newer writer added that this version does not know; kept so a rewrite loses nothing
    extra: dict = dataclasses.field(default_factory=dict)
    #: the file this record was read from or written to (not stored inside the file)
    path: str | None = dataclasses.field(default=None, compare=False)
    #: the file's JSON when this record was read or written (not stored in it): `update_record`
    #: keeps the fields that changed in the file since, where this copy left them as they were
    loaded: str | None = dataclasses.field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _NOT_STORED}
        d["id"] = str(d["id"])
        return {**self.extra, **d}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], path: str | None = None) -> "JobRecord":
        known, required = _field_names(cls)
        missing = sorted(required - set(data))
        if missing:
            raise JobRecordError(f"job record {path or '<dict>'} lacks the keys {missing}.",
                                 "it was not written by ddp_hpc.submit or is damaged; remove it.")
        kwargs = {k: data[k] for k in known if k in data}
        kwargs["id"] = str(kwargs["id"])
        extra = {k: v for k, v in data.items() if k not in known}
        return cls(**kwargs, extra=extra, path=path)


_NOT_STORED = ("extra", "path", "loaded")
_ABSENT = object()


@functools.cache
def _field_names(cls) -> tuple[frozenset, frozenset]:
    """(the fields a record file may hold, those it must hold): once, not per record read."""
    fields, none = dataclasses.fields(cls), dataclasses.MISSING
    return (frozenset(f.name for f in fields) - set(_NOT_STORED),
            frozenset(f.name for f in fields if f.default is none and f.default_factory is none))


def records_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$DDP_HPC_HOME/jobs``, default ``~/.ddp_hpc/jobs`` (not created here)."""
    env = os.environ if environ is None else environ
    home = env.get("DDP_HPC_HOME") or os.path.join(os.path.expanduser("~"), ".ddp_hpc")
    return Path(home) / "jobs"


def _check_id(job_id: str) -> str:
    job_id = str(job_id)
    if not _SAFE_ID.fullmatch(job_id) or ".." in job_id:
        raise JobRecordError(f"job record id {job_id!r} is not a valid id (letters, digits, '_', '.', '+', '-').",
                             "use the Slurm job id (e.g. 12345 or 12345_3) or a local-... id.")
    return job_id


def write_record(rec: JobRecord | Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Path:
    """Store a new record and return its path. Never replaces an existing file: an id seen before
    (job ids repeat across cluster restarts) gets the next free ``<id>.<n>.json``."""
    if not isinstance(rec, JobRecord):
        rec = JobRecord.from_dict(rec)
    job_id = _check_id(rec.id)
    d = records_dir(environ)
    d.mkdir(parents=True, exist_ok=True)
    data = rec.to_dict()
    for n in range(0, 100000):
        path = d / (f"{job_id}.json" if n == 0 else f"{job_id}.{n}.json")
        # O_EXCL claims the name so two concurrent submitters never pick the same file
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            continue
        os.close(fd)
        atomic_write_json(path, data)
        rec.path, rec.loaded = str(path), json.dumps(data)
        return path
    raise JobRecordError(f"too many records with id {job_id!r} in {d}.", "remove old records there.")


def update_record(rec: JobRecord, environ: Mapping[str, str] | None = None) -> Path:
    """Rewrite a record in place (e.g. to add the local backend's pids), atomically, under its
    lock: the fields this copy changed since it was read win; every other field keeps what the file
    holds now (another process may have written it since: cancel's final state, the driver's pids).
    ``rec`` then holds what was written."""
    if rec.path is None:
        return write_record(rec, environ)
    with locked(_lock_of(rec.path), remove=True):
        now = _read(Path(rec.path))
        data = _merged(_data(rec.loaded), rec.to_dict(), _data(now.loaded) if now else None)
        atomic_write_json(rec.path, data)
    fresh = JobRecord.from_dict(data, path=rec.path)
    for f in dataclasses.fields(JobRecord):
        setattr(rec, f.name, getattr(fresh, f.name))
    rec.loaded = json.dumps(data)
    return Path(rec.path)


def add_alloc_restart(job_id: str, row: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Path:
    """Append one in-allocation restart (``ddp_hpc.supervise``) to the ``alloc_restarts`` of job
    ``job_id``'s record, read and rewritten under its lock: the supervisors of a job array's tasks
    share their array's record, and two that restart at once each keep the other's row (an
    `update_record` of a list read before the lock would put back the list without it)."""
    path = load_record(job_id, environ=environ).path
    with locked(_lock_of(path), remove=True):
        now = _read(Path(path))
        if now is None:
            raise JobRecordError(f"the job record {path} went away or cannot be read.",
                                 "submit the job again to get a record.")
        data = json.loads(now.loaded)
        data["alloc_restarts"] = [*(data.get("alloc_restarts") or []), dict(row)]
        atomic_write_json(path, data)
    return Path(path)


def _lock_of(path: str | Path) -> Path:
    return Path(path).with_name(f".{Path(path).name}.lock")


def _data(text: str | None) -> dict | None:
    return json.loads(text) if text else None


def _merged(base: dict | None, mine: dict, now: dict | None) -> dict:
    """What a rewrite stores: the file's fields as ``now``, with the ones ``mine`` changed since
    ``base`` (what this copy was read as). Without either, ``mine``."""
    if base is None or now is None:
        return mine
    return {**now, **{k: v for k, v in mine.items() if base.get(k, _ABSENT) != v}}


def first_restart(rec: JobRecord | None) -> int:
    """The restart number of the job's first run in its logs (``restart_base``; 0 without a
    record or with a value that is no positive whole number): a job that resumed a stopped run
    starts after that run's restarts, and the scheduler's runs of the job map onto the logs' from
    it."""
    base = rec.restart_base if rec is not None else 0
    return base if isinstance(base, int) and base > 0 else 0


def final_of(rec: JobRecord | None, task_id: str | int | None = None) -> dict | None:
    """The stored terminal state of the job (``task_id``: of that task of an array), or None."""
    final = rec.final if rec is not None else None
    if not isinstance(final, dict):
        return None
    if rec.array:
        got = final.get(str(task_id)) if task_id is not None else None
        return got if isinstance(got, dict) else None
    return final


def store_final(rec: JobRecord, finals: Mapping[str | None, dict],
                environ: Mapping[str, str] | None = None) -> bool:
    """Keep the terminal states the scheduler reported (task id -> facts; the key None for a
    job that is not an array) in the record, rewriting its file atomically when they changed
    (``seen_at`` aside). The file is read again first, so fields another process wrote since
    ``rec`` was loaded (the local driver's pids) survive; the read and the write are made under the
    record's lock. Returns True when it wrote."""
    if rec.path is None:
        base = _with_finals(rec, finals)
        return base is not None and bool(write_record(base, environ))
    with locked(_lock_of(rec.path), remove=True):
        base = _with_finals(rec, finals)
        if base is not None:
            atomic_write_json(rec.path, base.to_dict())
    return base is not None


def store_finals(batch: Iterable[tuple[JobRecord, Mapping[str | None, dict]]], chunk: int = 256) -> int:
    """`store_final` for many records (the table keeps every ended job's), each still atomic but
    their fsyncs at once (`fsutil.atomic_write_texts`; one by one, 10,000 took minutes), one line
    each (json's C encoder; indented, a third of the time). Returns how many it wrote. The locks of
    ``chunk`` records are held at a time, taken in the order of their paths (two status commands
    cannot wait on each other); finals given for one record twice are merged."""
    by_path: dict[str, tuple[JobRecord, dict]] = {}
    for rec, finals in batch:
        if rec.path:
            by_path.setdefault(rec.path, (rec, {}))[1].update(finals)
    paths, written = sorted(by_path), 0
    for start in range(0, len(paths), chunk):
        with contextlib.ExitStack() as held:
            writes = []
            for path in paths[start:start + chunk]:
                held.enter_context(locked(_lock_of(path), remove=True))
                base = _with_finals(*by_path[path])
                if base is not None:
                    writes.append((path, json.dumps(base.to_dict(), sort_keys=True) + "\n"))
            atomic_write_texts(writes)
            written += len(writes)
    return written


def _with_finals(rec: JobRecord, finals: Mapping[str | None, dict]) -> JobRecord | None:
    """The record as its file holds it now with ``finals`` in it (and in ``rec``); None: no change."""
    fresh = _read(Path(rec.path)) if rec.path else None
    base = fresh or rec
    final = dict(base.final or {}) if base.array else None
    changed = False
    for task_id, facts in finals.items():
        old = final.get(str(task_id)) if final is not None else base.final
        if _same(old, facts):
            continue
        changed = True
        if final is not None:
            final[str(task_id)] = facts
        else:
            final = facts
    if not changed:
        return None
    base.final = rec.final = final
    return base


def local_final(state: str, started_at: float | None, ended_at: float, source: str,
                reason: str | None = None, exit_code: str | None = None) -> dict:
    """The terminal state of a local run as `store_final` keeps it (``state``: a label such as
    ``"CANCELLED by SIGTERM"``; ``source``: who saw it end)."""
    info = parse_state(state)
    elapsed = format_duration(ended_at - started_at) if started_at else None
    return {"state": info.label, "state_name": info.job_state.name, "source": source,
            "seen_at": round(ended_at, 3), "started_at": started_at, "ended_at": round(ended_at, 3),
            "elapsed": elapsed, "time_limit": None, "exit_code": exit_code, "reason": reason}


def _same(a: object, b: Mapping) -> bool:
    if not isinstance(a, dict):
        return False
    return {k: v for k, v in a.items() if k != "seen_at"} == {k: v for k, v in b.items() if k != "seen_at"}


def _read(path: Path) -> JobRecord | None:
    try:
        with open(path) as f:
            text = f.read()
        data = json.loads(text)
    except (OSError, ValueError):
        return None  # a file being claimed (empty) or damaged: not a record
    if not isinstance(data, dict):
        return None
    try:
        rec = JobRecord.from_dict(data, path=str(path))
    except (JobRecordError, TypeError):
        return None
    rec.loaded = text
    return rec


def _files(d: Path, job_id: str | None = None) -> Iterable[Path]:
    if not d.is_dir():
        return []
    if job_id is None:
        return [p for p in d.glob("*.json") if not p.name.startswith(".")]
    pat = re.compile(re.escape(job_id) + r"(\.\d+)?\.json")
    return [p for p in d.glob(f"{_glob_escape(job_id)}*.json") if pat.fullmatch(p.name)]


def _glob_escape(s: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", s)


def list_records(environ: Mapping[str, str] | None = None) -> list[JobRecord]:
    """Every readable record, oldest submission first."""
    recs = [r for r in (_read(p) for p in _files(records_dir(environ))) if r is not None]
    recs.sort(key=lambda r: (r.submitted_at, r.path or ""))
    return recs


def load_record(job_id: str, cluster: str | None = None,
                environ: Mapping[str, str] | None = None) -> JobRecord:
    """The newest record with this id (array task ids like ``123_4`` find their parent ``123``),
    only on ``cluster`` when given. Raises :class:`JobRecordError` naming what exists."""
    job_id = _check_id(job_id)
    d = records_dir(environ)
    candidates = [job_id]
    if "_" in job_id:
        candidates.append(job_id.split("_", 1)[0])
    for cid in candidates:
        recs = [r for r in (_read(p) for p in _files(d, cid)) if r is not None]
        if cluster is not None:
            recs = [r for r in recs if r.cluster == cluster]
        if recs:
            return max(recs, key=lambda r: (r.submitted_at, r.path or ""))
    known = [r.id for r in list_records(environ)][-10:]
    where = f" on cluster {cluster!r}" if cluster else ""
    raise JobRecordError(
        f"no job record with id {job_id!r}{where} in {d}.",
        f"recent ids there: {known or 'none'}; jobs submitted with ddp_hpc.submit are recorded "
        f"under $DDP_HPC_HOME/jobs (set DDP_HPC_HOME to the value used when submitting).")
