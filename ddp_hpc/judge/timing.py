"""Time between step events: stalls while they happen, and ranks or nodes slower than the rest.

Both read the ``step`` events of the current run (``time``, ``step``, ``rank``, ``host``), so they
work for the training core and for scripts that call ``ddp_hpc.report`` alike (docs/status.md,
"Stalls" and "Stragglers").

- **Stall**: a rank of a running job is silent when its newest event (other than ``stack``) is
  older than ``max(STALL_FACTOR x the median interval between its step events, STALL_MIN_S)``.
  A rank with fewer than two step events is judged by the median of all ranks' intervals; before
  any rank has two step events nothing is judged (a first step may take long: compilation,
  data staging). While a rank that is not silent is busy in a save or an evaluation (its newest
  event a ``progress`` event of phase ``checkpoint`` or ``eval``: the training core writes one at
  least every 5 s of them, as ``ddp_hpc.checkpoint.save`` does for a script), the others are
  not silent: they wait for it in a collective (rank 0 saves, the others go on to the next
  step's all-reduce). A silent rank "wrote no stack while the others did" only once its silence is
  ``STACK_GRACE_S`` past the threshold: its watchdog dumps at the threshold, so a rank just past
  it may still be about to (its peers' thresholds can fall a second or two earlier).
- **Straggler**: a rank's step time is the median of (seconds / steps) between its consecutive
  step events; with at least ``STRAGGLER_MIN_INTERVALS`` of them, a rank whose step time is
  ``>= STRAGGLER_RATIO`` x the median of the other ranks' is named; a node (its step time: the
  median of its ranks') is named instead of its ranks when it is ``>= STRAGGLER_RATIO`` x the
  median of the other nodes and every rank on it is slow.

Note that a step event written after a collective (the training core reduces its metrics before
writing one) is written at nearly the same time on every rank: a rank that makes the others
wait then shows in their timing as much as in its own, and only step events that carry each
rank's own time tell it apart.
"""
from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass, field

from ddp_hpc.judge.consequences import ranks_text
from ddp_hpc.judge.stacks import collective, hang_line, stack_summary
from ddp_hpc.parsing import to_float, to_int

#: with data_s, a rank's extra wait must also be at least this share of the median step time
OWN_MIN_SHARE = 0.1
#: a rank is silent after max(STALL_FACTOR x its median step-event interval, STALL_MIN_S) seconds.
#: The floor is for fast steps (step events come at most once a second: 10 x 1 s), and 30 s is
#: above every ordinary pause this rule does not see otherwise: a first step is not judged (two
#: step events first), a save or evaluation of the training core (or ``ddp_hpc.checkpoint.save``)
#: writes progress events every 5 s and exempts the ranks waiting for it (`BUSY_PHASES`), a run
#: log's line is flushed as it is written and status opens each file anew (NFS close-to-open:
#: its attribute cache does not hide a grown file), a GC pause or a slow batch takes seconds.
#: What it does call stalled: a script's own evaluation or ``torch.save`` of over 30 s on one
#: rank, which writes nothing; 60 s was the floor, and a 0.16 s-step run silent for 50 s was
#: never called stalled. ``runlogs.watchdog`` dumps the stacks at the same threshold.
STALL_FACTOR = 10.0
STALL_MIN_S = 30.0
#: a rank whose newest event is a ``progress`` event of these phases is busy, and alive: the
#: ranks silent meanwhile wait for it
BUSY_PHASES = frozenset({"checkpoint", "eval"})
#: how long past its stall threshold a silent rank gets to write its stacks before it counts as
#: frozen (the watchdog looks once a second; a loaded node answers later)
STACK_GRACE_S = 8.0
#: a rank or node is slow at >= STRAGGLER_RATIO x the median of the others, over at least
#: STRAGGLER_MIN_INTERVALS step intervals
STRAGGLER_RATIO = 1.25
STRAGGLER_MIN_INTERVALS = 5


