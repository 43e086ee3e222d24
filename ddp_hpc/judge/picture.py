"""The run in time, from its events: what the detail view draws as sparklines and ``ddp-hpc status
JOB --html`` as a page (docs/status.md, "A picture of the run").

`build` gives a `Picture` (its ``to_dict`` JSON-ready, bounded in size however long the run or big
the job):

- ``t0``, ``t1``: the first and last event time of any run;
- ``series``: rank 0's (else the lowest rank's) ``step`` events of every run as ``[time,
  samples_per_s, loss, restart]``, at most `SERIES_POINTS` of them (evenly picked);
- ``marks``: what happened when, in time order: ``restart`` (a run after the first: its start;
  an in-allocation restart's ``why``, ``fault_at`` and ``phases`` when the supervisor's record has
  them), ``stall`` (rank 0's steps stopped for more than the stall threshold of
  `ddp_hpc.judge.timing`, or a rank's hang watchdog wrote a ``collective timeout`` stack),
  ``checkpoint`` (with ``blocking_s`` / ``write_s`` when the event has them), ``preempt``,
  ``stage`` and ``error`` (each with its rank);
- ``lanes`` (asked for by the page only): one lane per rank, or beyond `RANK_LANES` ranks one per
  node, or beyond `MAX_LANES` nodes one per block of nodes; each lane's time cut in `BINS` cells
  and the cells run-length coded as ``[first cell, cells, state]`` (a state of `STATES`: the
  worst of the lane's ranks in that cell), with the lane's errors, failed endings and
  checkpoints as points.

A rank whose events file was read in part (`ddp_hpc.judge.tails`: a big job) is drawn from what
was read, and its gaps are not taken for stalls (its middle was not read, not silent).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from ddp_hpc.judge.consequences import compress
from ddp_hpc.judge.reader import RankStream, RunLogs
from ddp_hpc.judge.timing import STALL_FACTOR, STALL_MIN_S
from ddp_hpc.parsing import to_float, to_int

__all__ = ["build", "Picture", "STATES", "BINS", "RANK_LANES", "MAX_LANES", "SERIES_POINTS"]

SERIES_POINTS = 400
BINS = 240
#: up to this many ranks a lane per rank; beyond, a lane per node (up to MAX_LANES, then blocks)
RANK_LANES = 64
MAX_LANES = 256
#: points (errors, failed endings, checkpoints) drawn per lane at most
MAX_POINTS = 64
#: a cell counts as waiting for data when the steps in it waited at least this share of their time
DATA_WAIT_SHARE = 0.3
#: the cells' states, lowest first: a lane's cell shows the highest of its ranks'
STATES = ("idle", "run", "step", "data", "stall", "stage")
_RUN, _STEP, _DATA, _STALL, _STAGE = range(1, 6)


@dataclass(frozen=True)
class Picture:
    """The run in time (see the module docstring); the fields are the keys of ``status
    --json``'s ``picture``, the lanes' only where they were asked for."""

    t0: float                 # the first event time of any run
    t1: float                 # the last
    series: list[list]        # [time, samples_per_s, loss, restart] of rank 0's step events
    marks: list[dict]         # what happened when (kind, time, restart, ...), in time order
    lanes: list[dict] | None = None   # each lane's label, ranks, hosts, cells, points, partial
    lane_kind: str | None = None      # what a lane is: rank, node or nodes
    bins: int | None = None           # the cells of a lane

    def to_dict(self) -> dict:
        out = dict(vars(self))
        if self.lanes is None:
            for k in ("lanes", "lane_kind", "bins"):
                del out[k]
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "Picture":
        return cls(**d)


def build(logs: RunLogs, restarts: list[dict], lanes: bool = False) -> Picture | None:
    """The picture of the run in ``logs`` (None without a timed event); ``restarts``: the
    in-allocation restarts' records (`ddp_hpc.judge.restarts.alloc_restarts`)."""
    runs = [r for r in logs.runs() if r.started is not None]
    if not runs:
        return None
    t0 = min(r.started for r in runs)
    t1 = max(r.last_time or r.started for r in runs)
    steps = _rank0_steps(logs)
    return Picture(t0=t0, t1=t1, series=_pick(steps, SERIES_POINTS),
                   marks=sorted(_restart_marks(runs, restarts) + _stall_marks(logs, steps) + _event_marks(logs),
                                key=lambda m: m["time"]),
                   **(_lanes(logs, t0, max(t1 - t0, 1e-9)) if lanes else {}))


