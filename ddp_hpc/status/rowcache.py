"""The job table's memory of ended jobs: a row, once worked out, is not worked out again while
nothing it came from changed.

A table over thousands of jobs would otherwise read every job's run logs on every refresh,
although almost all of those jobs ended long ago. Each row of a job in a terminal state is kept
in ``$DDP_HPC_HOME/cache/status-table.json`` (beside the job records; one row per line, so a new
row does not encode the others again) together with what it was made from: the job record's
facts about it (its fields, its array task, its final state), the log directory's files that
the table reads (names; size and modification time of all but the ranks' ``rank*.log`` /
``rank*.out`` text), and the scheduler's answer. A later table takes the kept row only when all
of these are the same; a running or pending job is always read afresh (its row changes with the
clock). The rows hold what the table shows (``collect(brief=True)``), not a detail view's facts.
The cache is only ever a shortcut: a missing, unreadable or foreign file is ignored and
rewritten.

`table_row` gives a row the cheapest way that answers what the sources would, after the state's
sources (`ddp_hpc.judge.decide`: the backend's description, the record, the logs):

4. **kept facts** (`ddp_hpc.judge.kept`, in the record's final state): what the table shows of
   an ended job's logs, while the files they were read from are unchanged (or gone);
5. **the cached row**: an ended job's whole row, while everything it was made from is unchanged.

Kept facts and cached rows are copies of what the sources gave, so they are asked first (they
are cheapest) but never tell anything the sources would not.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ddp_hpc import records
from ddp_hpc.fsutil import atomic_write_text
from ddp_hpc.judge import decide, kept
from ddp_hpc.judge.kept import KeptLogs
from ddp_hpc.runlogs.schema import LOG_RE, OUT_RE
from ddp_hpc.slurm.query import SourceState
from ddp_hpc.slurm.states import JobState, parse_state
from ddp_hpc.status.assemble import resolve, told_without_logs
from ddp_hpc.status.job import JobStatus
from ddp_hpc.status.targets import JobSources, StatusTarget

CACHE_FILE = "status-table.json"
#: bumped whenever what a row holds or how it is worked out changes: older rows are then ignored
VERSION = 3
_KEY_JSON = dict(default=str, separators=(",", ":"), sort_keys=True)
_HEAD = f'{{"version":{VERSION},"rows":{{'  # the file's first line


def table_row(s: JobSources, cache: RowCache) -> tuple[JobStatus, dict | None]:
    """(the table's row, the final state to keep in the record): from the kept facts of an
    ended job (4), else the row cache (5) while the row's inputs are unchanged, else resolved
    (and cached when the job ended, unless its record is to keep it: the next table then takes
    the row from the kept facts)."""
    facts = kept_facts(s)
    key = None
    keeps_final = (s.described.scheduled and s.record is not None and bool(s.record.path)
                   and kept.scheduler_ended(s.sched))
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
    return told is not None and told.source == decide.RECORD


def kept_facts(s: JobSources) -> KeptLogs | None:
    """Source 4: the table's facts of an ended job's logs as its record keeps them, while they
    hold; None: read the logs (a job that runs, no or stale facts)."""
    if s.sched is not None and s.sched.info.job_state.active:
        return None
    final = s.final
    if not final or "logs" not in final or not parse_state(final.get("state")).job_state.terminal:
        return None
    return kept.kept_logs(final["logs"], s.target.log_dir)


def cache_path() -> Path:
    return records.records_dir().parent / "cache" / CACHE_FILE


def load(path: Path | None = None) -> "RowCache":
    """The kept rows. The file is one JSON document, ``{"version": N, "rows": {id: {"made_from",
    "status"}}}``, written one row per line (`save`) and read line by line: a damaged line costs
    its row only, and an unchanged row is written back as it was read, not encoded again. A file
    of another version (or not ours) is ignored."""
    path = cache_path() if path is None else path
    rows: dict[str, list] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, ValueError):
        lines = []
    for line in lines[1:] if lines and lines[0] == _HEAD else ():
        try:
            (job_id, row), = json.loads("{" + line.rstrip(",") + "}").items()
            if isinstance(row.get("made_from"), str) and isinstance(row.get("status"), dict):
                rows[job_id] = [row["made_from"], row["status"], line.rstrip(",")]
        except (ValueError, AttributeError):  # the closing line, or a damaged one
            continue
    return RowCache(path, rows)


class RowCache:
    """Rows by job id: ``{id: [made_from, status (JobStatus.to_dict()), its text in the file]}``;
    ``made_from`` is the JSON text of what the row was made from, compared as text."""

    def __init__(self, path: Path, rows: dict):
        self.path, self.rows, self.changed = path, rows, False
        self._tasks: dict[int, dict] = {}  # id(record) -> {task id: its array entry}

    def key(self, t: StatusTarget, sched: SourceState | None, only: str | None,
            uses_final: bool) -> tuple[str, str]:
        """(the job's id, what its row is made from) for target ``t`` and the scheduler's answer;
        ``uses_final``: the record's final state gives the job's state (``decide.told`` says so)."""
        # not what the sources that did not answer said (``tried``): the table does not show it,
        # and one job leaving squeue changes it for all
        made_from = [self._record_part(t, uses_final), t.log_dir, _dir_stamp(t.log_dir), _answer(sched), only]
        return t.id, json.dumps(made_from, **_KEY_JSON)

    def _record_part(self, t: StatusTarget, uses_final: bool) -> list | None:
        """The record's facts about this job or array task: its fields but the other tasks'
        entries and final states (an array's record is rewritten whenever one of its tasks ends),
        and its own final state where that gives the state."""
        rec = t.record
        if rec is None:
            return None
        fields = {k: v for k, v in rec.to_dict().items() if k not in ("array", "final")}
        task = t.task_id
        if task is not None and id(rec) not in self._tasks:
            self._tasks[id(rec)] = {str(e.get("task_id")): e for e in rec.array}
        entry = self._tasks[id(rec)].get(task) if task is not None else None
        final = records.final_of(rec, task) if uses_final else None
        return [fields, entry, final]

    def get(self, key: tuple[str, str]) -> dict | None:
        """The kept row made from exactly ``key``'s inputs, else None."""
        row = self.rows.get(key[0])
        if row is None or row[0] != key[1]:
            return None
        if row[1] is None:  # added by `put` in this process: read back as it will be next time
            row[1] = json.loads("{" + row[2] + "}")[key[0]]["status"]
        return row[1]

    def put(self, key: tuple[str, str], status: dict) -> None:
        """Keep the row of a job that ended (others change with the clock: not kept), as the
        line the file will hold (a copy: later notes on the live status stay out of it)."""
        if not JobState[status["state_name"]].terminal:
            return
        try:
            line = json.dumps(key[0]) + ":" + json.dumps({"made_from": key[1], "status": status}, default=str,
                                                        separators=(",", ":"))
        except (TypeError, ValueError):
            return
        self.rows[key[0]] = [key[1], None, line]
        self.changed = True

    def save(self) -> None:
        """Write the rows when one was added or changed (the kept ones as they were read). A
        cache that cannot be written is left alone: status still answers."""
        if not self.changed:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            rows = ",\n".join(row[2] for row in self.rows.values())
            atomic_write_text(self.path, f"{_HEAD}\n{rows}\n}}}}\n")
        except OSError:
            pass


def _dir_stamp(log_dir: str | None) -> list | None:
    """The names of the directory's files, with size and modification time of those the table
    reads (all but the ranks' text logs and raw output, which can be large and grow)."""
    if not log_dir:
        return None
    out = []
    try:
        with os.scandir(log_dir) as entries:
            for e in entries:
                if LOG_RE.match(e.name) or OUT_RE.match(e.name):
                    out.append([e.name])
                    continue
                try:
                    st = e.stat()
                except OSError:
                    continue
                out.append([e.name, st.st_size, st.st_mtime_ns])
    except OSError:
        return None
    return sorted(out)


def _answer(sched: SourceState | None) -> list | None:
    if sched is None:
        return None
    return [sched.info.label, sched.source, sched.elapsed, sched.time_limit, sched.nodes, sched.node_list,
            sched.reason, sched.exit_code, sched.restarts, sched.steps, sched.history]
