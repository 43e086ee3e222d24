"""Progress of your own training script, for ``ddp-hpc status``: ``ddp_hpc.report(...)``.

    from ddp_hpc import report
    for step in range(start, total):
        loss = train_step(...)
        report(step=step + 1, total=total, loss=loss, lr=sched.get_last_lr()[0])

Each call may write a ``step`` event (epoch, step, total_steps, loss, lr, samples_per_s, and any
other keyword under ``metrics``) to its node's ``node<K>.events.jsonl`` in ``$DDP_HPC_LOG_DIR``
(set by ``python -m ddp_hpc.exec`` and the submit backends); without a log directory it does
nothing.  Cheap enough for every step: the file stays open, and at most one event per second is
written (the first and the final one, ``step >= total``, always), so a tensor ``loss`` is turned
into a number (a GPU sync) only when an event is written.  A log that cannot be written is
reported once on stderr and never stops the script.

Under ``ddp-hpc submit`` a script that never calls `report` still gets step events: the
instrumentation of ``ddp_hpc.exec`` (``ddp_hpc.instrument``) calls `auto_step` from PyTorch's
optimizer-step hook. Both go through `_record` and write with `write_step`, the one writer of a
script's ``step`` events; the first explicit `report` call turns the automatic ones off, so
nothing is counted twice.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable

from ddp_hpc.env import EnvError, detect, job_facts
from ddp_hpc.exec.events import SafeLog
from ddp_hpc.runlogs.watchdog import HangWatch

__all__ = ["report", "rank_log", "close", "last_step", "auto_step", "write_step", "MIN_INTERVAL_S"]

MIN_INTERVAL_S = 1.0
#: keywords with their own key in a step event (docs/architecture.md, "Run logs")
STEP_KEYS = ("epoch", "lr", "samples_per_s")
#: keys of the automatic step events written beside them when present: the rank's own mean wait
#: for data per step, steps per second, and its own compute per step (``ddp_hpc.instrument.compute``)
OWN_KEYS = ("data_s", "steps_per_s", "compute_s")


class _State:
    """This process's run log and throttle; reopened in a forked child (its pid differs)."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = pid
        self.log: SafeLog | None = None
        self.last_write: float | None = None
        self.step: int | None = None
        self.watch: HangWatch | None = None
        self.explicit = False      # the script called report(): the automatic steps stay quiet
        self.world_size = 1
        self.held: tuple | None = None   # the newest step the throttle held back
        self.told: int | None = None     # the held step `_tell_held` wrote as a progress event


_state = _State()


def rank_log() -> SafeLog | None:
    """This rank's run log in ``$DDP_HPC_LOG_DIR`` (opened once per process), None without one."""
    global _state
    if _state.pid != os.getpid():
        _state = _State(os.getpid())
        log_dir = job_facts().log_dir
        if log_dir:
            try:
                env = detect()
            except EnvError as exc:
                print(f"ddp_hpc: no run log: {exc}", file=sys.stderr, flush=True)
                return None
            _state.world_size = env.world_size
            _state.log = SafeLog(log_dir, env.rank, env.job_id, env.restart_count, who="ddp_hpc.report")
            # `ddp-hpc status JOBID --stacks` can then ask this rank for its threads' stacks
            _state.watch = HangWatch(_state.log, None).start()
            _state.watch.idle = _tell_held
    return _state.log


def _tell_held(silent_s: float) -> None:
    """From the hang watchdog's thread, every second: once no step came for a second after one the
    throttle held back (the rank waits in a collective for a peer that failed, or a signal that
    skips ``atexit`` is about to end it), that step's number as a ``progress`` event of phase
    ``step``, so the rank's end event and the judge's "whose last step is behind" read the step
    the rank reached, not the one a second before; ``step_at`` is when that step was (the judge's
    silence counts from it, not from this note). Only the number: the loss or a rate could be
    a GPU tensor, which this thread must not wait for; the held step event itself is still written
    by the next step or at exit."""
    held = _state.held
    if held is None or held[0] is None or held[0] == _state.told or silent_s < MIN_INTERVAL_S:
        return
    _state.told = held[0]
    if _state.log is not None and _state.log.active:
        _state.log.event("progress", phase="step", step=held[0], step_at=round(time.time() - silent_s, 3))


def close() -> None:
    """End this process's run log: stop its hang watchdog (which gives the signal wakeup fd back)
    and close the log.  The next `report` opens them again."""
    global _state
    state, _state = _state, _State()
    if state.pid == os.getpid():
        if state.watch is not None:
            state.watch.stop()
        if state.log is not None:
            state.log.close()


def last_step() -> int | None:
    """The newest step passed to `report` in this process (None before the first)."""
    return _state.step


def report(step: int | None = None, total: int | None = None, loss: Any = None, **metrics: Any) -> None:
    """Record progress: a ``step`` event at most once a second (the first and the final one,
    ``step >= total``, always).  ``loss`` and metrics may be tensors or numbers."""
    _state.explicit = True
    _record(step, total, loss, metrics)


def auto_step(step: int, fields: Callable[[], dict]) -> None:
    """The automatic step count of an instrumented script (``ddp_hpc.instrument``): like
    ``report(step=step, **fields())``, with ``fields`` called only when an event is written;
    nothing once the script has called `report` itself."""
    if not _state.explicit:
        _record(step, None, None, None, fields)


def flush_step() -> None:
    """Write the newest step the once-a-second throttle held back (at the script's exit)."""
    held, _state.held = _state.held, None
    if held is not None and _state.pid == os.getpid() and (held[4] is None or not _state.explicit):
        _state.last_write = None
        _record(*held)


def hang_watch() -> HangWatch | None:
    """This process's hang watchdog (started with its run log), None without a run log."""
    rank_log()
    return _state.watch


def world_size() -> int:
    """The number of ranks of this process's job (1 before `rank_log` found one)."""
    return _state.world_size


def _record(step: int | None, total: int | None, loss: Any, metrics: dict | None,
            fields: Callable[[], dict] | None = None) -> None:
    log = rank_log()
    if step is not None:
        _state.step = int(step)
        if _state.watch is not None:
            _state.watch.beat(_state.step)
    if log is None or not log.active:
        return
    now = time.monotonic()
    final = step is not None and total is not None and step >= total
    if _state.last_write is not None and not final and now - _state.last_write < MIN_INTERVAL_S:
        _state.held = (step, total, loss, metrics, fields)
        return
    _state.last_write, _state.held = now, None
    metrics = dict(metrics or {})
    if fields is not None:
        metrics.update(fields())
        loss = metrics.pop("loss", loss)
    epoch, lr, samples_per_s = (metrics.pop(key, None) for key in STEP_KEYS)
    extra = {key: metrics.pop(key) for key in OWN_KEYS if key in metrics}
    write_step(log, epoch=epoch, step=step, total_steps=total, loss=loss, lr=lr,
               samples_per_s=samples_per_s, metrics=metrics or None, **extra)


def write_step(log: SafeLog, **fields: Any) -> None:
    """Write one ``step`` event: the one place a script's step events (explicit or automatic)
    are written."""
    log.event("step", **fields)

