"""The two values a training run hands from part to part instead of long argument lists: what it
trains (`TrainParts`: built by `fit`/`run_job`, read by the Trainer and its Stepper) and where
this rank runs (`RankPlace`: read by the Trainer, its Cadence and the exact evaluation)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn


@dataclass(frozen=True, eq=False)
class TrainParts:
    """What one run trains: the plain module (never the DDP wrapper), the data, the loss, and
    the caller's optional pieces."""

    model: nn.Module
    train_data: Any                       #: a Dataset (or the opened data of io != direct)
    loss_fn: Callable
    eval_data: Any = None                 #: a Dataset to evaluate on, or None
    classification: bool = True           #: report accuracy next to the loss
    #: (epoch, start batch, per-rank batch size) -> that epoch's batches, for io != direct
    #: (data.io.make_train_batches);
    #: None: a DataLoader over DistributedSampler
    batches: Callable[[int, int], Iterable] | None = None
    on_step: Callable[[int, int], None] | None = None   #: called with (step, epoch) after each step


@dataclass(frozen=True)
class RankPlace:
    """Where this rank runs: its rank, the world size, its device, and whether a process group
    of more than one rank exists (without one, collectives are skipped)."""

    rank: int
    world: int
    device: torch.device
    distributed: bool
