"""Each rank's GPU as its ``gpu`` events tell it (`ddp_hpc.runlogs.gpu`), and the GPUs that idle
while their rank trains (docs/status.md, "GPUs"); `gpu_lines` are the detail view's lines of them.

- A rank's GPU is its newest sample (utilisation, memory, temperature, power, ECC errors) and
  every XID error its samples reported.
- A GPU is **idle** when its samples of the newest ``IDLE_WINDOW_S`` seconds (the rank was
  sampled for at least that long) average below ``IDLE_PERCENT`` % busy while the rank trains
  (its step events in that window count steps forward). Its line says how long the rank waits
  for data per step, the usual reason.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from ddp_hpc.parsing import to_float, to_int

__all__ = ["IDLE_PERCENT", "IDLE_WINDOW_S", "MAX_ROWS", "GpuReport", "gpus", "gpu_percent", "gpu_lines"]

IDLE_PERCENT = 20.0
IDLE_WINDOW_S = 60.0
#: the fields of a sample status shows (the rest of a ``gpu`` event is its envelope)
FIELDS = ("gpu", "util_percent", "mem_used_mb", "mem_total_mb", "temp_c", "power_w", "ecc_errors")


@dataclass(frozen=True)
class GpuReport:
    """Each rank's GPU and the idle ones (`gpus`); the fields are the keys of ``status --json``'s
    ``gpus``."""

    #: str(rank) -> its newest sample's `FIELDS` that it has, ``host``, ``time`` and ``xid_errors``
    #: (every XID error its samples reported) when any
    ranks: dict[str, dict]
    idle: dict[str, dict]    # str(rank) -> util_percent, window_s, step_s, data_s of its idle GPU
    lines: list[str]         # the idle GPUs in words
    idle_percent: float      # a GPU below this busy share is idle (`IDLE_PERCENT`)

    def to_dict(self) -> dict:
        return dict(vars(self))

    @classmethod
    def from_dict(cls, d: dict) -> "GpuReport":
        return cls(**d)


def _samples(events: list[dict]) -> list[tuple[float, dict]]:
    return [(t, e) for e in events if e.get("event") == "gpu" and (t := to_float(e.get("time"))) is not None]


def _idle(events: list[dict], samples: list[tuple[float, dict]]) -> dict | None:
    """The rank's idle GPU over the newest window (see the module docstring), or None."""
    newest = samples[-1][0]
    since = newest - IDLE_WINDOW_S
    if samples[0][0] > since:
        return None      # not watched for a whole window yet
    busy = [u for t, e in samples if t >= since and (u := to_float(e.get("util_percent"))) is not None]
    if not busy or statistics.mean(busy) >= IDLE_PERCENT:
        return None
    steps = [(t, s, e) for e in events if e.get("event") == "step" and (t := to_float(e.get("time"))) is not None
             and t >= since and (s := to_int(e.get("step"), None)) is not None]
    if len(steps) < 2 or steps[-1][1] <= steps[0][1]:
        return None      # not training: an evaluation, a checkpoint, a stall
    step_s = (steps[-1][0] - steps[0][0]) / (steps[-1][1] - steps[0][1])
    data = [d for _, _, e in steps if (d := to_float(e.get("data_s"))) is not None]
    data_s = statistics.mean(data) if data else None
    return {"util_percent": round(statistics.mean(busy), 1), "window_s": IDLE_WINDOW_S,
            "step_s": round(step_s, 6), "data_s": None if data_s is None else round(data_s, 6)}


def _idle_line(rank: int, host: str | None, idle: dict) -> str:
    where = f"rank {rank}" + (f" on {host}" if host else "")
    line = f"{where}: its GPU was {idle['util_percent']:.0f}% busy over the last minute while it trained; "
    if idle["data_s"] is None:
        return line + "its wait for data is not recorded"
    share = f" ({100 * idle['data_s'] / idle['step_s']:.0f}% of a step)" if idle["step_s"] else ""
    return line + f"it waits {idle['data_s']:.3g} s per step for data{share}"


def gpus(per_rank: dict[int, list[dict]], hosts: dict[int, str | None]) -> GpuReport | None:
    """Each rank's GPU by its newest sample and the idle ones; None when no rank wrote a ``gpu``
    event."""
    ranks: dict[str, dict] = {}
    idle: dict[str, dict] = {}
    lines: list[str] = []
    for r, evs in sorted(per_rank.items()):
        samples = _samples(evs)
        if not samples:
            continue
        newest = samples[-1][1]
        row = {k: newest[k] for k in FIELDS if newest.get(k) is not None}
        xids = sorted({int(x) for _, e in samples for x in (e.get("xid_errors") or [])})
        ranks[str(r)] = {**row, "host": hosts.get(r), "time": samples[-1][0], **({"xid_errors": xids} if xids else {})}
        if (why := _idle(evs, samples)) is not None:
            idle[str(r)] = why
            lines.append(_idle_line(r, hosts.get(r), why))
    if not ranks:
        return None
    return GpuReport(ranks=ranks, idle=idle, lines=lines, idle_percent=IDLE_PERCENT)


def gpu_percent(per_rank: dict[int, list[dict]]) -> float | None:
    """The mean utilisation of the ranks' newest ``gpu`` samples (the job table's GPU% cell);
    None when the lowest rank wrote none (a job on CPUs, or without ``pynvml``: its other ranks
    are not searched, which keeps a refresh over many running jobs cheap)."""
    newest = []
    for _, evs in sorted(per_rank.items()):
        u = next((u for e in reversed(evs) if e.get("event") == "gpu"
                  and (u := to_float(e.get("util_percent"))) is not None), None)
        if u is None and not newest:
            return None
        if u is not None:
            newest.append(u)
    return round(statistics.mean(newest), 1) if newest else None


#: ranks shown one a line; beyond, the ranks with the least busy GPUs (``--json`` has them all)
MAX_ROWS = 16


def _row(rank: str, g: dict) -> str:
    parts = [f"rank {rank:<3} {str(g.get('host') or '-'):<10}"]
    if g.get("util_percent") is not None:
        parts.append(f"{g['util_percent']:>3}% busy")
    if g.get("mem_used_mb") is not None and g.get("mem_total_mb"):
        parts.append(f"memory {g['mem_used_mb'] / 1024:.1f}/{g['mem_total_mb'] / 1024:.1f} GiB")
    if g.get("temp_c") is not None:
        parts.append(f"{g['temp_c']} C")
    if g.get("power_w") is not None:
        parts.append(f"{g['power_w']:.0f} W")
    if g.get("ecc_errors"):
        parts.append(f"ECC errors {g['ecc_errors']}")
    if g.get("xid_errors"):
        parts.append("XID " + ", ".join(map(str, g["xid_errors"])))
    return "  ".join(parts)


def gpu_lines(gpus: GpuReport | None) -> list[str]:
    """``GPUs:`` then one line per rank (at most `MAX_ROWS`: the least busy), then ``GPU idle:``
    lines; nothing without samples."""
    if gpus is None or not gpus.ranks:
        return []
    ranks = gpus.ranks
    shown = sorted(ranks, key=int)
    if len(shown) > MAX_ROWS:
        shown = sorted(sorted(shown, key=lambda r: ranks[r].get("util_percent", 101))[:MAX_ROWS], key=int)
    out = ["GPUs:"] + [f"  {_row(r, ranks[r])}" for r in shown]
    if len(ranks) > len(shown):
        out.append(f"  ({len(ranks) - len(shown)} more ranks, busier; --json has them all)")
    return out + [("GPU idle:   " if i == 0 else "            ") + ln for i, ln in enumerate(gpus.lines)]
