"""Goodput of a job: the share of its wall time since the first training step that went into
useful steps, and where the rest went, from the run logs alone.

Read from one rank's events (rank 0, else the lowest rank with step events: the training core and
``ddp_hpc.report`` write step events at nearly the same time on every rank, after a collective),
run by run (restart numbers), and the in-allocation restarts' records (``restarts.jsonl``):

- **wall**: from the first ``step`` event of the first run to the newest event of any rank;
- each interval between two consecutive step events of a run is ``n`` steps long; the median of
  all intervals' seconds per step (``step_s``) is what a step costs; of each interval:

  - **redone** (steps trained twice): the share of its steps at or below the highest step an
    earlier run reached (a restart resumes from the newest checkpoint and trains them again);
  - **checkpoint**: for an interval with ``checkpoint`` events, their ``blocking_s`` (the training
    thread's wait for the save) where every one has it, else the interval's time beyond
    ``n x step_s`` (an estimate: ``estimated`` names it). A checkpoint belongs to the interval in
    which training blocked for it, not the one in which its file completed (its event's
    ``time``): an async save's write runs on while training goes on, so the event comes steps
    later. ``time - write_s`` (the write's start) lies within the block for both kinds of save:
    an async save returns when its write starts, a blocking save's write is the end of its block.
    Plus the step event's ``snapshot_s`` where present (the training thread's seconds in memory
    snapshots since the previous step event);
  - **eval**: for an interval with ``eval`` events, its time beyond ``n x step_s`` (and beyond
    the checkpoint's);
  - **stalls**: an interval with no eval and no estimated checkpoint that took over `STALL_RATIO`
    x ``n x step_s`` (after a checkpoint's ``blocking_s``): its time beyond ``n x step_s``;
  - **data**: the step events' ``data_s`` (seconds per step waiting for data) x ``n``, at most
    what is left of the interval;
  - **useful**: the rest;
- **restarts**: from a run's last step event to the next run's first (a restart, or a requeue);
  by phase where the restart's record has ``phases`` (``ddp_hpc.judge.restarts``: detect, stop,
  start, import, rendezvous, restore, first_step), the whole gap otherwise;
- **after the last run's last step event**, each stretch up to the next event of that rank (other
  than ``stack``), and the last up to the end of the wall, by what ends it: an ``eval`` event or
  a ``progress`` event of phase ``eval`` (the training core writes them at least every 5 s of an
  evaluation) is **eval**, a ``checkpoint`` event or ``progress`` of phase ``checkpoint`` is
  **checkpoint**; else a stretch over ``STALL_FACTOR`` x the median seconds between step events
  (the rule by which status sees a rank stall, `ddp_hpc.judge.timing`, without its floor: this is
  accounting, not a verdict) is **stalls**, unless a completed ``end`` event ends it (a final
  save or evaluation the events do not name, and the teardown);
- **other**: the rest after the last step event (the teardown, a run still going within its usual
  pace), and intervals whose step number went back within a run.

Before the first step (start-up, data staging, compilation) is outside the wall; a later run's
start-up is part of its restart.

``goodput = useful / wall``; useful plus the parts add up to wall.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from ddp_hpc.judge.tails import RankStream
from ddp_hpc.judge.timing import STALL_FACTOR
from ddp_hpc.parsing import to_float, to_int

__all__ = ["Goodput", "goodput", "PARTS", "PART_NAMES", "STALL_RATIO"]

#: an interval with no checkpoint or eval that took this many times its steps' usual time is a stall
STALL_RATIO = 3.0
#: the parts of the wall time that were not useful steps, in the order they are shown
PARTS = ("restarts", "redone", "checkpoint", "data", "stalls", "eval", "other")
#: each part as the user reads it (the detail view and the HTML page alike: one place, one wording)
PART_NAMES = {"restarts": "restarts", "redone": "steps trained twice", "checkpoint": "checkpoints",
              "data": "data wait", "stalls": "stalls", "eval": "eval", "other": "other"}


@dataclass(frozen=True)
class Goodput:
    """``useful_s / wall_s`` and the seconds of each part of the rest (`PARTS`), the restarts'
    phases where recorded, how many steps were trained twice, the median seconds per step, and
    which parts are estimates. The fields are the keys of ``status --json``'s ``goodput``."""

    goodput: float                       # useful_s / wall_s
    wall_s: float                        # since the first step
    useful_s: float
    lost_s: dict[str, float]             # part (`PARTS`) -> seconds
    restart_phases: dict[str, float] = field(default_factory=dict)   # phase -> seconds, all restarts
    steps_redone: int = 0
    step_s: float | None = None          # the median seconds per step
    estimated: list[str] = field(default_factory=list)   # the parts that are estimates, in words

    def to_dict(self) -> dict:
        return {"goodput": round(self.goodput, 4), "wall_s": round(self.wall_s, 3),
                "useful_s": round(self.useful_s, 3), "lost_s": {k: round(v, 3) for k, v in self.lost_s.items()},
                "restart_phases": {k: round(v, 3) for k, v in self.restart_phases.items()},
                "steps_redone": self.steps_redone, "step_s": None if self.step_s is None else round(self.step_s, 6),
                "estimated": list(self.estimated)}

    @classmethod
    def from_dict(cls, d: dict) -> "Goodput":
        return cls(**d)

    def rounded(self) -> "Goodput":
        """This goodput as ``status --json`` shows it (rounded): what a status holds, so it
        is the same after a JSON round trip."""
        return Goodput.from_dict(self.to_dict())


