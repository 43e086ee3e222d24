"""The automatic step heartbeat of an instrumented script, installed once the script has imported
torch (never before: a script that does not use torch runs as it would without us).

- **Steps** come from PyTorch's global optimizer hook
  (``torch.optim.optimizer.register_optimizer_step_post_hook``). Several optimizers stepped in one
  training step (a GAN's generator and discriminator, two optimizers over different parameter
  groups) count one step: a new step begins when an optimizer that already stepped in the current
  one steps again. Each step beats the rank's hang watchdog and, from the second on (a script
  that calls ``report`` itself does so after its first step), goes to ``ddp_hpc.report``'s
  ``auto_step`` (at most one ``step`` event a second; none once the script calls ``report``).
- **Data wait**: the time spent in ``next()`` on a ``DataLoader``'s iterator, per step (``data_s``,
  the rank's own time: what status compares to find a straggler), and the batches' sizes
  (``samples_per_s``: this rank's rate times the world size).
- **Compute**: the rank's own forward time per step (``compute_s``,
  `ddp_hpc.instrument.compute`): from its input being ready to ``backward()``, no collective in
  it; what status compares to find a rank that computes slower than the others.
- **Loss**: the one-element tensor ``.backward()`` was last called on (unscaled when it came from
  ``GradScaler.scale``); turned into a number only when an event is written.
- **GPU samples**: ``gpu`` events from NVML every 10 s in a thread of their own
  (`ddp_hpc.runlogs.gpu`), for the GPU the rank's ``backward()`` ran on; none without one.
- **Collective timeout**: the timeout ``init_process_group`` was given (else PyTorch's default for
  the backend), so the watchdog writes every thread's stack before it runs out.
"""
from __future__ import annotations

import atexit
import functools
import time
from types import ModuleType
from typing import Any

from ddp_hpc.instrument.compute import ComputeTimer
from ddp_hpc.progress import auto_step, flush_step, hang_watch, last_step, rank_log, world_size
from ddp_hpc.runlogs.gpu import GpuSampler, nvml_id
from ddp_hpc.runlogs.startup import mark_rendezvous, rendezvous_fields
from ddp_hpc.runlogs.watchdog import dump_after

__all__ = ["StepCounter", "install"]

#: the collective timeout assumed when the backend's default cannot be found (PyTorch's 30 min)
DEFAULT_TIMEOUT_S = 1800.0


