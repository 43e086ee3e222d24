"""Counted reads from the shared directory: the instrumentation hook the IO benchmark relies on.

Every code path in ``ddp_hpc.data`` that touches dataset storage opens files through
:func:`read_bytes` / :func:`open_counted`, so the number of opens and bytes a process made
against the *shared* directory is counted, not estimated.  Counting is per process (each
benchmark rank reports its own :func:`snapshot`), costs one ``str.startswith`` per open, and
is off the hot path when no root is registered.

:func:`watch` registers a shared root and, optionally, a fixed delay per open below it: the
benchmark's clearly labelled simulation of a metadata-bound parallel filesystem (Lustre/GPFS
spend most of a small-file read on the metadata server, not on the bytes).
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

__all__ = ["IOCounts", "watch", "unwatch", "reset", "snapshot", "read_bytes", "open_counted", "note_open", "note_bytes",
           "add"]


@dataclass
class IOCounts:
    """Opens and bytes this process made below the watched shared root."""

    opens: int = 0
    bytes: int = 0


class _State:
    root: str | None = None      # watched shared root with a trailing "/", or None
    delay_s: float = 0.0         # simulated metadata cost per open


_counts = IOCounts()
STATE = _State()
_lock = threading.Lock()  # reader threads (broadcast readers, staging) count concurrently


def watch(root: str | os.PathLike, open_delay_s: float = 0.0) -> None:
    """Start counting opens/bytes below ``root`` from zero (and sleep ``open_delay_s`` per open:
    the simulated metadata cost)."""
    reset()
    STATE.root = os.path.abspath(os.fspath(root)).rstrip("/") + "/"
    STATE.delay_s = float(open_delay_s)


def unwatch() -> None:
    STATE.root, STATE.delay_s = None, 0.0


def reset() -> None:
    _counts.opens = 0
    _counts.bytes = 0


def snapshot() -> dict:
    return {"opens": _counts.opens, "bytes": _counts.bytes}


def _watched(path: str) -> bool:
    return STATE.root is not None and os.path.abspath(path).startswith(STATE.root)


def note_open(path: str) -> bool:
    """Record one open of ``path`` if it is below the watched root; returns whether it was counted."""
    if not _watched(path):
        return False
    with _lock:
        _counts.opens += 1
    if STATE.delay_s:
        time.sleep(STATE.delay_s)
    return True


def add(opens: int, nbytes: int) -> None:
    """Add what another process (a pack worker) counted below the same root: no delay here."""
    with _lock:
        _counts.opens += int(opens)
        _counts.bytes += int(nbytes)


def note_bytes(path: str, n: int) -> None:
    if _watched(path):
        with _lock:
            _counts.bytes += int(n)


def read_bytes(path: str | os.PathLike) -> bytes:
    """Read a whole file, counted."""
    path = os.fspath(path)
    counted = note_open(path)
    with open(path, "rb") as f:
        data = f.read()
    if counted:
        with _lock:
            _counts.bytes += len(data)
    return data


class open_counted:
    """``open(path, 'rb')`` whose open and bytes read are counted (use as a context manager)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._counted = note_open(self.path)
        self._f = open(self.path, "rb", buffering=0)

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        if self._counted:
            with _lock:
                _counts.bytes += len(data)
        return data

    def readinto(self, buf) -> int:
        n = self._f.readinto(buf)
        if self._counted and n:
            with _lock:
                _counts.bytes += n
        return n

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
