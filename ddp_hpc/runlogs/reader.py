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

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ddp_hpc.runlogs.attribution import Failure, SchedulerFacts, attribute, first_failure
from ddp_hpc.runlogs.schema import BATCH_OUT_GLOB, EVENTS_RE, LOG_RE, OUT_RE
from ddp_hpc.runlogs.srun import (LOCAL_DRIVER_OUT, TaskReport, exception_of, local_reports,
                                  node_failures, srun_exit_codes, tail_file, tail_lines,
                                  task_reports, traceback_in, traceback_in_lines)

__all__ = ["RunLogs", "RankStream", "Failure", "Progress", "RunSummary", "read_events",
           "traceback_in", "exception_of", "tail_file", "tail_lines"]

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

    @property
    def last(self) -> dict | None:
        return self.events[-1] if self.events else None

    def of_restart(self, restart: int) -> list[dict]:
        return [e for e in self.events if _int(e.get("restart"), 0) == restart]


@dataclass
class Progress:
    """Where training stands, from the newest metrics events of the current run."""

    epoch: int | None = None
    step: int | None = None
    total_steps: int | None = None
    percent: float | None = None
    loss: float | None = None
    samples_per_s: float | None = None
    eta_s: float | None = None
    updated: float | None = None


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


def read_events(path: Path) -> RankStream:
    """Parse one ``rank{R}.events.jsonl``; malformed lines are skipped and counted."""
    m = EVENTS_RE.match(path.name)
    stream = RankStream(rank=int(m.group(1)) if m else -1, path=path)
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
        if self.log_dir is None or not self.log_dir.is_dir():
            return
        for p in sorted(self.log_dir.iterdir()):
            if m := EVENTS_RE.match(p.name):
                self.ranks[int(m.group(1))] = read_events(p)
            elif m := OUT_RE.match(p.name):
                self.outs[int(m.group(1))] = p
            elif m := LOG_RE.match(p.name):
                self.texts[int(m.group(1))] = p

    @property
    def exists(self) -> bool:
        return bool(self.ranks or self.outs or self.texts)

    def all_events(self) -> list[dict]:
        evs = [e for s in self.ranks.values() for e in s.events]
        return sorted(evs, key=lambda e: _float(e.get("time"), 0.0))

    def restarts(self) -> list[int]:
        """Every restart number seen in any event, ascending."""
        return sorted({_int(e.get("restart"), 0) for s in self.ranks.values() for e in s.events})

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
        starts = [e for s in sorted(self.ranks.values(), key=lambda s: s.rank)
                  for e in s.of_restart(self.current_restart())
                  if e.get("event") == "start" and e.get("device")]
        return str(starts[0]["device"]).split(":", 1)[0] if starts else None

    def runs(self) -> list[RunSummary]:
        """One summary per restart number: what each run of a requeued job did."""
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
        """Epoch/step/percent, last loss, samples/s and an ETA from the current run's metrics."""
        restart = self.current_restart()
        stream = self.ranks.get(0) or next(iter(self.ranks.values()), None)
        if stream is None:
            return None
        evs = stream.of_restart(restart) or stream.events
        kinds = ("step", "epoch", "end", "eval", "checkpoint")
        metrics = [e for e in evs if e.get("event") in kinds]
        if not metrics:  # a requeued run that has only started: show where the last one got to
            evs = stream.events
            metrics = [e for e in evs if e.get("event") in kinds]
        if not metrics:
            return None
        p = Progress(updated=_float(metrics[-1].get("time"), None))
        for e in metrics:
            if e.get("epoch") is not None:
                p.epoch = _int(e.get("epoch"), p.epoch)
            if e.get("step") is not None:  # steps only grow within a run: keep the largest
                p.step = max(_int(e.get("step"), 0), p.step or 0)
        # the newest step's loss and throughput (epoch events carry epoch means: a fallback)
        for kind in ("epoch", "step"):
            for e in (x for x in metrics if x.get("event") == kind):
                if e.get("loss") is not None:
                    p.loss = _float(e.get("loss"), p.loss)
                if e.get("samples_per_s") is not None:
                    p.samples_per_s = _float(e.get("samples_per_s"), p.samples_per_s)
        totals = [e.get("total_steps") for e in stream.events if e.get("total_steps") is not None]
        p.total_steps = _int(totals[-1], None) if totals else None
        if p.total_steps and p.step is not None:
            p.percent = min(100.0, 100.0 * p.step / p.total_steps)
        steps = [e for e in evs if e.get("event") == "step" and e.get("step") is not None]
        ended = any(e.get("event") == "end" for e in evs)
        if not ended and len(steps) >= 2 and p.total_steps and p.step is not None:
            s0, s1 = steps[0], steps[-1]
            dt = _float(s1.get("time"), 0.0) - _float(s0.get("time"), 0.0)
            ds = _int(s1.get("step"), 0) - _int(s0.get("step"), 0)
            if dt > 0 and ds > 0:
                p.eta_s = max(0.0, (p.total_steps - p.step) * dt / ds)
        elif ended and p.total_steps:
            p.eta_s = 0.0 if any(e.get("event") == "end" and e.get("status") == "completed"
                                 for e in evs) else None
        return p

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