@dataclass
class RunProgress:
    """Where training stands, from the newest metrics events of the current run."""

    epoch: int | None = None
    step: int | None = None
    total_steps: int | None = None
    percent: float | None = None
    loss: float | None = None
    samples_per_s: float | None = None
    steps_per_s: float | None = None
    eta_s: float | None = None
    updated: float | None = None


@dataclass(frozen=True)
class Stall:
    """The silent ranks of a running job (`stall`); status adds what their stacks say. The
    fields are the keys of ``status --json``'s ``stall``."""

    ranks: list[int]                    # the silent ranks
    silent_for_s: float                 # since the newest event of a silent rank
    others_last_s: float | None         # since the newest event of the others (None: all silent)
    threshold_s: float                  # the silence that counts, the largest of the silent ranks'
    median_interval_s: float            # the median of the ranks' median step-event intervals
    behind: list[int]                   # silent ranks whose last step is behind the others' (stopped first)
    last_steps: dict[str, int | None]   # str(rank) -> the newest step any of its events reports
    stacks: dict[str, str] = field(default_factory=dict)   # str(rank) -> where its stack says it is
    no_stack: list[int] = field(default_factory=list)      # silent ranks that wrote none while others did
    hang: str | None = None             # the hang in one line (`hang`)

    def to_dict(self) -> dict:
        return dict(vars(self))

    @classmethod
    def from_dict(cls, d: dict) -> "Stall":
        return cls(**d)


@dataclass(frozen=True)
class Stragglers:
    """Per-rank and per-node step times and the slow ones (`stragglers`); the fields are the
    keys of ``status --json``'s ``timing`` (beside the compute judgement's)."""

    ranks: dict[str, dict]     # str(rank) -> host, step_s, intervals, ratio, slow
    nodes: dict[str, dict]     # host -> ranks, step_s, ratio, slow
    slow_ranks: list[int]
    slow_nodes: list[str]
    lines: list[str]           # the slow ones in words
    measure: str               # what a step time is: the step events' intervals or data_s
    ratio_threshold: float
    min_intervals: int

    def to_dict(self) -> dict:
        return dict(vars(self))

    @classmethod
    def from_dict(cls, d: dict) -> "Stragglers":
        return cls(**d)


def _steps(events: list[dict]) -> list[tuple[float, dict]]:
    """(time, event) of each step event with a time, the time read once."""
    out = []
    for e in events:
        if e.get("event") == "step":
            t = e.get("time")
            if type(t) is not float:    # the writer's floats skip the conversion
                t = to_float(t)
            if t is not None:
                out.append((t, e))
    return out


def _last_time(events: list[dict]) -> float | None:
    """The newest sign of life: a watchdog's stack is none, and its note of a held step counts
    from that step (``step_at``), not from when the note was written."""
    times = [to_float(e.get("step_at") if e.get("event") == "progress" and e.get("step_at") else e.get("time"))
             for e in events if e.get("event") != "stack"]
    times = [t for t in times if t is not None]
    return max(times) if times else None


def event_intervals(events: list[dict]) -> list[float]:
    """Seconds between consecutive step events."""
    ts = [t for t, _ in _steps(events)]
    return [b - a for a, b in zip(ts, ts[1:]) if b > a]


def step_times(events: list[dict]) -> list[float]:
    """Seconds per step between consecutive step events (their ``step`` numbers must grow)."""
    return _per_step(_steps(events))


def _per_step(steps: list[tuple[float, dict]]) -> list[float]:
    """`step_times` of a rank's `_steps`."""
    st = [(t, e["step"]) for t, e in steps if isinstance(e.get("step"), (int, float))]
    out = []
    for (ta, sa), (tb, sb) in zip(st, st[1:]):
        dt, ds = tb - ta, sb - sa
        if dt > 0 and ds > 0:
            out.append(dt / ds)
    return out


