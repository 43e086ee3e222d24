"""Read a run's log directory: per-rank event streams, the first failing rank, progress, requeues.

The training core writes, per rank R, ``rank{R}.events.jsonl`` (one JSON object per line, see
docs/architecture.md) and ``rank{R}.log``; Slurm adds ``rank{R}.out`` (srun ``--output=rank%t.out``)
and ``slurm-<id>.out``. This module turns those files into the facts the status command shows and
never raises on a damaged file: a half-written last line (the writer may be mid-flush) or a stray
non-JSON line is skipped and counted.

Why so much care about *which* rank failed first: when one rank raises, srun's kill-on-bad-exit and
collective timeouts make every other rank die too, often with errors of their own ("connection
reset by peer"), and a rank that was killed or hangs writes nothing at all. Who is to blame is
decided by evidence in ``ddp_hpc.runlogs.attribution``; this module reads the files it weighs.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ddp_hpc.runlogs.attribution import Failure, SchedulerFacts, attribute, first_failure
from ddp_hpc.runlogs.schema import BATCH_OUT_GLOB, EVENTS_RE, LOG_RE, OUT_RE
from ddp_hpc.runlogs.srun import (LOCAL_DRIVER_OUT, TaskReport, exception_of, local_reports,
                                  node_failures, srun_exit_codes, tail_file, tail_lines,
                                  task_reports, traceback_in, traceback_in_lines)
from ddp_hpc.runlogs.tails import read_window
from ddp_hpc.runlogs.timing import Progress, progress

__all__ = ["RunLogs", "RankStream", "Failure", "Progress", "RunSummary", "read_events",
           "traceback_in", "exception_of", "tail_file", "tail_lines"]

#: the read budget: a log directory's event files are read whole while together they hold at
#: most FULL_READ_BYTES (about 100,000 events); beyond that, rank 0's file is read whole (up to
#: that size: it gives progress, ETA, eval metrics) and of every other rank's file only the first
#: HEAD_BYTES and the last TAIL_LINES lines (read back from TAIL_BYTES, at most TAIL_MAX_BYTES:
#: a stack event can be long), so status of a job of thousands of ranks takes seconds, not minutes
FULL_READ_BYTES = 32 << 20
HEAD_BYTES = 4 << 10
TAIL_LINES = 32
TAIL_BYTES = 8 << 10
TAIL_MAX_BYTES = 1 << 20
#: how much of the end of a ``rank{R}.out`` is read for its last traceback, and how many of its
#: last lines are searched for a peer's failure (NCCL's watchdog) and the rank's own error line
OUT_TAIL_BYTES = 1 << 16
OUT_TAIL_LINES = 200


@dataclass
class RankStream:
    """One rank's events (in file order) and how many lines could not be parsed."""

    rank: int
    path: Path
    events: list[dict] = field(default_factory=list)
    bad_lines: int = 0
    skipped: int = 0  # bytes in the middle of the file not read (see `RunLogs`: read budget)
    #: the events grouped by restart number, and the (list, length) it was built from: status
    #: asks for one run's events many times per rank, and a scan per question made it quadratic
    _by_restart: tuple | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def last(self) -> dict | None:
        return self.events[-1] if self.events else None

    def _runs(self) -> dict[int, list[dict]]:
        """restart number -> its events in file order; rebuilt when `events` changed length."""
        key = (id(self.events), len(self.events))
        if self._by_restart is None or self._by_restart[0] != key:
            runs: dict[int, list[dict]] = {}
            for e in self.events:
                runs.setdefault(_int(e.get("restart"), 0), []).append(e)
            self._by_restart = (key, runs)
        return self._by_restart[1]

    def of_restart(self, restart: int) -> list[dict]:
        return list(self._runs().get(restart, ()))

    def restart_numbers(self) -> set[int]:
        return set(self._runs())


@dataclass
class RunSummary:
    """One run of the job (restart 0 is the first; a requeue starts the next)."""

    restart: int
    started: float | None
    last_time: float | None
    ranks: list[int]
    last_step: int | None
    end_status: str | None  # "completed" | "preempted" | "failed" | None (no end event yet)
    preempt_reason: str | None
    requeued: bool
    errors: int


def read_events(path: Path, window: bool = False) -> RankStream:
    """Parse one ``rank{R}.events.jsonl``; malformed lines are skipped and counted. ``window``:
    only its first `HEAD_BYTES` and its last `TAIL_LINES` lines (`skipped` says how many bytes
    between them were not read)."""
    m = EVENTS_RE.match(path.name)
    stream = RankStream(rank=int(m.group(1)) if m else -1, path=path)
    if window:
        head, tail, stream.skipped = read_window(path, HEAD_BYTES, TAIL_LINES, TAIL_BYTES, TAIL_MAX_BYTES)
        text = head + tail
    else:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return stream
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            ev = json.loads(line)
        except ValueError:
            stream.bad_lines += 1
            continue
        if isinstance(ev, dict) and "event" in ev:
            stream.events.append(ev)
        else:
            stream.bad_lines += 1
    return stream


