"""Ranks and nodes that compute slower than the others, from each rank's own compute per step
(``compute_s`` on step events: the instrumentation's and the training core's forward time,
`ddp_hpc.instrument.compute`; docs/status.md, "Stragglers").

Under DDP a slow rank makes every rank's step as long as its own (the all-reduce waits for it),
so step times cannot name it; its own compute can.

- A rank's compute is the median ``compute_s`` of its newest step events that cover at least
  ``MIN_STEPS`` steps (the steps from the event before them to the newest).
- A rank is slow at ``>= RATIO`` x the median of the other ranks' compute, when the others'
  wait for it (its compute minus that median) is at least ``MIN_SHARE`` of a step (the median
  seconds per step of the ranks): a tiny forward that is 1.5x slower costs nobody anything.
- A node (its compute: the median of its ranks') is named instead of its ranks when it is
  ``>= RATIO`` x the median of the other nodes and every rank on it is slow.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from ddp_hpc.judge.consequences import ranks_text
from ddp_hpc.judge.timing import Stragglers, _median_without
from ddp_hpc.parsing import to_float, to_int

__all__ = ["RATIO", "MIN_STEPS", "MIN_SHARE", "ComputeStragglers", "Timing", "compute_stragglers", "with_compute"]

RATIO = 1.2
MIN_STEPS = 20
MIN_SHARE = 0.05


@dataclass(frozen=True)
class ComputeStragglers:
    """Per-rank and per-node compute and the slow ones (`compute_stragglers`); the fields are the
    keys of ``status --json``'s ``timing.compute``."""

    ranks: dict[str, dict]     # str(rank) -> host, compute_s, ratio, wait_share, slow
    nodes: dict[str, dict]     # host -> ranks, compute_s (and ratio, wait_share with 2+ nodes), slow
    slow_ranks: list[int]
    slow_nodes: list[str]
    lines: list[str]           # the slow ones in words
    step_s: float              # the ranks' median seconds per step
    ratio_threshold: float
    min_steps: int

    def to_dict(self) -> dict:
        return dict(vars(self))

    @classmethod
    def from_dict(cls, d: dict) -> "ComputeStragglers":
        return cls(**d)


@dataclass(frozen=True)
class Timing:
    """A job's slow ranks and nodes: by their step times (`ddp_hpc.judge.timing.stragglers`) and
    by their own compute (`compute_stragglers`), either None where not judged (never both)."""

    by_step_time: Stragglers | None
    by_compute: ComputeStragglers | None

    @property
    def lines(self) -> list[str]:
        """The slow ones in words, the compute's first (a slow rank's compute is the cause its
        peers' step times cannot show)."""
        return [*(self.by_compute.lines if self.by_compute else []),
                *(self.by_step_time.lines if self.by_step_time else [])]

    def to_dict(self) -> dict:
        """``status --json``'s ``timing``: the step times' keys, and the compute's under
        ``compute`` with every line under ``lines``."""
        out = self.by_step_time.to_dict() if self.by_step_time is not None else {}
        if self.by_compute is not None:
            out["compute"] = self.by_compute.to_dict()
            out["lines"] = self.lines
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "Timing":
        steps = {k: v for k, v in d.items() if k != "compute"}
        if d.get("compute") is not None:   # the lines were both judgements'; the step times' own follow the compute's
            steps["lines"] = steps.get("lines", [])[len(d["compute"]["lines"]):]
        return cls(Stragglers.from_dict(steps) if "measure" in steps else None,
                   ComputeStragglers.from_dict(d["compute"]) if d.get("compute") is not None else None)


def window(events: list[dict], min_steps: int = MIN_STEPS) -> list[float] | None:
    """The ``compute_s`` of the newest step events covering at least ``min_steps`` steps, or
    None when the rank's events do not cover that many yet."""
    marks = [(s, c) for e in events if e.get("compute_s") is not None and e.get("event") == "step"
             and (s := to_int(e.get("step"), None)) is not None
             and (c := to_float(e.get("compute_s"))) is not None]
    for i in range(len(marks) - 2, -1, -1):
        if marks[-1][0] - marks[i][0] >= min_steps:
            return [c for _, c in marks[i + 1:]]
    return None


