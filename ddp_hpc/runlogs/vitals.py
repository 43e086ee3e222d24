"""Is this process working? Its CPU time, its IO and its main thread's position over the last
seconds, sampled by the rank's watchdog thread (``runlogs.watchdog``) and sent with every stack
answer, so the supervisor tells a rank that is busy outside a collective (a rank-0 save or
evaluation while the others wait in a barrier) from a frozen one (stopped, deadlocked, asleep)
with one request, without a second round of questions (docs/restarts.md, "A hang").

A sample is cheap and local: ``time.process_time()`` (one syscall), ``/proc/self/io`` (procfs, not
the shared filesystem; absent elsewhere: IO then counts nothing) and the main thread's innermost
frame (``sys._current_frames``). What the watchdog itself spends writing a stack answer (its CPU,
the bytes of the event and the log line) is kept apart, so asking a rank twice does not make it
look busy.

A rank is `working` when, over the window, its CPU time grew by at least `CPU_SHARE` of the
window, or its read and written bytes by at least `IO_MIN_BYTES`, or its main thread was seen at
more than one place. A sleeping or deadlocked main thread leaves all three still; a frozen
process (SIGSTOP) answers nothing at all.
"""
from __future__ import annotations

import collections
import sys
import threading
import time
from dataclasses import dataclass

__all__ = ["Vitals", "Work", "working", "WINDOW_S", "CPU_SHARE", "IO_MIN_BYTES"]

#: how far back the answer looks, seconds
WINDOW_S = 10.0
#: CPU seconds per second of the window that make a rank busy (the watchdog's own sampling costs
#: well under 1 %)
CPU_SHARE = 0.05
#: bytes read or written over the window that make a rank busy (a save on a slow filesystem still
#: writes more; the watchdog's ``/proc/self/io`` reads add about 100 bytes a second)
IO_MIN_BYTES = 64 * 1024


@dataclass(frozen=True)
class Work:
    """What the process did over ``over_s`` seconds: CPU seconds, bytes read and written, and at
    how many places its main thread was seen (1: the same line all along)."""

    over_s: float
    cpu_s: float
    io_bytes: int
    places: int

    def to_dict(self) -> dict:
        return {"over_s": round(self.over_s, 2), "cpu_s": round(self.cpu_s, 3), "io_bytes": self.io_bytes,
                "places": self.places}


def working(work: dict | None) -> bool | None:
    """True: the rank works (see the module docstring); False: it is still; None: the answer
    carries no sample (an older ddp_hpc, a window of under a second)."""
    if not isinstance(work, dict):
        return None
    try:
        over, cpu = float(work["over_s"]), float(work["cpu_s"])
        io, places = int(work["io_bytes"]), int(work["places"])
    except (KeyError, TypeError, ValueError):
        return None
    if over < 1.0:
        return None
    return cpu >= CPU_SHARE * over or io >= IO_MIN_BYTES or places > 1


def _io_bytes() -> int | None:
    """rchar + wchar of this process (every read and write, files and pipes), None without procfs."""
    try:
        with open("/proc/self/io", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
        return int(fields[b"rchar"]) + int(fields[b"wchar"])
    except (OSError, KeyError, ValueError):
        return None


def _main_place() -> tuple[str, int, str] | None:
    """Where the main thread is now: its innermost frame's file, line and function."""
    frame = sys._current_frames().get(threading.main_thread().ident)  # noqa: SLF001 - documented
    if frame is None:
        return None
    return frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name


class Vitals:
    """The samples of the last `WINDOW_S` seconds; `sample` from the watchdog thread each second,
    `own` around the watchdog's own writes, `recent` for an answer."""

    def __init__(self, window_s: float = WINDOW_S, clock=time.monotonic) -> None:
        self.window_s, self.clock = window_s, clock
        self._samples: collections.deque[tuple[float, float, int, tuple | None]] = collections.deque()
        self._own_cpu, self._own_io = 0.0, 0

    def _now(self) -> tuple[float, float, int, tuple | None]:
        io = _io_bytes()
        return (self.clock(), time.process_time() - self._own_cpu,
                (io - self._own_io) if io is not None else 0, _main_place())

    def sample(self) -> None:
        s = self._now()
        self._samples.append(s)
        while len(self._samples) > 2 and s[0] - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    def recent(self) -> Work | None:
        """The work since the oldest kept sample, up to now (a sample taken now); None before the
        first sample."""
        if not self._samples:
            return None
        now = self._now()
        first = self._samples[0]
        places = {s[3] for s in self._samples if s[3] is not None} | ({now[3]} if now[3] else set())
        return Work(now[0] - first[0], max(0.0, now[1] - first[1]), max(0, now[2] - first[2]), len(places))

    def own(self):
        """A context manager around the watchdog's own work (a stack dump): its CPU and IO are
        not the rank's."""
        return _Own(self)


class _Own:
    def __init__(self, v: Vitals) -> None:
        self.v = v

    def __enter__(self) -> None:
        self.cpu, self.io = time.process_time(), _io_bytes()

    def __exit__(self, *exc) -> None:
        self.v._own_cpu += max(0.0, time.process_time() - self.cpu)
        io = _io_bytes()
        if io is not None and self.io is not None:
            self.v._own_io += max(0, io - self.io)