class RunLogs:
    """All the rank files of one log directory, read once; methods derive the facts. A missing
    directory (or None: a job whose log directory is not known) reads as one without files."""

    def __init__(self, log_dir: str | Path | None):
        self.log_dir = Path(log_dir) if log_dir else None
        self.ranks: dict[int, RankStream] = {}
        self.outs: dict[int, Path] = {}
        self.texts: dict[int, Path] = {}
        self._outs_read: dict[int, tuple[list[str] | None, list[str]]] = {}
        self._memo: dict[str, tuple] = {}
        if self.log_dir is None or not self.log_dir.is_dir():
            return
        paths = sorted(self.log_dir.iterdir())
        events = [(int(m.group(1)), p) for p in paths if (m := EVENTS_RE.match(p.name))]
        window = _over_budget([p for _, p in events])
        for rank, p in events:
            self.ranks[rank] = read_events(p, window and (rank != 0 or _size(p) > FULL_READ_BYTES))
        for p in paths:
            if m := OUT_RE.match(p.name):
                self.outs[int(m.group(1))] = p
            elif m := LOG_RE.match(p.name):
                self.texts[int(m.group(1))] = p

    @property
    def partial(self) -> list[int]:
        """The ranks whose event files were read only in part (the read budget)."""
        return [r for r, s in sorted(self.ranks.items()) if s.skipped]

    @property
    def exists(self) -> bool:
        return bool(self.ranks or self.outs or self.texts)

    def all_events(self) -> list[dict]:
        evs = [e for s in self.ranks.values() for e in s.events]
        return sorted(evs, key=lambda e: _float(e.get("time"), 0.0))

    def restarts(self) -> list[int]:
        """Every restart number seen in any event, ascending."""
        return sorted(set().union(*(s.restart_numbers() for s in self.ranks.values())))

    def current_restart(self) -> int:
        r = self.restarts()
        return r[-1] if r else 0

    def last_events(self) -> dict[int, dict]:
        return {r: s.last for r, s in sorted(self.ranks.items()) if s.last is not None}

    def world_size(self) -> int | None:
        for s in self.ranks.values():
            for e in s.events:
                if e.get("event") == "start" and e.get("world_size") is not None:
                    return _int(e.get("world_size"), None)
        return None

    def device(self) -> str | None:
        """The device type the newest run trained on ("cpu", "cuda", ...) as its ``start`` events
        tell it (rank 0's first); None when no start event names one."""
        restart = self.current_restart()  # once: inside the comprehension it was once per rank
        starts = [e for s in sorted(self.ranks.values(), key=lambda s: s.rank)
                  for e in s.of_restart(restart)
                  if e.get("event") == "start" and e.get("device")]
        return str(starts[0]["device"]).split(":", 1)[0] if starts else None

    def runs(self) -> list[RunSummary]:
        """One summary per restart number: what each run of a requeued job did (computed once
        while the streams do not change; each call returns copies)."""
        key = tuple((id(s.events), len(s.events)) for s in self.ranks.values())
        if self._memo.get("runs", (None,))[0] != key:
            self._memo["runs"] = (key, self._runs())
        return [dataclasses.replace(r) for r in self._memo["runs"][1]]

    def _runs(self) -> list[RunSummary]:
        out = []
        for restart in self.restarts():
            evs = [e for s in self.ranks.values() for e in s.of_restart(restart)]
            evs.sort(key=lambda e: _float(e.get("time"), 0.0))
            ends = [e for e in evs if e.get("event") == "end"]
            statuses = {str(e.get("status")) for e in ends}
            end_status = None
            if ends:
                end_status = next((s for s in ("failed", "preempted", "completed") if s in statuses),
                                  sorted(statuses)[0])
            pre = [e for e in evs if e.get("event") == "preempt"]
            steps = [_int(e.get("step"), None) for e in evs if e.get("step") is not None]
            steps = [s for s in steps if s is not None]
            out.append(RunSummary(
                restart=restart,
                started=_float(evs[0].get("time"), None) if evs else None,
                last_time=_float(evs[-1].get("time"), None) if evs else None,
                ranks=sorted({_int(e.get("rank"), -1) for e in evs}),
                last_step=max(steps) if steps else None,
                end_status=end_status,
                preempt_reason=pre[0].get("reason") if pre else None,
                requeued=any(e.get("event") == "requeue" for e in evs),
                errors=sum(1 for e in evs if e.get("event") == "error"),
            ))
        return out

    def outcome(self) -> str | None:
        """The current run's ending as the events tell it: completed/failed/preempted, else None.

        "completed" only when every rank that started wrote ``end`` completed; any ``error`` or a
        failed ``end`` makes it "failed".
        """
        if not self.ranks:
            return None
        runs = self.runs()
        cur = runs[-1] if runs else None
        if cur is None:
            return None
        if cur.errors or cur.end_status == "failed":
            return "failed"
        if cur.end_status == "preempted":
            return "preempted"
        if cur.end_status == "completed":
            ended = {r for r, s in self.ranks.items()
                     if any(e.get("event") == "end" for e in s.of_restart(cur.restart))}
            ws = self.world_size()
            expected = set(range(ws)) if ws else set(cur.ranks)
            return "completed" if expected <= ended else None
        return None

    def progress(self, now: float | None = None) -> Progress | None:
        """Epoch/step/percent, last loss, samples/s and an ETA from rank 0's (else the first
        rank's) metrics events of the current run (`timing.progress`)."""
        restart = self.current_restart()
        stream = self.ranks.get(0) or next(iter(self.ranks.values()), None)
        if stream is None:
            return None
        return progress(stream.of_restart(restart), stream.events)

    def last_eval(self) -> dict | None:
        """The newest ``eval`` event (rank 0's, else any rank's) with metrics, of any run."""
        for stream in sorted(self.ranks.values(), key=lambda s: s.rank):
            evals = [e for e in stream.events if e.get("event") == "eval" and isinstance(e.get("metrics"), dict)]
            if evals:
                return evals[-1]
        return None

    def first_failure(self, assume_failed: bool = False, evidence_only: bool = False,
                      sched: SchedulerFacts | None = None) -> Failure | None:
        """The primary cause of the current run's failure, by evidence rather than by the first
        timestamp (``ddp_hpc.runlogs.attribution``): a raised error, a killed rank, a lost node, a
        rank stuck while the others timed out; else, when the job failed (``assume_failed``:
        the scheduler says so) or some ranks ended while others did not, the rank whose events
        stopped first. ``evidence_only`` (the job still runs, or was stopped from outside) counts
        only what ranks wrote themselves: srun reports the ranks a cancel stopped as well."""
        return first_failure(self, assume_failed=assume_failed, evidence_only=evidence_only,
                             sched=sched)

    def attribute(self, restart: int | None = None, sched: SchedulerFacts | None = None,
                  assume_failed: bool = False, evidence_only: bool = False, files: bool = True):
        """(primary cause, every rank's ending) of one run: see `attribution.attribute`."""
        return attribute(self, restart, sched, assume_failed, evidence_only, files)

    def out_traceback(self, rank: int) -> list[str] | None:
        """The last Python traceback in the end of ``rank{R}.out`` (read once), or None."""
        return self._out(rank)[0]

    def out_tail(self, rank: int) -> list[str]:
        """The last `OUT_TAIL_LINES` lines of ``rank{R}.out`` (read once)."""
        return self._out(rank)[1]

    def _out(self, rank: int) -> tuple[list[str] | None, list[str]]:
        if rank not in self._outs_read:
            p = self.outs.get(rank)
            lines = tail_file(p, 1 << 30, max_bytes=OUT_TAIL_BYTES) if p is not None else []
            self._outs_read[rank] = (traceback_in_lines(lines), lines[-OUT_TAIL_LINES:])
        return self._outs_read[rank]

    def task_reports(self) -> dict[int, TaskReport]:
        """How srun (``slurm-*.out``), else the local driver (``local-driver.out``), said each
        task ended."""
        if self.log_dir is None or not self.log_dir.is_dir():
            return {}
        found = task_reports(sorted(self.log_dir.glob(BATCH_OUT_GLOB)))
        if not found and (m := re.fullmatch(r"task(\d+)", self.log_dir.name)):  # a local array's task
            found = local_reports(self.log_dir.parent / LOCAL_DRIVER_OUT, int(m.group(1)))
        return found or local_reports(self.log_dir / LOCAL_DRIVER_OUT)

    def node_failures(self) -> tuple[bool, list[str]]:
        """(Slurm reported a node failure in the batch output, the nodes it named)."""
        if self.log_dir is None or not self.log_dir.is_dir():
            return False, []
        return node_failures(sorted(self.log_dir.glob(BATCH_OUT_GLOB)))

    def srun_exit_codes(self) -> dict[int, int]:
        """Per-task exit codes that srun reported in the batch output (``slurm-*.out``)."""
        if self.log_dir is None or not self.log_dir.is_dir():
            return {}
        return srun_exit_codes(sorted(self.log_dir.glob(BATCH_OUT_GLOB)))


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def _over_budget(paths: list[Path]) -> bool:
    """True when the event files together are larger than FULL_READ_BYTES."""
    total = 0
    for p in paths:
        total += _size(p)
        if total > FULL_READ_BYTES:
            return True
    return False


def _int(v, default):
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def _float(v, default):
    try:
        return float(v)
    except (TypeError, ValueError):
        return default
