"""In-allocation restarts as the run logs keep them, written: the supervisor in the batch step
(``ddp_hpc.supervise``) appends one JSON object per restart (`schema.ALLOC_RESTART_KEYS`), and one
per step it stopped without restarting (`schema.ALLOC_STOP_KEYS`) and one per health check that
excluded nodes (`schema.ALLOC_HEALTH_KEYS`) and one per hang limit that stood back
(`schema.ALLOC_HOLD_KEYS`), to ``restarts.jsonl`` in the
run's log directory; ``ddp_hpc.judge.restarts`` reads them back.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ddp_hpc.runlogs.schema import (
    ALLOC_HEALTH_KEYS,
    ALLOC_HOLD_KEYS,
    ALLOC_RESTART_KEYS,
    ALLOC_RESTARTS_FILE,
    ALLOC_STOP_KEYS,
)

__all__ = ["append_restart", "append_stop", "append_health", "append_hold"]


def append_restart(log_dir: str | Path, entry: dict) -> None:
    """Append one restart (its keys: `ALLOC_RESTART_KEYS`) as a line, flushed to disk."""
    _append(log_dir, {k: entry.get(k) for k in ALLOC_RESTART_KEYS})


def append_stop(log_dir: str | Path, entry: dict) -> None:
    """Append a step the supervisor stopped and did not restart (`ALLOC_STOP_KEYS`: no
    ``restart``, so `read_restarts` and the restart counts leave it out)."""
    _append(log_dir, {k: entry.get(k) for k in ALLOC_STOP_KEYS})


def append_health(log_dir: str | Path, entry: dict) -> None:
    """Append a health check that excluded nodes before a start (`ALLOC_HEALTH_KEYS`)."""
    _append(log_dir, {k: entry.get(k) for k in ALLOC_HEALTH_KEYS})


def append_hold(log_dir: str | Path, entry: dict) -> None:
    """Append a hang limit that stood back: ranks worked outside a collective (`ALLOC_HOLD_KEYS`)."""
    _append(log_dir, {k: entry.get(k) for k in ALLOC_HOLD_KEYS})


def _append(log_dir: str | Path, rec: dict) -> None:
    with open(Path(log_dir, ALLOC_RESTARTS_FILE), "a", encoding="utf-8") as f:
        f.write(json.dumps(rec, sort_keys=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