@dataclass
class _Tally:
    """`Goodput`'s fields while `goodput` adds the intervals up."""

    goodput: float
    wall_s: float
    useful_s: float
    lost_s: dict[str, float]
    restart_phases: dict[str, float] = field(default_factory=dict)
    steps_redone: int = 0
    step_s: float | None = None
    estimated: list[str] = field(default_factory=list)


def _reference(ranks: dict[int, RankStream]) -> RankStream | None:
    """Rank 0's stream when it has step events, else the lowest rank's that has."""
    for r in sorted(ranks):
        if any(e.get("event") == "step" for e in ranks[r].events):
            return ranks[r]
    return None


def _runs(stream: RankStream) -> list[tuple[int, list[tuple[float, int, dict]], list[dict]]]:
    """(restart number, its step events as (time, step, event) in time order, its other events)
    for each run with step events, in order of their first step."""
    out = []
    for restart in stream.restart_numbers():
        steps, other = [], []
        for e in stream.of_restart(restart):
            t = to_float(e.get("time"))
            if t is None:
                continue
            step = to_int(e.get("step"), None) if e.get("event") == "step" else None
            (steps.append((t, step, e)) if step is not None else other.append(e))
        if steps:
            out.append((restart, sorted(steps, key=lambda s: s[0]), other))
    return sorted(out, key=lambda r: r[1][0][0])


def _step_s(runs) -> float | None:
    """The median seconds per step over every interval of every run."""
    per = [(b[0] - a[0]) / (b[1] - a[1]) for _, steps, _ in runs for a, b in zip(steps, steps[1:])
           if b[1] > a[1] and b[0] > a[0]]
    return statistics.median(per) if per else None


def _blocked_at(e: dict) -> float:
    """When training was blocked by the save of checkpoint event ``e`` (the module's rules)."""
    t = to_float(e.get("time")) or 0.0
    write = to_float(e.get("write_s"))
    return t - write if write is not None and write > 0 else t


def goodput(ranks: dict[int, RankStream], restarts: list[dict] = (), end: float | None = None) -> Goodput | None:
    """The goodput of the run logs' ``ranks`` (`RunLogs.ranks`), with the in-allocation restart
    records ``restarts`` (their ``phases``, when present); the wall ends at ``end`` or the newest
    event of any rank. None before a rank reported a step."""
    ref = _reference(ranks)
    runs = _runs(ref) if ref is not None else []
    if not runs:
        return None
    newest = max((to_float(e.get("time")) or 0.0 for s in ranks.values() for e in s.events), default=0.0)
    t0, t_end = runs[0][1][0][0], max(end or 0.0, newest)
    g = _Tally(0.0, max(t_end - t0, 0.0), 0.0, dict.fromkeys(PARTS, 0.0), step_s=_step_s(runs))
    phases = {to_int(r.get("restart"), -1): r.get("phases") for r in restarts}
    done, last_t, other = None, None, []
    for restart, steps, other in runs:
        if last_t is not None:
            _restart_gap(g, steps[0][0] - last_t, phases.get(restart))
        for a, b in zip(steps, steps[1:]):
            _interval(g, a, b, other, done)
        top = max(s[1] for s in steps)
        done, last_t = top if done is None else max(done, top), steps[-1][0]
    gaps = [b[0] - a[0] for _, steps, _ in runs for a, b in zip(steps, steps[1:]) if b[0] > a[0]]
    _tail(g, last_t, t_end, other, STALL_FACTOR * statistics.median(gaps) if gaps else None)
    g.goodput = g.useful_s / g.wall_s if g.wall_s > 0 else 1.0
    return Goodput(**vars(g))


