"""Read a run's log directory: per-rank event streams, the first failing rank, progress, requeues.

The training core writes, per node K, ``node{K}.events.jsonl`` (one JSON object per line, each
with its rank, see docs/architecture.md; earlier versions one ``rank{R}.events.jsonl`` per rank,
read too: ``judge.nodefiles``) and per rank R ``rank{R}.log``; Slurm adds ``rank{R}.out`` (srun ``--output=rank%t.out``)
and ``slurm-<id>.out``. This module turns those files into the facts the status command shows and
never raises on a damaged file: a half-written last line (the writer may be mid-flush) or a stray
non-JSON line is skipped and counted.

Why so much care about *which* rank failed first: when one rank raises, srun's kill-on-bad-exit and
collective timeouts make every other rank die too, often with errors of their own ("connection
reset by peer"), and a rank that was killed or hangs writes nothing at all. Who is to blame is
decided by evidence in ``ddp_hpc.judge.attribution``; this module reads the files it weighs.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import functools
import os
import re
from pathlib import Path

from ddp_hpc.fsutil import file_size
from ddp_hpc.judge.attribution import Failure, SchedulerFacts, attribute
from ddp_hpc.judge.newest import read_newest_run
from ddp_hpc.judge.nodefiles import NODE_RANKS, ending, merge_streams, rank_events, read_node_events
from ddp_hpc.judge.srun import (
    TaskReport,
    exception_of,
    local_reports,
    node_failures,
    srun_exit_codes,
    tail_file,
    tail_lines,
    task_reports,
    traceback_in,
    traceback_in_lines,
)
from ddp_hpc.judge.tails import FULL_READ_BYTES, TAIL_LINES, RankStream, over_budget, read_events, tail_budget
from ddp_hpc.judge.timing import RunProgress, progress
from ddp_hpc.parsing import to_float, to_int
from ddp_hpc.runlogs.schema import (
    EVENTS_RE,
    LOCAL_DRIVER_OUT,
    LOG_RE,
    NODE_EVENTS_RE,
    OUT_RE,
    RUN_MARK_RE,
    TBOARD_GLOB,
    batch_outputs,
)

__all__ = ["RunLogs", "RankStream", "Failure", "RunProgress", "RunSummary", "RunEnding", "read_events",
           "run_ending", "traceback_in", "exception_of", "tail_file", "tail_lines"]

#: how much of the end of a ``rank{R}.out`` is read for its last traceback, and how many of its
#: last lines are searched for a peer's failure (NCCL's watchdog) and the rank's own error line
OUT_TAIL_BYTES = 1 << 16
OUT_TAIL_LINES = 200


@dataclasses.dataclass
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


@dataclasses.dataclass(frozen=True)
class RunEnding:
    """How the newest run in a log directory ended, as rank 0's events tell it: ``status`` of
    its last ``end`` event (None when no end follows its last ``start``: still running, or
    killed), the last step it reported, and the newest checkpoint it wrote that still exists."""

    status: str | None
    step: int | None
    checkpoint: str | None
    checkpoint_step: int | None


def run_ending(log_dir: str | Path) -> RunEnding:
    """Rank 0's account of the newest run in ``log_dir`` (every field None without events)."""
    status = step = None
    saved: list[tuple[int | None, str]] = []
    for e in rank_events(log_dir, 0).events:
        kind = e.get("event")
        if kind == "start":
            status = None
        elif kind == "end":
            status = str(e.get("status"))
        elif kind == "checkpoint" and e.get("path"):
            saved.append((to_int(e.get("step"), None), str(e["path"])))
        if kind in ("step", "end", "preempt"):
            step = to_int(e.get("step"), step)
        elif kind == "checkpoint":   # written when its file is complete: steps may have passed since
            saved_step = to_int(e.get("step"), None)
            step = saved_step if step is None or (saved_step is not None and saved_step > step) else step
    found = next(((s, p) for s, p in reversed(saved) if Path(p).is_file()), (None, None))
    return RunEnding(status, step, found[1], found[0])


