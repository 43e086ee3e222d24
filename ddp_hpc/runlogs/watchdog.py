"""Hang forensics: each rank writes the Python stack of every thread into its run log, as a
``stack`` event, (1) before its collective timeout would end it and (2) when asked.

Why a thread and not ``faulthandler``: the dump must land in the event stream status reads, and a
rank stuck in a collective sits in C++ with the GIL released, where a Python thread can still run
(``sys._current_frames`` gives every thread's frame). A rank that is itself frozen (SIGSTOP, a
kernel hang) cannot dump anything; then its peers' dumps, and its silence, tell the story.

(1) The training core (and a script through ``ddp_hpc.report``) calls ``beat(step)`` at each step;
when no beat came for ``dump_after_s`` (the collective timeout minus a margin), the stacks are
written once per silence: the peers of a stuck rank are then inside the collective they share
with it, and status blames the rank that never reached it.

(2) ``ddp-hpc status JOBID --stacks`` sends ``STACK_SIGNAL`` (SIGURG, ignored by default, so a
process without this thread is unharmed; ``ddp_hpc.exec`` forwards it to the script). Python
runs signal handlers only in the main thread, between bytecodes, which a rank stuck in C never
reaches; but Python's C-level handler writes the signal number to the wakeup fd at once, from
any thread, so this thread waits on that pipe. A program that already uses the wakeup fd (an
asyncio loop) keeps it, and only (1) works there.
"""
from __future__ import annotations

import collections
import os
import select
import signal
import statistics
import sys
import threading
import time
import traceback
from typing import Any, Callable

from ddp_hpc.runlogs.vitals import Vitals

__all__ = ["STACK_SIGNAL", "PROGRESS_EVERY_S", "HangWatch", "format_stacks", "dump_after"]

STACK_SIGNAL = signal.SIGURG
#: a rank between steps (evaluating) writes at most one ``progress`` event per this many seconds
PROGRESS_EVERY_S = 5.0
POLL_S = 1.0
#: the first dump of a silence comes when status would call the job stalled (the same rule as
#: ``judge.timing``: max(10 x the usual step interval, 30 s); its docstring says why 30 s), so a
#: running, stalled job shows where its ranks are; the second before the collective timeout
#: (`dump_after`). Not imported from there: a rank imports no judge.
STALL_FACTOR, STALL_MIN_S = 10.0, 30.0


def dump_after(collective_timeout_s: float | None) -> float | None:
    """When to dump before a collective timeout of ``collective_timeout_s``: 80% of it, and at
    least 5 s before it (never below 1 s); None (no timer) without a timeout."""
    if not collective_timeout_s or collective_timeout_s <= 0:
        return None
    return max(1.0, min(collective_timeout_s * 0.8, collective_timeout_s - 5.0))


def format_stacks() -> str:
    """Every thread's stack, innermost frame last, in faulthandler's words: ``Thread 0x... "name"
    (most recent call first):`` then ``  File "...", line N in func`` lines. The main thread first."""
    frames = sys._current_frames()  # noqa: SLF001 - the documented way to see other threads
    threads = {t.ident: t for t in threading.enumerate()}
    me = threading.get_ident()
    order = sorted(frames, key=lambda i: (threads.get(i) is not threading.main_thread(), i))
    out = []
    for ident in order:
        if ident == me:
            continue
        t = threads.get(ident)
        label = "Current thread" if t is threading.main_thread() else "Thread"
        out.append(f'{label} 0x{ident:016x} "{t.name if t else "?"}" (most recent call first):')
        for fs in reversed(traceback.extract_stack(frames[ident])):
            out.append(f'  File "{fs.filename}", line {fs.lineno} in {fs.name}')
        out.append("")
    return "\n".join(out).rstrip() + "\n"


