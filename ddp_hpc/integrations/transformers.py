"""Progress of a Hugging Face ``Trainer`` for ``ddp-hpc status``, with no change to the script.

`install(trainer_module)` appends `HFProgress` to ``transformers.trainer.DEFAULT_CALLBACKS``, the
list every ``Trainer`` starts its callbacks from, so each Trainer built afterwards reports; the
script-job bootstrap calls it when ``transformers.trainer`` is first imported (`ddp_hpc.integrations
.register`).  Without the bootstrap (``submit --no-instrument``, a script started another way) one
line does the same: ``trainer.add_callback(ddp_hpc.integrations.transformers.HFProgress)``.

The callback calls ``ddp_hpc.report`` after every optimizer step: the step (``state.global_step``),
the total (``state.max_steps``), the epoch, the samples per second of all ranks (the global batch,
``per_device_train_batch_size x gradient_accumulation_steps x world_size``, since the previous
event) and the newest loss and learning rate the Trainer logged (``logging_steps``: the Trainer
computes its loss only when it logs).  ``on_evaluate`` writes the metrics into an ``eval`` event.
"""
from __future__ import annotations

import functools
import time
from types import ModuleType
from typing import Any

from ddp_hpc.progress import MIN_INTERVAL_S, rank_log, report

__all__ = ["install"]

_NAME = "HFProgress"


class _ProgressHooks:
    """The Trainer hooks of the progress callback (mixed with ``TrainerCallback``)."""

    def __init__(self) -> None:
        self.loss: float | None = None
        self.lr: float | None = None
        self.samples_per_s: float | None = None
        self._window: tuple[float, int] | None = None
        self._due = 0.0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._window = (time.monotonic(), state.global_step)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        logs = logs or {}
        self.loss = logs.get("loss", self.loss)
        self.lr = logs.get("learning_rate", self.lr)
        if "loss" in logs:      # logged after the step's own report: the final step's loss counts
            self._report(state)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        now, step, total = time.monotonic(), state.global_step, state.max_steps or None
        if now < self._due and not (total is not None and step >= total):
            report(step=step, total=total)             # a heartbeat: no event is due yet
            return
        self._due = now + MIN_INTERVAL_S
        start, first = self._window or (now, step)
        if now > start and step > first:               # the rate since the previous event
            batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
            self.samples_per_s = (step - first) * batch / (now - start)
        self._window = (now, step)
        self._report(state)

    def _report(self, state: Any) -> None:
        report(step=state.global_step, total=state.max_steps or None, loss=self.loss, epoch=state.epoch,
               lr=self.lr, samples_per_s=self.samples_per_s)

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: dict | None = None,
                    **kwargs: Any) -> None:
        log = rank_log()
        if metrics and log is not None:
            log.event("eval", epoch=state.epoch, step=state.global_step, metrics=dict(metrics))


@functools.cache
def _progress_class() -> type:
    from transformers.trainer_callback import TrainerCallback

    return type(_NAME, (_ProgressHooks, TrainerCallback), {
        "__module__": __name__, "__qualname__": _NAME, "__doc__": "ddp_hpc's progress for ddp-hpc status."})


def __getattr__(name: str) -> type:
    """`HFProgress`, built on first use (importing transformers)."""
    if name == _NAME:
        return _progress_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def install(trainer_module: ModuleType) -> None:
    """Add `HFProgress` to ``trainer_module.DEFAULT_CALLBACKS`` (once)."""
    defaults = trainer_module.DEFAULT_CALLBACKS
    if _progress_class() not in defaults:
        defaults.append(_progress_class())
