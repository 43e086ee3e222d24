"""What the job table shows of an ended job's run logs, kept in its record, so a table over
thousands of ended jobs reads one record per job and no event files (docs/status.md, "Many jobs").

`summarize` takes, from the table's reading of a log directory (``RunLogs(ends_only=True)``),
the facts the table's row is made of: how the current run ended, its progress, device, newest
eval metrics, srun's per-task exit codes, unreadable lines (of rank 0's file alone where the job
completed: ``rank0_only``, `RunLogs`); and a stamp of what they were read from (the directory's
modification time, and size and modification time of every event file read -- rank 0's or node
0's alone for a ``rank0_only`` reading -- and of the batch outputs when srun's codes were read). The record keeps it
in the job's final state (``final["logs"]``: the local driver when a run ends, ``ddp-hpc status``
when the scheduler reports the end). `kept_logs` answers the table's questions from it, as
`RunLogs` would, while the directory is unchanged or gone; changed (a resumed run writes to it):
None, and the logs are read again. Only the table uses it: a detail view reads the logs.

`final_to_keep` is what status keeps of an end a Slurm source reported: the final state, with
those facts, so that the record answers once the scheduler has forgotten the job.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Iterable

from ddp_hpc.judge.goodput import Goodput, goodput
from ddp_hpc.judge.reader import RunLogs, RunProgress, RunSummary
from ddp_hpc.judge.srun import srun_exit_codes
from ddp_hpc.parsing import to_int
from ddp_hpc.runlogs.schema import ANY_EVENTS_RE, batch_outputs
from ddp_hpc.slurm.query import SACCT, SACCT_C, SQUEUE, SourceState
from ddp_hpc.slurm.states import JobState

__all__ = ["summarize", "kept_logs", "KeptLogs", "start_nodes", "table_goodput", "final_to_keep",
           "scheduler_ended", "VERSION"]

#: bumped whenever what a summary holds or how it is worked out changes: older ones are ignored
VERSION = 4


def stamp(log_dir: str | Path | None, files: Iterable[str] = (), batch: bool = False) -> list | None:
    """[the directory's mtime, [name, size, mtime] of every file the facts were read from]: the
    event files named ``files`` (every one, or rank 0's or node 0's alone for a ``rank0_only``
    reading), and
    with ``batch`` the batch outputs (srun's per-task exit codes were read from them); a file
    gone reads [name, None, None]. A rank's late write (an appended ``end``, NFS attribute
    caching) changes its file, not the directory: it is in the stamp; a new file changes the
    directory. None when the directory cannot be read."""
    if not log_dir:
        return None
    try:
        d = os.stat(log_dir).st_mtime_ns
    except OSError:
        return None
    paths = [os.path.join(log_dir, name) for name in sorted(files)]
    paths += [str(p) for p in batch_outputs(Path(log_dir))] if batch else []
    files = []
    for path in paths:
        try:
            st = os.stat(path)
            files.append([os.path.basename(path), st.st_size, st.st_mtime_ns])
        except OSError:
            files.append([os.path.basename(path), None, None])
    return [d, files]


def event_names(logs: RunLogs) -> list[str]:
    """The names of the event files ``logs`` read (a node's file once for all its ranks)."""
    return sorted({s.path.name for s in logs.ranks.values()})


def summarize(logs: RunLogs, srun_codes: dict[int, int] | None = None) -> dict | None:
    """The table's facts of ``logs`` (read with ``ends_only``) as plain data; None for any
    other reading (a detail view's facts can differ) or a directory without a known path.
    ``srun_codes``: `RunLogs.srun_exit_codes()` when the caller read them (None: not read, read
    when asked; a completed job's are not kept, nor shown)."""
    if not logs.ends_only or logs.log_dir is None:
        return None
    cur, prog, ev = logs.current_run(), logs.progress(), logs.last_eval()
    return {"v": VERSION, "stamp": stamp(logs.log_dir, event_names(logs), srun_codes is not None),
            "listed": logs.listed, "exists": logs.exists,
            "outcome": logs.outcome(), "run": dict(vars(cur)) if cur is not None else None,
            "num_nodes": start_nodes(logs, cur),
            "restart": logs.current_restart(), "bad_lines": {str(r): s.bad_lines for r, s in logs.ranks.items()},
            "end_signals": {str(r): e["signal"] for r, e in logs.last_events().items()
                            if e.get("event") == "end" and e.get("signal")},
            "progress": dict(vars(prog)) if prog is not None else None, "device": logs.device(),
            "eval": {"metrics": ev.get("metrics"), "step": ev.get("step")} if ev else None,
            "srun_codes": {str(r): c for r, c in srun_codes.items()} if srun_codes is not None else None,
            "rank0_only": logs.rank0_only, "goodput": g.to_dict() if (g := table_goodput(logs)) is not None else None}


def table_goodput(logs: RunLogs) -> Goodput | None:
    """The job table's goodput of ``logs`` (rounded as ``status --json`` shows it): where the
    reading holds every run of rank 0 (the table reads only the newest run of a job that has
    several), without the restarts' phases."""
    zero = logs.ranks.get(0)
    g = goodput(logs.ranks, []) if zero is not None and not zero.newest_only else None
    return g.rounded() if g is not None else None


def start_nodes(logs: "RunLogs | KeptLogs", cur: RunSummary | None) -> int | None:
    """How many nodes the current run (``cur``) runs on as rank 0's newest start event of it says
    (``num_nodes``); None: not told."""
    if isinstance(logs, KeptLogs):
        return logs.summary.get("num_nodes")
    events = logs.ranks[0].of_restart(cur.restart) if cur is not None and 0 in logs.ranks else []
    start = next((e for e in reversed(events) if e.get("event") == "start"), {})
    return to_int(start.get("num_nodes"))


def kept_logs(summary: object, log_dir: str | Path | None) -> "KeptLogs | None":
    """The kept facts of ``log_dir`` while they still hold: the summary is of this version and
    the directory is gone, unreadable or unchanged since; else None (read the logs)."""
    if not isinstance(summary, dict) or summary.get("v") != VERSION or not log_dir:
        return None
    try:
        names = [f[0] for f in summary["stamp"][1] if ANY_EVENTS_RE.match(f[0])]   # the files read
        now = stamp(log_dir, names, summary.get("srun_codes") is not None)
        if now is not None and now != summary.get("stamp"):
            return None
        return KeptLogs(summary, log_dir, there=now is not None)
    except (TypeError, ValueError, AttributeError):  # damaged: read the logs
        return None


class _Counted:
    """A rank's stream as the table asks about it: how many of its lines were unreadable."""

    __slots__ = ("bad_lines",)

    def __init__(self, bad_lines: int):
        self.bad_lines = bad_lines


class KeptLogs:
    """`RunLogs`' answers to the job table's questions (``collect(brief=True)`` of a job that
    ended), from a summary; the directory is not read."""

    ends_only = True

    def __init__(self, summary: dict, log_dir: str | Path, there: bool = True):
        self.summary, self.log_dir = summary, Path(log_dir)
        self.listed, self.exists = bool(summary["listed"]) and there, bool(summary["exists"])
        self.rank0_only = bool(summary.get("rank0_only"))
        self.ranks = {int(r): _Counted(int(n)) for r, n in (summary.get("bad_lines") or {}).items()}
        run = summary.get("run")
        self._run = RunSummary(**run) if run else None
        self._progress = summary.get("progress")
        if self._progress:
            RunProgress(**self._progress)  # a damaged one fails here, not later

    @property
    def partial(self) -> list[int]:
        return []

    def current_run(self) -> RunSummary | None:
        return dataclasses.replace(self._run) if self._run is not None else None

    def current_restart(self) -> int:
        return int(self.summary.get("restart") or 0)

    def outcome(self) -> str | None:
        return self.summary.get("outcome")

    def last_events(self) -> dict[int, dict]:
        """Only the ranks' ``end`` events that name a signal (what the state is told from)."""
        return {int(r): {"event": "end", "signal": s} for r, s in (self.summary.get("end_signals") or {}).items()}

    def progress(self, now: float | None = None) -> RunProgress | None:
        return RunProgress(**self._progress) if self._progress else None

    def device(self) -> str | None:
        return self.summary.get("device")

    def last_eval(self) -> dict | None:
        return self.summary.get("eval")

    def srun_exit_codes(self) -> dict[int, int]:
        codes = self.summary.get("srun_codes")
        if codes is None:  # not read when the facts were kept: read them now
            return srun_exit_codes(batch_outputs(self.log_dir)) if self.listed else {}
        return {int(r): int(c) for r, c in codes.items()}

    def widen(self) -> None:
        raise RuntimeError("KeptLogs: a running job's row reads its logs")


def final_to_keep(sched: SourceState, logs, now: float, old: dict | None) -> dict | None:
    """What to keep of a terminal state a Slurm source reported (None: not one), with the table's
    facts of the logs (`kept.summarize`; a detail view's reading keeps those ``old`` had)."""
    if not scheduler_ended(sched):
        return None
    # srun's per-task codes are not shown for a completed job (a requeue's appended batch output
    # keeps an earlier run's): neither read nor kept
    codes = None if sched.info.job_state is JobState.COMPLETED else logs.srun_exit_codes()
    summary = logs.summary if isinstance(logs, KeptLogs) else summarize(logs, codes)
    final = {"state": sched.info.label, "state_name": sched.info.job_state.name, "source": sched.source,
             "seen_at": round(now, 3), "elapsed": sched.elapsed, "time_limit": sched.time_limit,
             "exit_code": sched.exit_code, "steps": sched.steps, "node_list": sched.node_list,
             "restarts": sched.restarts, "rank_exit_codes": {str(r): c for r, c in (codes or {}).items()}}
    if (summary := summary or (old or {}).get("logs")) is not None:
        final["logs"] = summary
    return final


def scheduler_ended(sched: SourceState | None) -> bool:
    """A Slurm source (squeue, sacct) reports that the job ended."""
    return sched is not None and sched.source in (SQUEUE, SACCT, SACCT_C) and sched.info.job_state.terminal