def stall(per_rank: dict[int, list[dict]], now: float) -> Stall | None:
    """The silent ranks of a running job (see the module docstring), or None.

    ``per_rank``: rank -> its events of the current run. Ranks that wrote ``end`` or ``error``
    are not silent: they ended. ``behind`` never holds a rank whose stack of the silence shows it
    waiting in a collective; ``last_steps`` counts every event's step (step events are throttled,
    a stack event carries the step it hung at). The stacks are left to `silent_stacks`."""
    live = {r: evs for r, evs in per_rank.items()
            if evs and not any(e.get("event") in ("end", "error") for e in evs)}
    medians = {r: statistics.median(iv) for r, evs in live.items() if (iv := event_intervals(evs))}
    if not medians:
        return None
    overall = statistics.median(medians.values())
    limits = {r: max(STALL_FACTOR * medians.get(r, overall), STALL_MIN_S) for r in live}
    last = {r: _last_time(evs) for r, evs in live.items()}
    silent = sorted(r for r in live if last[r] is not None and now - last[r] > limits[r])
    if not silent or any(r not in silent and _busy(live[r]) for r in live):
        return None
    others = [last[r] for r in live if r not in silent and last[r] is not None]
    steps = {r: newest_step(live[r]) for r in silent}
    known = [s for s in steps.values() if s is not None]
    waiting = {r for r, text in silent_texts(live, silent).items() if collective(text)}
    behind = [r for r in silent if steps[r] is not None and known and steps[r] < max(known)
              and r not in waiting]   # a rank its stack shows waiting in a collective stopped no one
    newest = max(last[r] for r in silent)
    return Stall(ranks=silent, silent_for_s=round(now - newest, 3),
                 others_last_s=round(now - max(others), 3) if others else None,
                 threshold_s=round(max(limits[r] for r in silent), 3),
                 median_interval_s=round(overall, 3), behind=behind,
                 last_steps={str(r): steps[r] for r in silent})


def _busy(events: list[dict]) -> bool:
    """The rank's newest event (other than ``stack``) says it is in a save or an evaluation."""
    e = next((e for e in reversed(events) if e.get("event") != "stack"), None)
    return e is not None and e.get("event") == "progress" and e.get("phase") in BUSY_PHASES


def newest_step(events: list[dict]) -> int | None:
    """The largest step any event reports (``step``, ``stack``, ``checkpoint``, ``end`` ...)."""
    return max((s for e in events if (s := to_int(e.get("step"), None)) is not None), default=None)


def silent_stacks(per_rank: dict[int, list[dict]], ranks: list[int], now: float | None = None,
                  threshold_s: float | None = None) -> tuple[dict[str, str], list[int]]:
    """(rank -> where its newest stack event, written during its silence, says it is; the silent
    ranks that wrote none while others did). A rank's watchdog writes its stacks at the stall
    threshold and before the collective timeout: a rank that does not is frozen (SIGSTOP, a
    kernel hang) or gone. With ``now`` and ``threshold_s``, a rank counts as one that wrote none
    only when it has been silent for ``STACK_GRACE_S`` past the threshold."""
    where: dict[str, str] = {}
    late: list[int] = []
    texts = silent_texts(per_rank, ranks)
    for r in ranks:
        since = _last_time(per_rank.get(r, [])) or 0.0
        if (s := stack_summary(texts.get(r, ""))):
            where[str(r)] = s
        elif now is None or threshold_s is None or now - since > threshold_s + STACK_GRACE_S:
            late.append(r)
    return where, (late if where else [])


def silent_texts(per_rank: dict[int, list[dict]], ranks: list[int]) -> dict[int, str]:
    """rank -> the text of its newest stack event written during its silence (since its newest
    other event)."""
    out: dict[int, str] = {}
    for r in ranks:
        evs = per_rank.get(r, [])
        since = _last_time(evs) or 0.0
        stacks = [e for e in evs if e.get("event") == "stack" and (to_float(e.get("time")) or 0) >= since]
        if stacks and stacks[-1].get("stack"):
            out[r] = str(stacks[-1]["stack"])
    return out


