"""Checkpoints written in the background: the training thread copies the state, a thread writes it.

Why: serialising and fsyncing a state of a few GB on the training thread stops training for
seconds per checkpoint, so users checkpoint rarely and lose more steps to a fault.  Here the
training thread only copies every tensor of the state into a CPU buffer (pinned memory for a CUDA
tensor, the copy queued on the current stream and waited for by the writer); the buffers are kept
and reused by the next save of the same shapes.  A writer thread then writes that copy with
`save_checkpoint` (the one atomic write: temporary file, fsync, rename, directory fsync) and prunes
to ``keep_last`` only once the file is complete.

Rules: at most one save in flight (the next save, blocking or not, first waits for the previous
one, so the buffers are never overwritten while written); a write that failed is kept and raised,
once, as a `CheckpointError` naming the file and the error, by the next `AsyncSaver.save`, by
`AsyncSaver.wait` or by the handle's `wait` -- never lost silently.  `on_written` is called on
the writer thread when a file is complete, with its `PendingSave` (step, path, ``blocking_s``: the
training thread's seconds in `save`, waiting for the previous write included; ``write_s``: the
write's own seconds): the ``checkpoint`` event is written then.  `on_failed` is called on the
writer thread with a line that says what failed when a background write failed: the run log
tells it at once, not only at the next save, which may come much later or never (a job killed at
its time limit).  A blocking save writes on the calling thread without a copy, reports
``blocking_s == write_s``, and raises its failure at once (no `on_failed`).
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ddp_hpc.train.checkpoint import CheckpointError, checkpoint_path, save_checkpoint

__all__ = ["AsyncSaver", "PendingSave", "Snapshot"]

WAIT_TICK_S = 1.0


class Snapshot:
    """Copies of a state's tensors in CPU buffers kept from one copy to the next.

    `take` rebuilds the state's dicts, lists and tuples (so later changes to the live containers
    do not reach the copy), copies each tensor into the buffer kept for its place in the state
    (allocated again only when the shape or dtype changed) and leaves other values as they are
    (numbers, strings: immutable).  `ready` waits until queued device-to-host copies landed."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._event: Any = None

    @property
    def nbytes(self) -> int:
        """Bytes held in the kept buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def take(self, state: Any) -> Any:
        self._event = None
        copy = self._copy(state, ())
        if self._event is not None:
            self._event = torch.cuda.Event()
            self._event.record()
        return copy

    def ready(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def _copy(self, value: Any, where: tuple) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value, where)
        if isinstance(value, dict):
            return {k: self._copy(v, (*where, k)) for k, v in value.items()}
        if isinstance(value, list):
            return [self._copy(v, (*where, i)) for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return tuple(self._copy(v, (*where, i)) for i, v in enumerate(value))
        return value

    def _tensor(self, t: torch.Tensor, where: tuple) -> torch.Tensor:
        t = t.detach()
        if t.layout != torch.strided:            # sparse and the like: a plain copy each time
            return t.to("cpu", copy=True)
        cuda = t.device.type == "cuda"
        buf = self._buffers.get(where)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.is_pinned() != cuda:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
            self._buffers[where] = buf
        if cuda:
            buf.copy_(t, non_blocking=True)
            self._event = True                   # recorded once, after the last copy
        elif t.is_contiguous() and t.device.type == "cpu":
            _memcpy(buf, t)
        else:
            buf.copy_(t)
        return buf


def _memcpy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a contiguous CPU tensor's bytes with one single-threaded memcpy (numpy's, without the
    GIL): torch's ``copy_`` splits a large copy over its intra-op threads, which on cores busy
    with other work (other ranks, data workers) wait for each other: 150 MB took 0.23-0.52 s that
    way against 0.04-0.14 s here, on 2 loaded cores."""
    np.copyto(dst.reshape(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())


class PendingSave:
    """One save: `wait` returns its path once the file is complete, or raises its failure
    (``reported`` then: the saver does not raise it again)."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path
        self.blocking_s = 0.0
        self.write_s: float | None = None
        self.error: BaseException | None = None
        self.reported = False
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, tick: Callable[[], None] | None = None) -> Path:
        """Block until the write ended (calling ``tick`` about every second meanwhile); raise its
        failure as a `CheckpointError`."""
        while not self._done.wait(WAIT_TICK_S):
            if tick is not None:
                tick()
        if self.error is not None:
            self.reported = True
            raise self.failure()
        return self.path

    def failure(self) -> CheckpointError:
        e = self.error
        return CheckpointError(
            f"the checkpoint of step {self.step} was not written to {self.path}: "
            f"{type(e).__name__}: {e}",
            f"make {self.path.parent} writable, with room for the checkpoint (the checkpoints "
            "written before it are intact)")

    def _finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()


class AsyncSaver:
    """One process's checkpoint writer: `save` (blocking or not), `wait`, `close`."""

    def __init__(self, on_written: Callable[[PendingSave], None] | None = None,
                 on_failed: Callable[[str], None] | None = None) -> None:
        self.on_written, self.on_failed = on_written, on_failed
        self.snapshot = Snapshot()
        self._pending: PendingSave | None = None

    @property
    def pending(self) -> PendingSave | None:
        """The newest save, while it is written or until its failure was raised."""
        return self._pending

    def save(self, directory: str | Path, step: int, state: dict, keep_last: int, *,
             blocking: bool = False, tick: Callable[[], None] | None = None) -> PendingSave:
        """Write `state` as ``ckpt-<step>.pt`` in `directory`: after the previous save ended
        (its failure is raised here), from a copy on a writer thread, or, ``blocking``, here."""
        t0 = time.perf_counter()
        self.wait(tick)
        pending = PendingSave(step, checkpoint_path(directory, step))
        if blocking:
            self._pending = pending
            self._write(pending, directory, state, keep_last, t0)
            self.wait()
            return pending
        copy = self.snapshot.take(state)
        pending.blocking_s = time.perf_counter() - t0
        self._pending = pending
        threading.Thread(target=self._write, args=(pending, directory, copy, keep_last),
                         name=f"ddp_hpc-checkpoint-{step}", daemon=False).start()
        return pending

    def wait(self, tick: Callable[[], None] | None = None) -> Path | None:
        """Wait for the save in flight; its path (None when there was none, or when its failure
        was raised already, by its handle), or its failure."""
        pending = self._pending
        if pending is None:
            return None
        try:
            return None if pending.reported else pending.wait(tick)
        finally:
            self._pending = None

    def join(self) -> None:
        """Wait for the write in flight to end, keeping a failure for `save` / `wait` to raise."""
        if self._pending is not None:
            self._pending._done.wait()

    def close(self, warn: Callable[[str], None]) -> None:
        """Wait for the save in flight and pass a failure to ``warn`` instead of raising (when
        the run already fails for another reason)."""
        try:
            self.wait()
        except CheckpointError as e:
            warn(str(e))

    def _write(self, pending: PendingSave, directory: str | Path, state: dict, keep_last: int,
               t0: float | None = None) -> None:
        """Write and prune (the writer thread, or the caller's for a blocking save); then tell
        `on_written`.  Errors are kept on `pending` for the training thread."""
        try:
            start = time.perf_counter()
            if t0 is None:
                self.snapshot.ready()
            save_checkpoint(directory, pending.step, state, keep_last=keep_last)
            pending.write_s = time.perf_counter() - start
            if t0 is not None:                   # blocking: the caller waited for all of it
                pending.blocking_s = time.perf_counter() - t0
            if self.on_written is not None:
                self.on_written(pending)
        except BaseException as e:  # noqa: BLE001 - kept and raised on the training thread
            pending.error = e
            if t0 is None and self.on_failed is not None:
                try:
                    self.on_failed(f"{pending.failure().problem}; training goes on, and the next save "
                                   "or the end of training fails on it")
                except Exception:  # noqa: BLE001 - telling it must not hide the failure itself
                    pass
            pending._finish(e)
            return
        pending._finish()