class HangWatch:
    """One rank's watchdog thread. ``log`` has ``event(name, **fields)`` and ``info(msg)``."""

    def __init__(self, log: Any, dump_after_s: float | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log, self.dump_after_s, self.clock = log, dump_after_s, clock
        self.step: int | None = None
        self._last = clock()
        self._intervals: collections.deque[float] = collections.deque(maxlen=20)
        self._dumps = 0          # dumps made in the current silence
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pipe: tuple[int, int] | None = None
        self._old_fd: int | None = None
        self._old_handler: Any = None
        self._alive_at: float | None = None   # the newest progress event (`alive`)
        #: called from the watchdog thread every poll with the seconds since the last beat
        #: (``ddp_hpc.progress`` writes the step its throttle held back)
        self.idle: Callable[[float], None] | None = None
        self.vitals = Vitals()                # CPU, IO and place of the last seconds, for answers

    def alive(self, phase: str, step: int | None, every_s: float = PROGRESS_EVERY_S) -> None:
        """A sign of life between steps (a batch of an evaluation, a checkpoint's save): a beat,
        and a ``progress`` event at most every ``every_s`` seconds, which ``ddp_hpc.supervise``'s
        stall check counts (a long evaluation or save is no hang)."""
        now = self.clock()
        if self._alive_at is None or now - self._alive_at >= every_s:
            self._alive_at = now
            self.log.event("progress", phase=phase, step=step)
        self.beat(step)

    def beat(self, step: int | None = None) -> None:
        """A step (or a micro-batch) finished: cheap, a few attribute stores."""
        now = self.clock()
        if step != self.step:
            self._intervals.append(now - self._last)
        self._last, self.step, self._dumps = now, step, 0

    def thresholds(self) -> list[float]:
        """Seconds of silence after which to dump, in order (see STALL_FACTOR)."""
        usual = statistics.median(self._intervals) if self._intervals else 0.0
        out = [max(STALL_FACTOR * usual, STALL_MIN_S)]
        if self.dump_after_s is not None:
            out = sorted({*(t for t in out if t < self.dump_after_s), self.dump_after_s})
        return out

    def start(self) -> "HangWatch":
        if self._thread is None:
            self._listen()
            self._thread = threading.Thread(target=self._run, name="ddp_hpc-hangwatch", daemon=True)
            self._thread.start()
        return self

    def _listen(self) -> None:
        """Route STACK_SIGNAL to a pipe this thread reads (main thread only; else timer only)."""
        if threading.current_thread() is not threading.main_thread():
            return
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):
            os.close(r), os.close(w)
            return
        if old != -1:   # someone else's (asyncio): give it back
            signal.set_wakeup_fd(old)
            os.close(r), os.close(w)
            return
        self._old_handler = signal.signal(STACK_SIGNAL, lambda *_: None)
        self._pipe = (r, w)

    def stop(self) -> None:
        self._stop.set()
        if self._pipe is not None:   # wake the thread's select now (a zero byte: not a request)
            try:
                os.write(self._pipe[1], b"\0")
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=2 * POLL_S)
            self._thread = None
        if self._pipe is not None and threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(-1)
            signal.signal(STACK_SIGNAL, self._old_handler or signal.SIG_DFL)
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None

    def _asked(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for STACK_SIGNAL on the wakeup pipe."""
        if self._pipe is None:
            return self._stop.wait(timeout) and False
        ready, _, _ = select.select([self._pipe[0]], [], [], timeout)
        if not ready:
            return False
        try:
            data = os.read(self._pipe[0], 512)
        except OSError:
            return False
        return int(STACK_SIGNAL) in data

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            if self._asked(POLL_S):
                self.dump("on request")
                continue
            silent = self.clock() - self._last
            if self.idle is not None:
                try:
                    self.idle(silent)
                except Exception:  # noqa: BLE001 - a log that fails never stops the watchdog
                    pass
            marks = self.thresholds()
            if self._dumps < len(marks) and silent >= marks[self._dumps]:
                last = self.dump_after_s is not None and marks[self._dumps] == self.dump_after_s
                self._dumps += 1
                self.dump(f"{'collective timeout' if last else 'stalled'}: no step for {silent:.0f} s")

    def _sample(self) -> None:
        try:
            self.vitals.sample()
        except Exception:  # noqa: BLE001 - a failed sample only leaves the answers without work
            pass

    def dump(self, reason: str) -> None:
        """Write every thread's stack as a ``stack`` event (and a log line), with ``work``: what
        this process did over the last seconds (`runlogs.vitals`), so a reader tells a rank busy
        outside a collective from a still one; the dump's own CPU and bytes are not counted."""
        with self.vitals.own():
            try:
                work = self.vitals.recent()
            except Exception:  # noqa: BLE001
                work = None
            text = format_stacks()
            try:
                self.log.event("stack", reason=reason, stack=text, step=self.step,
                               work=work.to_dict() if work is not None else None)
                msg = f"stacks of all threads ({reason}):\n{text}"
                try:
                    self.log.info(msg, console=False)   # a RunLog: not on rank 0's console
                except TypeError:
                    self.log.info(msg)
            except Exception as exc:  # noqa: BLE001 - the watchdog must never take the rank down
                print(f"ddp_hpc: could not write a stack dump: {exc}", file=sys.stderr, flush=True)
