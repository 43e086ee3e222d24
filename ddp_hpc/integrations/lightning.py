"""Progress of a Lightning script for ``ddp-hpc status``, with no change to the script.

setup.cfg declares `lightning_callbacks` and `pytorch_lightning_callbacks` as entry points of the
groups ``lightning.pytorch.callbacks_factory`` and ``pytorch_lightning.callbacks_factory``; every
Lightning ``Trainer`` calls each factory once and adds what it returns to its callbacks.  Inside a
ddp_hpc job (``$DDP_HPC_LOG_DIR`` set) the factory returns one `LightningProgress` (or
`PytorchLightningProgress`, on the older package's ``Callback``); outside one it returns nothing,
and nothing of ddp_hpc is imported beyond this module.

The callback calls ``ddp_hpc.report`` after every training batch: the optimizer step
(``trainer.global_step``), the total (``trainer.estimated_stepping_batches``; none when it is
unbounded), the epoch, the training loss, the first optimizer's learning rate, the samples per
second of all ranks (batch size found in the batch, since the previous event, an epoch's
validation left out) and the numbers logged with ``self.log`` (``trainer.callback_metrics``, read only
when an event is due).  After each validation (not the sanity check) the metrics that validation
logged go into an ``eval`` event.  ``report`` writes a ``step`` event at most once a second.
"""
from __future__ import annotations

import functools
import importlib
import math
import time
from typing import Any

from ddp_hpc.env import job_facts
from ddp_hpc.parsing import to_float
from ddp_hpc.progress import MIN_INTERVAL_S, STEP_KEYS, rank_log, report

__all__ = ["lightning_callbacks", "pytorch_lightning_callbacks", "in_job"]

#: class name -> the package whose ``Callback`` it extends
_BASES = {"LightningProgress": "lightning.pytorch", "PytorchLightningProgress": "pytorch_lightning"}
#: report's own keywords: a logged metric of one of these names is left out of `metrics`
_RESERVED = {"step", "total", "loss", *STEP_KEYS}


def in_job() -> bool:
    """True inside a ddp_hpc job: the run log directory is known."""
    return job_facts().log_dir is not None


def lightning_callbacks() -> list:
    """Entry point of ``lightning.pytorch.callbacks_factory``."""
    return [_progress_class("LightningProgress")()] if in_job() else []


def pytorch_lightning_callbacks() -> list:
    """Entry point of ``pytorch_lightning.callbacks_factory``."""
    return [_progress_class("PytorchLightningProgress")()] if in_job() else []


def _loss(outputs: Any) -> Any:
    if isinstance(outputs, dict):
        outputs = outputs.get("loss")
    return outputs if hasattr(outputs, "detach") or isinstance(outputs, (int, float)) else None


def _lr(trainer: Any) -> float | None:
    try:
        return float(trainer.optimizers[0].param_groups[0]["lr"])
    except (AttributeError, IndexError, KeyError, TypeError):
        return None


def _batch_size(batch: Any) -> int:
    """The first dimension of the first tensor in a batch (tensor, sequence or mapping), else 0."""
    if hasattr(batch, "shape"):
        return int(batch.shape[0]) if len(batch.shape) else 0
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    return next((n for n in map(_batch_size, items) if n), 0)


class _ProgressHooks:
    """The Lightning hooks of the progress callback (mixed with the package's ``Callback``)."""

    def __init__(self) -> None:
        self.total: int | None = None
        self.samples_per_s: float | None = None
        self._window = (time.monotonic(), 0)
        self._samples = 0
        self._due = 0.0
        self._before: dict = {}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        estimate = trainer.estimated_stepping_batches
        self.total = int(estimate) if math.isfinite(estimate) else None

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._window, self._samples = (time.monotonic(), 0), 0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        now, step = time.monotonic(), trainer.global_step
        self._samples += _batch_size(batch) * trainer.world_size
        if now < self._due and not (self.total is not None and step >= self.total):
            report(step=step, total=self.total)        # a heartbeat: no event is due yet
            return
        self._due = now + MIN_INTERVAL_S
        start, counted = self._window
        if now > start and self._samples > counted:    # the rate since the previous event
            self.samples_per_s = (self._samples - counted) / (now - start)
        self._window = (now, self._samples)
        metrics = {k: v for k, v in trainer.callback_metrics.items() if k not in _RESERVED}
        report(step=step, total=self.total, loss=_loss(outputs), epoch=trainer.current_epoch,
               lr=_lr(trainer), samples_per_s=self.samples_per_s, **metrics)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._before = dict(trainer.callback_metrics)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.sanity_checking:
            return
        # what this validation logged: the values that are new objects since it started
        metrics = {k: to_float(v) for k, v in trainer.callback_metrics.items() if self._before.get(k) is not v}
        log = rank_log()
        if metrics and log is not None:
            log.event("eval", epoch=trainer.current_epoch, step=trainer.global_step, metrics=metrics)


@functools.cache
def _progress_class(name: str) -> type:
    base = importlib.import_module(_BASES[name]).Callback
    return type(name, (_ProgressHooks, base), {"__module__": __name__, "__qualname__": name,
                                                "__doc__": "ddp_hpc's progress for ddp-hpc status."})


def __getattr__(name: str) -> type:
    """`LightningProgress` and `PytorchLightningProgress`, built on first use (pickle finds them)."""
    if name in _BASES:
        return _progress_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
