"""Slurm's time strings: durations (``--time``, squeue's TimeUsed, sacct's Elapsed) and timestamps.

Slurm writes one duration in several ways: squeue prints ``1:05`` (M:SS) and ``2-03:00:00``,
sacct ``00:01:05``, ``sacct -c`` a time limit as bare minutes (``10``), and ``--time`` accepts all
of M, M:S, H:M:S, D-H, D-H:M and D-H:M:S. :func:`duration_seconds` reads every one of them and
:func:`format_duration` writes the one form ddp_hpc shows: ``[D-]HH:MM:SS``.
"""
from __future__ import annotations

import datetime as _dt
import re

__all__ = ["duration_seconds", "format_duration", "normalize_duration", "timestamp"]

_DURATION = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def duration_seconds(text: object) -> int | None:
    """Seconds in a Slurm duration (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S); None for anything
    else (``UNLIMITED``, ``INVALID``, ``Partition_Limit``, empty)."""
    m = _DURATION.match(str(text).strip()) if text is not None else None
    if not m:
        return None
    d, a, b, c = m.groups()
    if d is not None:  # D-H, D-H:M, D-H:M:S
        return int(d) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    if c is not None:  # H:M:S
        return int(a) * 3600 + int(b) * 60 + int(c)
    if b is not None:  # M:S
        return int(a) * 60 + int(b)
    return int(a) * 60  # M


def format_duration(seconds: float | None) -> str | None:
    """Seconds -> ``[D-]HH:MM:SS`` (``None`` stays None)."""
    if seconds is None:
        return None
    s = int(max(0, round(seconds)))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}-" if d else "") + f"{h:02d}:{m:02d}:{s:02d}"


def normalize_duration(text: object) -> str | None:
    """Any Slurm duration in ``[D-]HH:MM:SS``; words such as ``UNLIMITED`` are kept as written,
    empty values become None."""
    if text is None or not str(text).strip():
        return None
    seconds = duration_seconds(text)
    return str(text).strip() if seconds is None else format_duration(seconds)


def timestamp(text: object) -> float | None:
    """Slurm's ISO local timestamps (``2026-11-22T15:40:01``) -> unix seconds; else None."""
    if not text or str(text) in ("Unknown", "None", "N/A"):
        return None
    try:
        return _dt.datetime.fromisoformat(str(text)).timestamp()
    except ValueError:
        return None