def hang(per_rank: dict[int, list[dict]], ranks: list[int]) -> str | None:
    """The silent ranks' hang in one line (`ddp_hpc.judge.stacks.hang_line`): which rank is
    not inside a collective while the others wait in one; None when the stacks do not say."""
    return hang_line(silent_texts(per_rank, ranks), ranks_text)


def _own_times(steps: list[tuple[float, dict]]) -> list[float]:
    """The rank's own seconds per step waiting for data (``data_s`` of the training core's step
    events, `_steps`), when its events carry them."""
    return [float(e["data_s"]) for _, e in steps if isinstance(e.get("data_s"), (int, float))]


def stragglers(per_rank: dict[int, list[dict]], hosts: dict[int, str | None]) -> Stragglers | None:
    """Per-rank and per-node step times and the slow ones (see the module docstring), or None
    when no rank has enough step events. ``hosts``: rank -> its host. Step events that carry
    ``data_s`` (the training core's) are judged by it: their times are the same on every rank,
    and a rank with a slow data loader is the one that waits longest for its batches."""
    ranks: dict[int, dict] = {}
    steps = {r: _steps(evs) for r, evs in per_rank.items()}   # once a rank: thousands of them
    own_times = {r: _own_times(st) for r, st in steps.items()}
    own = all(len(t) >= STRAGGLER_MIN_INTERVALS for t in own_times.values()) and per_rank
    for r in sorted(per_rank):
        times = own_times[r] if own else _per_step(steps[r])
        if len(times) >= STRAGGLER_MIN_INTERVALS:
            ranks[r] = {"host": hosts.get(r), "step_s": statistics.median(times),
                        "intervals": len(times)}
    if not ranks:
        return None
    floor = 0.0
    if own:   # a wait for data counts only when it is a real share of the step
        floor = OWN_MIN_SHARE * statistics.median(
            [t for st in steps.values() for t in _per_step(st)] or [0.0])
    _ratios(ranks, floor)
    by_node: dict[str, list[int]] = {}
    for r, d in ranks.items():
        if d["host"]:
            by_node.setdefault(d["host"], []).append(r)
    nodes = {h: {"ranks": rs, "step_s": statistics.median(ranks[r]["step_s"] for r in rs)}
             for h, rs in sorted(by_node.items())}
    _ratios(nodes, floor)
    for d in nodes.values():  # a node is slow when its ranks are, not when one of them is
        d["slow"] = d["slow"] and all(ranks[r]["slow"] for r in d["ranks"])
    slow_nodes = [h for h, d in nodes.items() if d["slow"]]
    what = " waiting for data" if own else ""
    lines = [f"{h} is {nodes[h]['ratio']:.1f}x slower{what} than the median node "
             f"(ranks {', '.join(map(str, nodes[h]['ranks']))})" for h in slow_nodes]
    slow_ranks = [r for r, d in ranks.items() if d["slow"]]
    lines += [f"rank {r}" + (f" on {ranks[r]['host']}" if ranks[r]["host"] else "")
              + f" is {ranks[r]['ratio']:.1f}x slower{what} than the median rank "
              f"({ranks[r]['step_s']:.3g} s per step)"
              for r in slow_ranks if ranks[r]["host"] not in slow_nodes]
    for d in list(ranks.values()) + list(nodes.values()):
        d["step_s"] = round(d["step_s"], 6)
    return Stragglers(ranks={str(r): d for r, d in ranks.items()}, nodes=nodes, slow_ranks=slow_ranks,
                      slow_nodes=slow_nodes, lines=lines,
                      measure="data_s (own wait for data per step)" if own else "step event intervals",
                      ratio_threshold=STRAGGLER_RATIO, min_intervals=STRAGGLER_MIN_INTERVALS)


