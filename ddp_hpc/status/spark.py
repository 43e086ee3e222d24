"""The detail view's sparklines: samples/s and loss over the run's time in one line each (Unicode
blocks, or ASCII where the terminal is not UTF-8), the restarts, stalls and checkpoints marked
under them at their times, and the time axis. Drawn from the picture of the run
(`ddp_hpc.judge.picture`); pure, but for `unicode_ok`, which asks the terminal."""
from __future__ import annotations

import codecs
import locale
import sys

from ddp_hpc.judge.picture import Picture
from ddp_hpc.slurm.times import format_duration

__all__ = ["spark_lines", "unicode_ok", "WIDTH"]

WIDTH = 60   # columns of one sparkline: the run's time in WIDTH equal parts
BLOCKS = "▁▂▃▄▅▆▇█"
ASCII = "._-~=+*#"
#: marks under the sparklines, the first of a column's kinds wins
MARKS = (("restart", "R"), ("stall", "S"), ("checkpoint", "C"))


def unicode_ok(stream=None) -> bool:
    """Whether ``stream`` (stdout) takes UTF-8: its encoding, else the locale's."""
    enc = getattr(stream if stream is not None else sys.stdout, "encoding", None) or locale.getpreferredencoding(False)
    try:
        return codecs.lookup(enc).name == "utf-8"
    except LookupError:
        return False


def _column(t: float, t0: float, span: float) -> int:
    return min(WIDTH - 1, max(0, int((t - t0) / span * WIDTH)))


def _line(points: list[tuple[float, float]], t0: float, span: float, levels: str) -> str:
    """Each column the mean of the values that fall in it, scaled from the lowest to the highest
    mean; a column without a value (between runs, before the first step) is blank."""
    sums: dict[int, list[float]] = {}
    for t, v in points:
        acc = sums.setdefault(_column(t, t0, span), [0.0, 0])
        acc[0] += v
        acc[1] += 1
    means = {c: s / n for c, (s, n) in sums.items()}
    lo, hi = min(means.values()), max(means.values())
    top = len(levels) - 1
    return "".join(levels[round((means[c] - lo) / (hi - lo) * top) if hi > lo else top // 2] if c in means else " "
                   for c in range(WIDTH)).rstrip()


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def spark_lines(picture: Picture | None, unicode: bool) -> list[str]:
    """The sparklines block (nothing without step events that carry samples/s or loss)."""
    if picture is None or not picture.series:
        return []
    t0, span = picture.t0, max(picture.t1 - picture.t0, 1e-9)
    levels = BLOCKS if unicode else ASCII
    out = []
    for name, i in (("Samples/s", 1), ("Loss", 2)):
        pts = [(p[0], p[i]) for p in picture.series if p[i] is not None]
        if pts:
            vals = [v for _, v in pts]
            out.append(f"{name + ':':<12}{_line(pts, t0, span, levels):<{WIDTH}}  "
                       f"first {_fmt(vals[0])}, last {_fmt(vals[-1])} (min {_fmt(min(vals))}, max {_fmt(max(vals))})")
    if not out:
        return []
    cols = [" "] * WIDTH
    seen = set()
    for kind, letter in reversed(MARKS):   # the first kind of MARKS written last: it wins a column
        for m in picture.marks:
            if m.get("kind") == kind:
                cols[_column(m["time"], t0, span)] = letter
                seen.add(kind)
    if seen:
        legend = ", ".join(f"{letter} {kind}" for kind, letter in MARKS if kind in seen)
        out.append(f"{'Marks:':<12}{''.join(cols):<{WIDTH}}  {legend}")
    end = format_duration(span)
    out.append(" " * 12 + "0" + end.rjust(WIDTH - 1) + "  (time since the first run started)")
    return out