class StepCounter:
    """Training steps from optimizer steps, and what an event says about the steps since the last."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.count = 0
        self._stepped: set[int] = set()
        self.optimizer: Any = None
        self.since: float | None = None   # when the last event's interval ended (at its last step)
        self.at: float | None = None      # when the newest step ended
        self.steps = 0                    # steps since then
        self.data_s = 0.0                 # seconds in DataLoader next() since then
        self.fetched = False              # a DataLoader was used at all
        self.samples = 0
        self.loss: Any = None
        self.scaled: tuple[Any, Any] | None = None   # (scaled, unscaled) from GradScaler.scale
        self.compute = ComputeTimer(clock)

    def stepped(self, optimizer: Any) -> bool:
        """An optimizer stepped; True when that began a new training step."""
        key = id(optimizer)
        if key in self._stepped:
            self._stepped.clear()
        new = not self._stepped
        self._stepped.add(key)
        if new:
            self.at = self.clock()
            self.count += 1
            self.steps += 1
            self.optimizer = optimizer
        return new

    def fields(self, world_size: int = 1) -> dict:
        """The step event's fields for the steps since the last event (rates from the second
        event on: the first interval holds the script's start-up). An interval ends at its last
        step, not when its event is written: the throttle's held step is written at the script's
        exit, after an exception and its peers' teardown, and its rate is that of the training
        (a crashed job's final rate read 1.87 steps/s against 6.2 while it ran)."""
        now = self.at if self.at is not None else self.clock()
        out: dict = {"loss": _number(self.loss), "lr": _lr(self.optimizer)}
        dt = now - self.since if self.since is not None else 0.0
        if dt > 0 and self.steps:
            out["steps_per_s"] = round(self.steps / dt, 4)
            if self.samples:
                out["samples_per_s"] = round(self.samples * world_size / dt, 3)
        if self.fetched and self.steps:
            out["data_s"] = round(self.data_s / self.steps, 6)
        if (compute_s := self.compute.take(self.steps)) is not None:
            out["compute_s"] = round(compute_s, 6)
        self.since, self.steps, self.data_s, self.samples = now, 0, 0.0, 0
        return out


def _number(value: Any) -> float | None:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def _lr(optimizer: Any) -> float | None:
    try:
        return _number(optimizer.param_groups[0].get("lr")) if optimizer is not None else None
    except (AttributeError, IndexError, TypeError):
        return None


def _batch_size(batch: Any, depth: int = 0) -> int:
    """The leading dimension of the first tensor in a batch (a tensor, a tuple / list / dict of
    them, one level deep), else 0."""
    shape = getattr(batch, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else 0
    if depth < 2:
        if isinstance(batch, (list, tuple)) and batch:
            return _batch_size(batch[0], depth + 1)
        if isinstance(batch, dict) and batch:
            return _batch_size(next(iter(batch.values())), depth + 1)
    return 0


def install(torch: ModuleType, counter: StepCounter | None = None) -> StepCounter:
    """Hook ``torch`` (imported by the script): optimizer steps, DataLoader waits, the loss and
    the collective timeout. Also opens the rank's run log and starts its hang watchdog."""
    counter = counter or StepCounter()
    hang_watch()
    world = world_size()
    if (log := rank_log()) is not None and log.active:   # the rank's GPU, once it used one
        GpuSampler(log, lambda: nvml_id(counter.compute.device)).start()

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:  # noqa: ARG001 - hook API
        counter.compute.ready()
        if not counter.stepped(optimizer):
            return
        if counter.count > 1:
            auto_step(counter.count, lambda: counter.fields(world))
        elif (watch := hang_watch()) is not None:   # a script that calls report() does so after
            counter.fields(world)                   # its first step: events from the second on
            watch.beat(1)

    from torch.optim.optimizer import register_optimizer_step_post_hook
    register_optimizer_step_post_hook(after_step)
    _hook_loader(counter)
    _hook_loss(torch, counter)
    _hook_timeout()
    atexit.register(_at_exit)
    return counter


def _at_exit() -> None:
    """The script's interpreter is ending: the last step (when the throttle held it back), then a
    ``progress`` event of phase ``exit``: the supervisor calls no hang while a rank shuts down
    (torch's teardown can take seconds)."""
    flush_step()
    if (log := rank_log()) is not None:
        log.event("progress", phase="exit", step=last_step())


def _hook_loader(counter: StepCounter) -> None:
    from torch.utils.data import dataloader
    cls = dataloader._BaseDataLoaderIter   # noqa: SLF001 - every DataLoader iterator's base
    real = cls.__next__

    @functools.wraps(real)
    def __next__(self):  # noqa: ANN001, N807
        t0 = counter.clock()
        try:
            batch = real(self)
        finally:
            counter.data_s += counter.clock() - t0
            counter.fetched = True
        counter.samples += _batch_size(batch)
        counter.compute.ready()
        return batch
    cls.__next__ = __next__


def _hook_loss(torch: ModuleType, counter: StepCounter) -> None:
    real_backward = torch.Tensor.backward

    @functools.wraps(real_backward)
    def backward(self, *args, **kwargs):  # noqa: ANN001
        counter.compute.backward(self)
        if self.numel() == 1:
            scaled = counter.scaled
            counter.loss = scaled[1] if scaled is not None and scaled[0] is self else self.detach()
        return real_backward(self, *args, **kwargs)
    torch.Tensor.backward = backward

    scaler = getattr(getattr(torch, "amp", None), "GradScaler", None)
    if scaler is None:
        return
    real_scale = scaler.scale

    @functools.wraps(real_scale)
    def scale(self, outputs):  # noqa: ANN001
        out = real_scale(self, outputs)
        if getattr(outputs, "numel", None) is not None and outputs.numel() == 1:
            counter.scaled = (out, outputs.detach())
        return out
    scaler.scale = scale


def _hook_timeout() -> None:
    """Wrap ``init_process_group`` so the watchdog learns the collective timeout."""
    import torch.distributed as dist
    if not dist.is_available():
        return
    from torch.distributed import distributed_c10d as c10d
    real = c10d.init_process_group

    @functools.wraps(real)
    def init_process_group(*args, **kwargs):
        called = time.time()
        out = real(*args, **kwargs)
        mark_rendezvous(called)   # the restart phases' import and rendezvous (runlogs/startup.py)
        if (log := rank_log()) is not None:
            log.event("rendezvous", **(rendezvous_fields() or {}))
        timeout = kwargs.get("timeout", args[2] if len(args) > 2 else None)
        try:
            seconds = (timeout or c10d._get_default_timeout(c10d.get_backend())).total_seconds()  # noqa: SLF001
        except Exception:  # noqa: BLE001 - a backend this torch cannot name: its usual default
            seconds = DEFAULT_TIMEOUT_S
        watch = hang_watch()
        if watch is not None:
            watch.dump_after_s = dump_after(seconds)
        return out
    c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group