def _step_s(events: list[dict]) -> float | None:
    """The median seconds per step between the rank's consecutive step events."""
    marks = [(t, s) for e in events if e.get("event") == "step"
             and (t := to_float(e.get("time"))) is not None and (s := to_int(e.get("step"), None)) is not None]
    per = [(tb - ta) / (sb - sa) for (ta, sa), (tb, sb) in zip(marks, marks[1:]) if tb > ta and sb > sa]
    return statistics.median(per) if per else None


def _judge(items: dict, step_s: float) -> None:
    """Each item's ratio to the median of the others' compute, the others' wait for it as a
    share of a step, and ``slow`` (see the module docstring)."""
    ordered = sorted(d["compute_s"] for d in items.values())
    for d in items.values():
        ref = _median_without(ordered, d["compute_s"])
        d["ratio"] = round(d["compute_s"] / ref, 3) if ref else None
        d["wait_share"] = round(max(0.0, d["compute_s"] - ref) / step_s, 3) if ref is not None and step_s else None
        d["slow"] = bool(d["ratio"] and d["ratio"] >= RATIO and (d["wait_share"] or 0) >= MIN_SHARE)


def compute_stragglers(per_rank: dict[int, list[dict]], hosts: dict[int, str | None]) -> ComputeStragglers | None:
    """Per-rank and per-node compute and the slow ones, or None unless at least two ranks have
    ``compute_s`` over ``MIN_STEPS`` steps."""
    ranks: dict[int, dict] = {}
    for r, evs in sorted(per_rank.items()):
        if (values := window(evs)) is not None:
            ranks[r] = {"host": hosts.get(r), "compute_s": statistics.median(values)}
    if len(ranks) < 2:
        return None
    step_s = statistics.median([s for r in ranks if (s := _step_s(per_rank[r])) is not None] or [0.0])
    _judge(ranks, step_s)
    by_node: dict[str, list[int]] = {}
    for r, d in ranks.items():
        if d["host"]:
            by_node.setdefault(d["host"], []).append(r)
    nodes = {h: {"ranks": rs, "compute_s": statistics.median(ranks[r]["compute_s"] for r in rs)}
             for h, rs in sorted(by_node.items())}
    if len(nodes) > 1:
        _judge(nodes, step_s)
    for d in nodes.values():   # a node is slow when all its ranks are, not when one of them is
        d["slow"] = bool(d.get("slow")) and all(ranks[r]["slow"] for r in d["ranks"])
    slow_nodes = [h for h, d in nodes.items() if d["slow"]]
    lines = [f"{h} computes {nodes[h]['ratio']:.1f}x slower than the median node ({ranks_text(nodes[h]['ranks'])}); "
             f"the others wait about {100 * nodes[h]['wait_share']:.0f}% of each step for it" for h in slow_nodes]
    slow_ranks = [r for r, d in ranks.items() if d["slow"]]
    lines += [f"rank {r}" + (f" on {ranks[r]['host']}" if ranks[r]["host"] else "")
              + f" computes {ranks[r]['ratio']:.1f}x slower than the median rank; the others wait about "
              f"{100 * ranks[r]['wait_share']:.0f}% of each step for it"
              for r in slow_ranks if ranks[r]["host"] not in slow_nodes]
    for d in list(ranks.values()) + list(nodes.values()):
        d["compute_s"] = round(d["compute_s"], 6)
    return ComputeStragglers(ranks={str(r): d for r, d in ranks.items()}, nodes=nodes, slow_ranks=slow_ranks,
                             slow_nodes=slow_nodes, lines=lines, step_s=round(step_s, 6), ratio_threshold=RATIO,
                             min_steps=MIN_STEPS)


def with_compute(stragglers: Stragglers | None, compute: ComputeStragglers | None) -> Timing | None:
    """Both judgements of the slow ones as one `Timing`; None when neither named anything."""
    return None if stragglers is None and compute is None else Timing(stragglers, compute)