def _rank0_steps(logs: RunLogs) -> list[list]:
    stream = logs.ranks.get(0) or (logs.ranks[min(logs.ranks)] if logs.ranks else None)
    if stream is None:
        return []
    out = []
    for e in stream.events:
        if e.get("event") == "step" and (t := to_float(e.get("time"))) is not None:
            out.append([t, to_float(e.get("samples_per_s")), to_float(e.get("loss")), to_int(e.get("restart"), 0)])
    return sorted(out, key=lambda p: p[0])


def _pick(points: list, n: int) -> list:
    """At most ``n`` of ``points``, evenly spread, the first and last kept."""
    if len(points) <= n:
        return points
    return [points[i * (len(points) - 1) // (n - 1)] for i in range(n)]


def _restart_marks(runs, restarts: list[dict]) -> list[dict]:
    inside = {to_int(r.get("restart"), None): r for r in restarts if r.get("restart") is not None}
    out = []
    for run in runs[1:]:
        m = {"kind": "restart", "time": run.started, "restart": run.restart, "inside": run.restart in inside}
        if (row := inside.get(run.restart)) is not None:
            m.update({k: row[k] for k in ("why", "rank", "node", "fault_at", "phases", "lost_s")
                      if row.get(k) is not None})
        out.append(m)
    return out


def _threshold(times: list[float]) -> float | None:
    """The stall threshold of a run's step times (`ddp_hpc.judge.timing`); None under two steps."""
    gaps = [b - a for a, b in zip(times, times[1:]) if b > a]
    return max(STALL_FACTOR * statistics.median(gaps), STALL_MIN_S) if gaps else None


def _stall_marks(logs: RunLogs, steps: list[list]) -> list[dict]:
    """Gaps in rank 0's steps longer than the stall threshold, and each run's first collective
    timeout stack (the hang watchdog's)."""
    out = []
    for restart in sorted({p[3] for p in steps}):
        times = [p[0] for p in steps if p[3] == restart]
        limit = _threshold(times)
        out += [{"kind": "stall", "time": a, "end": b, "restart": restart, "rank": 0}
                for a, b in zip(times, times[1:]) if limit is not None and b - a > limit]
    hangs: dict[int, dict] = {}
    for rank, stream in logs.ranks.items():
        for e in stream.events:
            if e.get("event") == "stack" and str(e.get("reason") or "").startswith("collective timeout"):
                t, restart = to_float(e.get("time")), to_int(e.get("restart"), 0)
                if t is not None and (restart not in hangs or t < hangs[restart]["time"]):
                    hangs[restart] = {"kind": "stall", "time": t, "restart": restart, "rank": rank,
                                      "why": str(e.get("reason"))}
    return out + list(hangs.values())


_POINT_KEYS = {"checkpoint": ("step", "path", "blocking_s", "write_s"), "preempt": ("reason", "step"),
               "stage": ("node", "method", "seconds", "src"), "error": ("exc_type", "message")}


def _event_marks(logs: RunLogs) -> list[dict]:
    """Checkpoints (once per run and step), preemptions and stagings (once per run and node), errors."""
    out, seen = [], set()
    for rank, stream in sorted(logs.ranks.items()):
        for e in stream.events:
            kind = e.get("event")
            if kind not in _POINT_KEYS or (t := to_float(e.get("time"))) is None:
                continue
            restart = to_int(e.get("restart"), 0)
            key = (kind, restart, e.get("step") if kind != "stage" else e.get("node"),
                   rank if kind == "error" else None)
            if kind != "error" and key in seen:
                continue
            seen.add(key)
            out.append({"kind": kind, "time": t, "restart": restart, "rank": rank,
                        **{k: e[k] for k in _POINT_KEYS[kind] if e.get(k) is not None}})
    return out


def _lanes(logs: RunLogs, t0: float, span: float) -> dict:
    """The lanes (see the module docstring) and what a lane is: ``rank``, ``node`` or ``nodes``."""
    hosts = {r: next((str(e["host"]) for e in reversed(s.events) if e.get("host")), "-") for r, s in logs.ranks.items()}
    groups, kind = _lane_groups(sorted(logs.ranks), hosts)
    limits = {}
    for restart in logs.restarts():
        stream = logs.ranks.get(0) or logs.ranks[min(logs.ranks)]
        limits[restart] = _threshold([t for e in stream.of_restart(restart) if e.get("event") == "step"
                                      and (t := to_float(e.get("time"))) is not None])
    scale = BINS / span
    out = []
    for label, ranks in groups:
        cells, points = _lane_cells([logs.ranks[r] for r in ranks], t0, scale, limits)
        out.append({"label": label, "ranks": compress(ranks), "hosts": sorted({hosts[r] for r in ranks}),
                    "cells": _rle(cells), "points": points, "partial": any(logs.ranks[r].skipped for r in ranks)})
    return {"lanes": out, "lane_kind": kind, "bins": BINS}


def _lane_groups(ranks: list[int], hosts: dict[int, str]) -> tuple[list[tuple[str, list[int]]], str]:
    if len(ranks) <= RANK_LANES:
        return [(f"rank {r} ({hosts[r]})", [r]) for r in ranks], "rank"
    by_host: dict[str, list[int]] = {}
    for r in ranks:
        by_host.setdefault(hosts[r], []).append(r)
    nodes = sorted(by_host.items(), key=lambda kv: kv[1][0])
    if len(nodes) <= MAX_LANES:
        return [(h, rs) for h, rs in nodes], "node"
    k = -(-len(nodes) // MAX_LANES)
    blocks = [nodes[i:i + k] for i in range(0, len(nodes), k)]
    return [(f"{b[0][0]}..{b[-1][0]}" if len(b) > 1 else b[0][0], [r for _, rs in b for r in rs])
            for b in blocks], "nodes"


def _lane_cells(streams: list[RankStream], t0: float, scale: float, limits: dict) -> tuple[list[int], list[dict]]:
    """One lane's cells (the highest state of its ranks in each) and its points."""
    marks: set[tuple[int, int, int]] = set()   # (first cell, last cell, state): ranks of a node share most
    points: list[dict] = []

    def cell(t: float) -> int:
        return min(BINS - 1, max(0, int((t - t0) * scale)))
    for s in streams:
        for restart in s.restart_numbers():
            evs = [(t, e) for e in s.of_restart(restart) if (t := to_float(e.get("time"))) is not None]
            if not evs:
                continue
            marks.add((cell(evs[0][0]), cell(evs[-1][0]), _RUN))
            _rank_run(s, evs, limits.get(restart), cell, marks, points)
    cells = [0] * BINS
    for a, b, state in marks:
        for i in range(a, b + 1):
            if cells[i] < state:
                cells[i] = state
    return cells, _grouped(points, cell)


def _grouped(points: list[dict], cell) -> list[dict]:
    """The lane's points, one per kind, run and cell (the earliest, with every rank that has
    one there: the ranks of a node lane end together), at most `MAX_POINTS`."""
    groups: dict[tuple, dict] = {}
    for p in sorted(points, key=lambda p: p["time"]):
        key = (p["kind"], p["restart"], cell(p["time"]))
        if key in groups:
            groups[key]["ranks"].append(p["rank"])
        else:
            groups[key] = {**p, "ranks": [p["rank"]]}
    out = sorted(groups.values(), key=lambda p: p["time"])[:MAX_POINTS]
    for p in out:
        p["ranks"] = compress(sorted(set(p["ranks"])))
    return out


def _rank_run(s: RankStream, evs: list[tuple[float, dict]], limit: float | None, cell, marks: set,
              points: list[dict]) -> None:
    """One run of one rank into its lane: steps, data waits, stalls, staging, points."""
    prev = None   # (time, step) of the previous step event
    last_t = evs[0][0]
    for t, e in evs:
        kind = e.get("event")
        if limit is not None and not s.skipped and kind != "stack" and t - last_t > limit:
            marks.add((cell(last_t), cell(t), _STALL))
        if kind != "stack":
            last_t = t
        if kind == "step":
            step, data_s = to_int(e.get("step"), None), to_float(e.get("data_s"))
            state = _STEP
            if prev is not None and step is not None and data_s is not None and step > prev[1] and t > prev[0]:
                state = _DATA if data_s / ((t - prev[0]) / (step - prev[1])) >= DATA_WAIT_SHARE else _STEP
            marks.add((cell(t), cell(t), state))
            prev = (t, step) if step is not None else prev
        elif kind == "stage":
            marks.add((cell(t - (to_float(e.get("seconds")) or 0.0)), cell(t), _STAGE))
        elif kind in ("error", "checkpoint") or (kind == "end" and e.get("status") not in ("completed", "preempted")):
            points.append({"kind": kind, "time": t, "rank": s.rank, "restart": to_int(e.get("restart"), 0),
                           "text": _point_text(e)})


def _point_text(e: dict) -> str:
    kind = e.get("event")
    if kind == "error":
        return ": ".join(str(x) for x in (e.get("exc_type"), e.get("message")) if x)[:200]
    if kind == "checkpoint":
        return f"checkpoint at step {e.get('step')}"
    how = e.get("signal") or (f"exit {e['exit_code']}" if e.get("exit_code") is not None else "")
    return f"ended {e.get('status')}" + (f" ({how})" if how else "")


def _rle(cells: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for i, state in enumerate(cells):
        if out and out[-1][2] == state:
            out[-1][1] += 1
        else:
            out.append([i, 1, state])
    return [c for c in out if c[2]]