def _ratios(items: dict, floor: float = 0.0) -> None:
    """Each item's step time over the median of the others'; ``slow`` at >= STRAGGLER_RATIO and
    at least ``floor`` seconds above that median."""
    ordered = sorted(d["step_s"] for d in items.values())
    for d in items.values():
        ref = _median_without(ordered, d["step_s"])
        d["ratio"] = round(d["step_s"] / ref, 3) if ref else None
        d["slow"] = bool(d["ratio"] and d["ratio"] >= STRAGGLER_RATIO
                         and d["step_s"] - ref >= floor)


def _median_without(ordered: list[float], value: float) -> float | None:
    """``statistics.median`` of ``ordered`` (sorted) without one occurrence of ``value``, in
    O(log n) instead of a new list per item (which made `_ratios` quadratic in the ranks)."""
    n = len(ordered) - 1
    if n < 1:
        return None
    gone = bisect.bisect_left(ordered, value)

    def at(i: int) -> float:  # the i-th of the others
        return ordered[i] if i < gone else ordered[i + 1]
    mid = n // 2
    return at(mid) if n % 2 else (at(mid - 1) + at(mid)) / 2


def _newest(events: list[dict], key: str, parse, default):
    """The newest value of ``key`` in ``events`` (oldest first) that ``parse`` reads; ``default``
    when none does."""
    for e in reversed(events):
        if e.get(key) is not None and (value := parse(e.get(key))) is not None:
            return value
    return default


def progress(evs: list[dict], all_events: list[dict]) -> RunProgress | None:
    """Where training stands from one rank's events of the current run (``evs``; all its runs'
    in ``all_events``): epoch, the largest step, the newest loss and samples/s, and an ETA from
    the rate between the run's first and last step events."""
    evs = evs or all_events
    kinds = ("step", "epoch", "end", "eval", "checkpoint")
    metrics = [e for e in evs if e.get("event") in kinds]
    if not metrics:  # a requeued run that has only started: show where the last one got to
        evs = all_events
        metrics = [e for e in evs if e.get("event") in kinds]
    if not metrics:
        return None
    p = RunProgress(updated=to_float(metrics[-1].get("time")))
    p.epoch = _newest(metrics, "epoch", to_int, p.epoch)
    # steps only grow within a run: the largest any event reports (a stack event's too: step
    # events are throttled to one a second, the watchdog's stack names the step a rank hung at)
    p.step = newest_step(evs if any(e.get("event") in kinds for e in evs) else metrics)
    # the newest step's loss and throughput (epoch events carry epoch means: a fallback);
    # steps_per_s: an instrumented script's step events
    for kind in ("epoch", "step"):
        of_kind = [x for x in metrics if x.get("event") == kind]
        p.loss = _newest(of_kind, "loss", to_float, p.loss)
        p.samples_per_s = _newest(of_kind, "samples_per_s", to_float, p.samples_per_s)
        p.steps_per_s = _newest(of_kind, "steps_per_s", to_float, p.steps_per_s)
    totals = [e.get("total_steps") for e in all_events if e.get("total_steps") is not None]
    p.total_steps = to_int(totals[-1], None) if totals else None
    if p.total_steps and p.step is not None:
        p.percent = min(100.0, 100.0 * p.step / p.total_steps)
    steps = [e for e in evs if e.get("event") == "step" and e.get("step") is not None]
    ended = any(e.get("event") == "end" for e in evs)
    if not ended and len(steps) >= 2 and p.total_steps and p.step is not None:
        s0, s1 = steps[0], steps[-1]
        dt = to_float(s1.get("time"), 0.0) - to_float(s0.get("time"), 0.0)
        ds = to_int(s1.get("step"), 0) - to_int(s0.get("step"), 0)
        if dt > 0 and ds > 0:
            p.eta_s = max(0.0, (p.total_steps - p.step) * dt / ds)
    elif ended and p.total_steps:
        p.eta_s = 0.0 if any(e.get("event") == "end" and e.get("status") == "completed"
                             for e in evs) else None
    return p
