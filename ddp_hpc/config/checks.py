"""Checks of single Slurm option values, shared by the YAML ``slurm:`` section and the command
line: each ``check_*`` takes (value, label) -- the label names where the value came from,
``slurm.time`` or ``--time`` -- and returns the value as stored, or raises ConfigError naming
the value and the fix."""

from __future__ import annotations

import re
import signal as _signal
from typing import Any, Callable

from ddp_hpc.config.typed import ConfigError
from ddp_hpc.slurm.times import duration_seconds

__all__ = ["time_to_seconds", "parse_signal", "check_count", "check_flag",
           "check_text", "check_time", "check_signal", "check_backend", "check_nodes", "node_range",
           "check_stage", "PLAIN"]

#: what may stand in an #SBATCH line: no blanks, quotes, $, #, ; or backslashes
PLAIN = re.compile(r"[A-Za-z0-9_.:@%+=,/&|*!()\[\]-]+")
_PLAIN_HINT = ("use letters, digits and _ . : @ % + = , / & | * ! ( ) [ ] - only "
               "(no blanks, quotes, $, #, ; or backslashes)")


def time_to_seconds(text: str, label: str = "--time") -> int:
    """Slurm time formats (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S; `ddp_hpc.slurm.times`) -> seconds > 0."""
    total = duration_seconds(text)
    if total is None:
        raise ConfigError(f"{label} {text!r} is not a Slurm time",
                          "write minutes (30), HH:MM:SS (02:00:00) or D-HH:MM:SS (1-00:00:00)")
    if total <= 0:
        raise ConfigError(f"{label} {text!r} is zero", "give the job some time, e.g. 00:30:00")
    return total


def parse_signal(text: str, label: str = "--signal") -> tuple[str, int]:
    """``USR2@90`` / ``SIGUSR1@120`` / ``USR2`` -> (``USR2``, grace seconds; 90 by default)."""
    name, _, grace = str(text).partition("@")
    name = name.upper().removeprefix("SIG")
    if not name or not hasattr(_signal, "SIG" + name) or not name.isalnum():
        raise ConfigError(f"{label} {text!r} is not a signal name",
                          "write e.g. USR2@90 (signal USR2, 90 s before the time limit)")
    try:
        seconds = int(grace) if grace else 90
    except ValueError:
        seconds = -1
    if not 0 < seconds <= 65535:
        raise ConfigError(f"{label}: grace {grace!r} in {text!r} is not a number of seconds in "
                          f"1..65535", "write e.g. USR2@90")
    return name, seconds


def check_plain(label: str, value: Any, pattern: re.Pattern = PLAIN, hint: str = "") -> str:
    text = str(value)
    if not pattern.fullmatch(text):
        raise ConfigError(f"{label} {text!r} contains characters that are not allowed here",
                          hint or _PLAIN_HINT)
    return text


def check_count(minimum: int, optional: bool = False) -> Callable[[Any, str], int | None]:
    """An integer >= minimum (or None when ``optional``)."""
    def check(value: Any, label: str) -> int | None:
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{label} must be an integer, got {value!r}",
                              f"write e.g. {label} {minimum + 1}")
        if value < minimum:
            raise ConfigError(f"{label} {value} is too few: at least {minimum} is needed",
                              f"use {minimum} or more for {label}")
        return value
    return check


def check_seconds(value: Any, label: str) -> float:
    """A number of seconds >= 0 (0: off)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ConfigError(f"{label} must be a number of seconds, got {value!r}",
                          f"write e.g. {label} 30 (0 turns it off)")
    if value < 0:
        raise ConfigError(f"{label} {value:g} is negative", f"use 0 or more seconds for {label} (0: off)")
    return float(value)


_NODES = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?")


def check_nodes(value: Any, label: str) -> int | str:
    """A node count (int >= 1), or sbatch's range ``MIN-MAX`` (1 <= MIN <= MAX), kept as the text
    ``"MIN-MAX"``: the job starts on at least MIN nodes and at most MAX, whatever is free."""
    if isinstance(value, int) and not isinstance(value, bool):
        return check_count(1)(value, label)
    m = _NODES.fullmatch(value) if isinstance(value, str) else None
    if m is None:
        raise ConfigError(f"{label} must be a node count or a range MIN-MAX, got {value!r}",
                          f"write e.g. {label} 2, or {label} 1-2 to start on what is free")
    low, high = int(m.group(1)), int(m.group(2) or m.group(1))
    if low < 1 or low > high:
        raise ConfigError(f"{label} {value!r}: a node range needs 1 <= MIN <= MAX, got MIN {low} "
                          f"and MAX {high}", f"write e.g. {label} {max(low, 1)}-{max(low, high, 1)}")
    return low if low == high else f"{low}-{high}"


def node_range(value: int | str) -> tuple[int, int]:
    """(MIN, MAX) of a checked ``nodes`` value: (N, N) for a count."""
    low, _, high = str(value).partition("-")
    return int(low), int(high or low)


def check_flag(value: Any, label: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{label} must be true or false, got {value!r}", f"{label}: true")
    return value


def _text(value: Any, label: str) -> str:
    """Strings, and numbers written without quotes in YAML (``time: 30``), as a string."""
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise ConfigError(f"{label} must be a string, got {value!r}", f"write e.g. {label}: value")
    return str(value)


def check_text(pattern: re.Pattern = PLAIN, hint: str = "") -> Callable[[Any, str], str | None]:
    """An optional string matching ``pattern``."""
    def check(value: Any, label: str) -> str | None:
        return None if value is None else check_plain(label, _text(value, label), pattern, hint)
    return check


def check_time(value: Any, label: str) -> str:
    text = _text(value, label)
    time_to_seconds(text, label)
    return check_plain(label, text)     # as written on its #SBATCH line: no blank or newline


def check_signal(value: Any, label: str) -> str | None:
    if value is None:
        return None
    text = _text(value, label)
    parse_signal(text, label)
    return check_plain(label, text)


def check_backend(value: Any, label: str) -> str:
    """A backend's name in plain letters; which names there are, the registry knows
    (``ddp_hpc.backends.get`` refuses one it does not, naming those it does)."""
    return check_plain(label, _text(value, label))


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_stage(value: Any, label: str) -> tuple[str, ...]:
    """What to stage on every node (``--stage`` / ``slurm.stage``): ``SRC`` or ``SRC=NAME`` words,
    as a list (one word alone counts as a list of one). Only the form is checked here; the
    sources and names when the job is submitted (``ddp_hpc.data.scriptstage.parse_stage_items``)."""
    items = [value] if isinstance(value, str) else value
    if value is None or not isinstance(items, (list, tuple)):
        raise ConfigError(f"{label} must be a list of SRC or SRC=NAME, got {value!r}",
                          f"write e.g. {label}: [/shared/train.lmdb, /shared/hf_cache=HF]")
    for item in items:
        if not isinstance(item, str) or not item.strip() or _CONTROL.search(item):
            raise ConfigError(f"{label}: {item!r} is not a path SRC or SRC=NAME",
                              "give a file, LMDB or folder path, optionally =NAME (letters, digits, _), "
                              "without control characters")
    return tuple(items)
