"""The job table's memory of ended jobs: a row, once worked out, is not worked out again while
nothing it came from changed.

A table over thousands of jobs would otherwise read every job's run logs on every refresh,
although almost all of those jobs ended long ago. Each row of a job in a terminal state is kept
in ``$DDP_HPC_HOME/cache/status-table.json`` (beside the job records) together with what it was
made from: the job record's facts about it (its fields, its array task, its final state), the
log directory's files that the table reads (names; size and modification time of all but the
ranks' ``rank*.log`` / ``rank*.out`` text), and the scheduler's answer. A later table takes the
kept row only when all of these are the same; a running or pending job is always read afresh
(its row changes with the clock). The rows hold what the table shows (``collect(brief=True)``),
not a detail view's facts. The cache is only ever a shortcut: a missing, unreadable or foreign
file is ignored and rewritten.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ddp_hpc import records
from ddp_hpc.fsutil import atomic_write_text
from ddp_hpc.runlogs.schema import LOG_RE, OUT_RE
from ddp_hpc.slurm.query import SourceState
from ddp_hpc.slurm.states import JobState

CACHE_FILE = "status-table.json"
#: bumped whenever what a row holds or how it is worked out changes: older rows are then ignored
VERSION = 1


def cache_path() -> Path:
    return records.records_dir().parent / "cache" / CACHE_FILE


def load(path: Path | None = None) -> "RowCache":
    path = cache_path() if path is None else path
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        rows = doc["rows"] if doc.get("version") == VERSION and isinstance(doc.get("rows"), dict) else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        rows = {}
    return RowCache(path, rows)


class RowCache:
    """Rows by job id: ``{id: {"made_from": [...], "status": JobStatus.to_dict()}}``."""

    def __init__(self, path: Path, rows: dict):
        self.path, self.rows, self.changed = path, rows, False
        self._tasks: dict[int, dict] = {}  # id(record) -> {task id: its array entry}

    def key(self, t, sched: SourceState | None, only: str | None) -> tuple[str, list]:
        """(the job's id, what its row is made from) for target ``t`` and the scheduler's answer."""
        # not what the sources that did not answer said (``tried``): the table does not show it,
        # and one job leaving squeue changes it for all
        return t.id, [self._record_part(t, sched), t.log_dir, _dir_stamp(t.log_dir), _answer(sched), only]

    def _record_part(self, t, sched: SourceState | None) -> list | None:
        """The record's facts about this job or array task: its fields but the other tasks'
        entries and final states (an array's record is rewritten whenever one of its tasks ends),
        and its own final state where that gives the state (the scheduler did not answer)."""
        rec = t.record
        if rec is None:
            return None
        fields = {k: v for k, v in rec.to_dict().items() if k not in ("array", "final")}
        task = t.id.rsplit("_", 1)[-1] if rec.array and "_" in t.id else None
        if task is not None and id(rec) not in self._tasks:
            self._tasks[id(rec)] = {str(e.get("task_id")): e for e in rec.array}
        entry = self._tasks[id(rec)].get(task) if task is not None else None
        final = records.final_of(rec, task) if sched is None or sched.state.state is JobState.UNKNOWN else None
        return json.loads(json.dumps([fields, entry, final], default=str))

    def get(self, key: tuple[str, list]) -> dict | None:
        """The kept row made from exactly ``key``'s inputs, else None."""
        entry = self.rows.get(key[0])
        if isinstance(entry, dict) and entry.get("made_from") == key[1] and isinstance(entry.get("status"), dict):
            return entry["status"]
        return None

    def put(self, key: tuple[str, list], status: dict) -> None:
        """Keep the row of a job that ended (others change with the clock: not kept)."""
        if not JobState[status["state_name"]].terminal:
            return
        try:  # a copy, as it will read back: later notes on the live status stay out of it
            self.rows[key[0]] = {"made_from": key[1], "status": json.loads(json.dumps(status, default=str))}
        except (TypeError, ValueError):
            return
        self.changed = True

    def save(self) -> None:
        """Write the rows when one was added or changed. A cache that cannot be written is left
        alone: status still answers."""
        if not self.changed:
            return
        try:
            text = json.dumps({"version": VERSION, "rows": self.rows}, default=str, separators=(",", ":"))
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, text + "\n")
        except (OSError, TypeError, ValueError):
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
    return [sched.state.label, sched.source, sched.elapsed, sched.time_limit, sched.nodes, sched.node_list,
            sched.reason, sched.exit_code, sched.restarts, sched.steps, sched.history]