def _tail(g: _Tally, last_t: float, t_end: float, other: list[dict], limit: float | None) -> None:
    """Share the time after the last step event out by the events that end its stretches (the
    module's rules); ``limit``: the seconds of silence that are a stall (None: no step interval)."""
    after = sorted(((t, e) for e in other if e.get("event") != "stack" and not _step_note(e)
                    and (t := to_float(e.get("time"))) is not None and last_t < t <= t_end),
                   key=lambda te: te[0])
    t0 = last_t
    for t, e in [*after, (t_end, {})]:
        name, phase = e.get("event"), e.get("phase") if e.get("event") == "progress" else None
        if name == "eval" or phase == "eval":
            part = "eval"
        elif name == "checkpoint" or phase == "checkpoint":
            part = "checkpoint"
        elif limit is not None and t - t0 > limit and not (name == "end" and e.get("status") == "completed"):
            part = "stalls"
        else:
            part = "other"
        g.lost_s[part] += max(t - t0, 0.0)
        t0 = max(t0, t)


def _step_note(e: dict) -> bool:
    """A held-back step's number (``progress`` of phase ``step``, `ddp_hpc.progress`): no stretch
    of its own, as a stack event is none."""
    return e.get("event") == "progress" and e.get("phase") == "step"


def _restart_gap(g: _Tally, gap: float, phases) -> None:
    g.lost_s["restarts"] += max(gap, 0.0)
    if isinstance(phases, dict):
        for name, secs in phases.items():
            if (s := to_float(secs)) is not None:
                g.restart_phases[name] = g.restart_phases.get(name, 0.0) + s
    elif "restarts (no phases recorded)" not in g.estimated:
        g.estimated.append("restarts (no phases recorded)")


def _interval(g: _Tally, a: tuple, b: tuple, other: list[dict], done: int | None) -> None:
    """Share the interval from step event ``a`` to ``b`` out among the parts (the module's rules)."""
    dt, n = b[0] - a[0], b[1] - a[1]
    if dt <= 0:
        return
    if n <= 0:   # the step count went back within a run: not a training interval
        g.lost_s["other"] += dt
        return
    redo_n = min(max((done if done is not None else a[1]) - a[1], 0), n)
    redo = dt * redo_n / n
    g.lost_s["redone"] += redo
    g.steps_redone += redo_n
    rest, n_new = dt - redo, n - redo_n
    usual = n_new * g.step_s if g.step_s is not None else rest
    inside = [e for e in other if a[0] < (to_float(e.get("time")) or 0.0) <= b[0]]
    ckpts = [e for e in other if e.get("event") == "checkpoint" and a[0] < _blocked_at(e) <= b[0]]
    ck, estimated = 0.0, False
    if ckpts:
        blocking = [to_float(e.get("blocking_s")) for e in ckpts]
        if all(x is not None for x in blocking):
            ck = min(sum(blocking), rest)
        else:
            estimated = True
            ck = max(rest - usual, 0.0)
            if "checkpoint (the time around the saves)" not in g.estimated:
                g.estimated.append("checkpoint (the time around the saves)")
    snap = to_float(b[2].get("snapshot_s"))
    if snap is not None and snap > 0 and not estimated:   # an estimate already holds the time beyond usual
        ck += min(snap, rest - ck)
    g.lost_s["checkpoint"] += ck
    rest -= ck
    beyond = max(rest - usual, 0.0)
    if any(e.get("event") == "eval" for e in inside):
        g.lost_s["eval"] += beyond
        rest -= beyond
    elif not estimated and rest > STALL_RATIO * usual:
        g.lost_s["stalls"] += beyond
        rest -= beyond
    data = to_float(b[2].get("data_s"))
    wait = min(max(data * n_new, 0.0), rest) if data is not None else 0.0
    g.lost_s["data"] += wait
    g.useful_s += rest - wait
