"""Numbers from text that may not hold one: environment variables, Slurm's columns, run-log events.

Each returns ``default`` (None unless given) for a value it cannot read, instead of raising, so a
reader of someone else's output keeps going past an odd field.  Nothing here imports the rest of
ddp_hpc, so every layer may use it.
"""
from __future__ import annotations

from typing import TypeVar

__all__ = ["to_int", "to_float"]

D = TypeVar("D")


def to_int(value: object, default: D = None) -> int | D:
    """``int(value)``, or ``default`` when that fails: ``"3"``, ``" 3 "`` and ``3`` -> 3; ``2.9`` ->
    2 (a float is truncated, as ``int`` does); ``"2.0"``, ``""``, None -> ``default``."""
    try:
        return int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return default


def to_float(value: object, default: D = None) -> float | D:
    """``float(value)``, or ``default`` when that fails: ``"1.5"``, ``"1e3"``, ``2`` -> a float;
    ``""``, ``"abc"``, None -> ``default``."""
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return default
