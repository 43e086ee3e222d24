"""A rank's own compute per step, with no collective in the measured span: what status compares
to find a rank that computes slower than the others (``compute_s`` on step events; docs/scripts.md,
"Compute time").

Under DDP every rank's step lasts as long as the slowest rank's, because the gradient all-reduce
in ``backward()`` waits for it; so step times cannot tell a slow rank apart, and neither can any
span that holds a ``backward()`` or an optimizer step after it. The span measured here is the
**forward**: it starts when the step's input is ready (a ``DataLoader``'s ``next()`` returned,
or, for a script without one, the previous optimizer step ended: the later of the two) and ends
when ``backward()`` is called on it. A data wait is never in it (that is ``data_s``). A step with
several such spans (gradient accumulation, a GAN's two forwards) counts their sum.

- On the CPU the span is the clock's (``time.perf_counter``).
- On a GPU the CPU only queues kernels, so its clock says little about the GPU's work: once a
  ``backward()`` ran on a CUDA tensor, each span is a pair of CUDA events recorded on the current
  stream, read later without waiting (``Event.query()``); a pair whose work has not finished yet
  is read at a later event.
"""
from __future__ import annotations

import collections
import time
from typing import Any, Callable

__all__ = ["ComputeTimer"]

#: CUDA event pairs still running that are kept at most (older ones are dropped unread)
MAX_PENDING = 64


class ComputeTimer:
    """The forward spans of one rank's steps (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.cuda: Any = None            # torch.cuda once a backward() ran on a CUDA tensor
        self.device: Any = None          # that tensor's device (the rank's GPU)
        self._start: Any = None          # the open span's start: a clock reading or a CUDA event
        self._spans = 0                  # spans ended since the last `take`
        self._sum = 0.0                  # seconds of the spans read since the last `take`
        self._read = 0                   # spans read since the last `take`
        self._pending: collections.deque = collections.deque(maxlen=MAX_PENDING)
        self._pool: list = []

    def ready(self) -> None:
        """The step's input is ready (a batch fetched, or the previous optimizer step ended)."""
        if self.cuda is None:
            self._start = self.clock()
        else:
            self._start = self._event()

    def backward(self, tensor: Any) -> None:
        """``backward()`` was called on ``tensor``: the open span ends (once)."""
        start, self._start = self._start, None
        if start is None:
            return
        self._spans += 1
        if isinstance(start, float):
            if self.cuda is None and getattr(tensor, "is_cuda", False):
                self._use_cuda(tensor)   # this span's CPU time says nothing: not counted
                self._spans -= 1
                return
            self._sum += self.clock() - start
            self._read += 1
        else:
            self._pending.append((start, self._event()))

    def take(self, steps: int) -> float | None:
        """Seconds of compute per training step since the last call, over ``steps`` steps; None
        when no span was read. Spans not yet read (CUDA work still running) stand for the mean
        of the ones read."""
        self._collect()
        spans, total, read = self._spans, self._sum, self._read
        self._spans, self._sum, self._read = 0, 0.0, 0
        if not read or steps <= 0:
            return None
        return total / read * max(spans, read) / steps

    def _collect(self) -> None:
        while self._pending:
            start, end = self._pending[0]
            if not end.query():
                break
            self._pending.popleft()
            self._sum += start.elapsed_time(end) / 1000.0
            self._read += 1
            self._pool += [start, end]

    def _event(self) -> Any:
        event = self._pool.pop() if self._pool else self.cuda.Event(enable_timing=True)
        event.record(self.cuda.current_stream(self.device))
        return event

    def _use_cuda(self, tensor: Any) -> None:
        import torch
        self.cuda = torch.cuda
        self.device = tensor.device