class RunLogs:
    """All the rank files of one log directory, read once; methods derive the facts; no directory
    (or None: not known) reads as one without files. ``ends_only``: of the other ranks' event files
    only how their current run ended (their last events back to the newest step: `tails.END_LINES`),
    of rank 0's its newest run whole and the earlier start and eval events (`judge.newest`): what
    a job table shows; `widen` reads them as a detail view does beyond the read budget, and so does
    ``window`` from the start (a running job's row: its stall). ``rank0_only`` (with ``ends_only``;
    a job that completed): of the event files rank 0's alone, where there is one."""

    def __init__(self, log_dir: str | Path | None, ends_only=False, window=False, rank0_only=False):
        self.log_dir, self.ends_only, self.rank0_only = Path(log_dir) if log_dir else None, ends_only, False
        self.ranks: dict[int, RankStream] = {}
        self.tail = TAIL_LINES  # the lines of a rank's tail a windowed read takes (fewer beyond 1,024 ranks)
        self._names: dict[str, dict[int, str]] = {"out": {}, "log": {}}  # rank -> file name
        self._outs_read: dict[int, tuple[list[str] | None, list[str]]] = {}
        self._memo, self.listed = {}, False  # see _cached; listed: the directory was there to list
        self.tensorboard = False  # TensorBoard's event files are in the directory
        try:  # names, not Paths: a Path per file was a tenth of the job table's first view
            names = sorted(os.listdir(self.log_dir)) if self.log_dir is not None else []
        except OSError:  # no such directory (yet), or not one
            return
        self.listed = self.log_dir is not None
        self.tensorboard = any(fnmatch.fnmatchcase(name, TBOARD_GLOB) for name in names)
        events, self._nodes = [], []
        for name in names:
            if m := EVENTS_RE.match(name):
                events.append((int(m.group(1)), self.log_dir / name))
            elif m := NODE_EVENTS_RE.match(name):
                self._nodes.append((int(m.group(1)), self.log_dir / name))
            elif m := OUT_RE.match(name):
                self._names["out"][int(m.group(1))] = name
            elif m := LOG_RE.match(name):
                self._names["log"][int(m.group(1))] = name
        if rank0_only and ends_only and (any(r == 0 for r, _ in events) or any(n == 0 for n, _ in self._nodes)):
            events, self.rank0_only = [(r, p) for r, p in events if r == 0], True
            self._nodes = [(n, p) for n, p in self._nodes if n == 0]
        window = ends_only or window or over_budget([p for _, p in events + self._nodes])
        self.tail = tail_budget(len(events) + NODE_RANKS * len(self._nodes))
        for rank, p in events:
            big = rank != 0 or file_size(p) > FULL_READ_BYTES
            self.ranks[rank] = read_newest_run(p) if ends_only and not big else read_events(
                p, window and big, ends=ends_only and rank != 0, tail=self.tail)
        self._read_nodes(window, ends_only)
        if (s := self.ranks.get(0)) and s.newest_only and max(self.restarts()) > max(s.restart_numbers()):
            self.ranks[0] = read_events(s.path)  # another rank ran a newer run than rank 0's newest
            self._memo.clear()

    def _read_nodes(self, window: bool, ends_only: bool) -> None:
        """The node files' streams (the per-node layout): node 0's whole (it holds rank 0; of its
        other ranks only their endings with ``ends_only``; beyond the read budget rank 0's whole
        and the others' windows), the others' as the budget allows."""
        for node, p in self._nodes:
            big = node != 0 or file_size(p) > FULL_READ_BYTES
            if node == 0 and big and not ends_only:
                got = read_node_events(p, window, whole_rank=0 if window else None, tail=self.tail)
            else:
                got = read_node_events(p, window and big, ends=ends_only and big, tail=self.tail)
            if ends_only and not big:
                for r, s in got.items():
                    if r != 0:
                        s.events = ending(s.events)
            if self.rank0_only:
                got = {r: s for r, s in got.items() if r == 0}
            merge_streams(self.ranks, got)

    @functools.cached_property
    def outs(self) -> dict[int, Path]:
        """rank -> its ``rank{R}.out``."""
        return {r: self.log_dir / name for r, name in self._names["out"].items()}

    @functools.cached_property
    def texts(self) -> dict[int, Path]:
        """rank -> its ``rank{R}.log``."""
        return {r: self.log_dir / name for r, name in self._names["log"].items()}

    def widen(self) -> None:
        """Read the event files that ``ends_only`` read in part as the read budget allows: a running
        job's stall is judged from the intervals between every rank's recent step events."""
        if not self.ends_only:
            return
        self.ends_only = False
        for rank, stream in self.ranks.items():
            if EVENTS_RE.match(stream.path.name) and (rank != 0 or stream.newest_only):
                self.ranks[rank] = read_events(stream.path, rank != 0, tail=self.tail)
        widened: dict[int, RankStream] = {}
        for node, p in self._nodes:
            big = file_size(p) > FULL_READ_BYTES
            merge_streams(widened, read_node_events(p, node != 0 or big, whole_rank=0 if node == 0 and big else None,
                                                    tail=self.tail))
        self.ranks.update(widened)
        self._memo.clear()

    @property
    def partial(self) -> list[int]:
        """The ranks whose event files were read only in part (the read budget)."""
        return [r for r, s in sorted(self.ranks.items()) if s.skipped]

    @property
    def exists(self) -> bool:
        return bool(self.ranks or self._names["out"] or self._names["log"])

    def all_events(self) -> list[dict]:
        evs = [e for s in self.ranks.values() for e in s.events]
        return sorted(evs, key=lambda e: to_float(e.get("time"), 0.0))

    def _cached(self, name: str, compute):
        """``compute()``, kept until the streams are read again (status asks the same of
        thousands of ranks' events several times; the streams change only where this class
        reads them, which clears what it kept: a check of every stream per question was a
        twentieth of the detail view of 8,192 ranks)."""
        if name not in self._memo:
            self._memo[name] = compute()
        return self._memo[name]

    def restarts(self) -> list[int]:
        """Every restart number seen in any event, ascending."""
        return list(self._cached("restarts", lambda: sorted(
            set().union(*(s.restart_numbers() for s in self.ranks.values())))))

    def current_restart(self) -> int:
        r = self.restarts()
        return r[-1] if r else 0

    def last_events(self) -> dict[int, dict]:
        return {r: s.last for r, s in sorted(self.ranks.items()) if s.last is not None}

    def world_size(self) -> int | None:
        for s in self.ranks.values():
            for e in s.events:
                if e.get("event") == "start" and e.get("world_size") is not None:
                    return to_int(e.get("world_size"), None)
        return None

    def device(self) -> str | None:
        """The device type the newest run trained on ("cpu", "cuda", ...) as its ``start`` events
        tell it (rank 0's first); None when no start event names one."""
        restart = self.current_restart()  # once: inside the loop it was once per rank
        for s in sorted(self.ranks.values(), key=lambda s: s.rank):
            for e in s._runs().get(restart, ()):
                if e.get("event") == "start" and e.get("device"):
                    return str(e["device"]).split(":", 1)[0]
        return None

    def runs(self) -> list[RunSummary]:
        """One summary per restart number: what each run of a requeued job did (computed once
        while the streams do not change; each call returns copies)."""
        return [dataclasses.replace(r) for r in self._cached("runs", lambda: self._summaries(self.restarts()))]

    def current_run(self) -> RunSummary | None:
        """The newest run's summary, ``runs()[-1]`` without summing up the earlier runs (a copy);
        None without events."""
        if (runs := self._memo.get("runs")) is not None:
            return dataclasses.replace(runs[-1]) if runs else None
        if len(self.restarts()) == 1:   # one run: its summary is all of runs(), kept for it too
            return self.runs()[-1]
        cur = self._cached("current_run", lambda: self._summaries(self.restarts()[-1:]))
        return dataclasses.replace(cur[0]) if cur else None

    def _summaries(self, restarts: list[int]) -> list[RunSummary]:
        return [_summary(restart, (e for s in self.ranks.values() for e in s._runs().get(restart, ())))
                for restart in restarts]

    def outcome(self) -> str | None:
        """The current run's ending as the events tell it: completed/failed/preempted, else None.

        "completed" only when every rank that started wrote ``end`` completed; any ``error`` or a
        failed ``end`` makes it "failed".
        """
        cur = self.current_run()
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

    def progress(self, now: float | None = None) -> RunProgress | None:
        """Epoch/step/percent, last loss, samples/s and an ETA from rank 0's (else the first
        rank's) metrics events of the current run (`timing.progress`)."""
        restart = self.current_restart()
        stream = self.ranks.get(0) or next(iter(self.ranks.values()), None)
        got = self._cached("progress", lambda: progress(stream.of_restart(restart), stream.events)
                           if stream is not None else None)
        return dataclasses.replace(got) if got is not None else None  # a copy: the caller may change it

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
        timestamp (``ddp_hpc.judge.attribution``): a raised error, a killed rank, a lost node, a
        rank stuck while the others timed out; else, when the job failed (``assume_failed``:
        the scheduler says so) or some ranks ended while others did not, the rank whose events
        stopped first. ``evidence_only`` (the job still runs, or was stopped from outside) counts
        only what ranks wrote themselves: srun reports the ranks a cancel stopped as well."""
        return attribute(self, sched=sched, assume_failed=assume_failed, evidence_only=evidence_only)[0]

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
            marks = [i for i, ln in enumerate(lines) if RUN_MARK_RE.match(ln)]
            lines = lines[marks[-1] + 1:] if marks else lines   # the newest run's output alone
            self._outs_read[rank] = (traceback_in_lines(lines), lines[-OUT_TAIL_LINES:])
        return self._outs_read[rank]

    def task_reports(self) -> dict[int, TaskReport]:
        """How srun (``slurm-*.out``), else the local driver (``local-driver.out``), said each
        task ended."""
        if not self.listed:
            return {}
        found = task_reports(self._batch_outs())
        if not found and (m := re.fullmatch(r"task(\d+)", self.log_dir.name)):  # a local array's task
            found = local_reports(self.log_dir.parent / LOCAL_DRIVER_OUT, int(m.group(1)))
        return found or local_reports(self.log_dir / LOCAL_DRIVER_OUT)

    def node_failures(self) -> tuple[bool, list[str]]:
        """(Slurm reported a node failure in the batch output, the nodes it named)."""
        return node_failures(self._batch_outs()) if self.listed else (False, [])

    def srun_exit_codes(self) -> dict[int, int]:
        """Per-task exit codes that srun reported in the batch output (``slurm-*.out``)."""
        return srun_exit_codes(self._batch_outs()) if self.listed else {}

    def _batch_outs(self) -> list[Path]:
        """The batch output files (``slurm-*.out``) there now (Slurm appends it as the job goes)."""
        return batch_outputs(self.log_dir)


def _summary(restart: int, events) -> RunSummary:
    """One run's summary in one pass over its events (every rank's, in file order). The first
    and last events are those a stable sort by time would put first and last."""
    first = last = pre = None
    first_t = last_t = pre_t = 0.0
    statuses: set[str] = set()
    ranks: set[int] = set()
    last_step, requeued, errors, ended = None, False, 0, False
    for e in events:  # the writer's floats and ints skip the conversions (the job table's first view)
        t = e.get("time")
        if type(t) is not float:
            t = to_float(t, 0.0)
        if first is None or t < first_t:
            first, first_t = e, t
        if last is None or t >= last_t:
            last, last_t = e, t
        name = e.get("event")
        if name == "end":
            ended = True
            statuses.add(str(e.get("status")))
        elif name == "preempt" and (pre is None or t < pre_t):
            pre, pre_t = e, t
        requeued = requeued or name == "requeue"
        errors += name == "error"
        step = e.get("step")
        if step is not None and (type(step) is int or (step := to_int(step, None)) is not None):
            last_step = step if last_step is None or step > last_step else last_step
        rank = e.get("rank")
        ranks.add(rank if type(rank) is int else to_int(rank, -1))
    end_status = None
    if ended:
        end_status = next((s for s in ("failed", "preempted", "completed") if s in statuses), sorted(statuses)[0])
    return RunSummary(restart=restart, started=to_float(first.get("time"), None) if first else None,
                      last_time=to_float(last.get("time"), None) if last else None, ranks=sorted(ranks),
                      last_step=last_step, end_status=end_status,
                      preempt_reason=pre.get("reason") if pre else None, requeued=requeued, errors=errors)
