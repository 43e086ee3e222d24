"""The pieces a run is built from: seeds, optimizer, learning-rate schedule and numeric precision.

Precision is two always-present objects, so the step has no precision branches: ``autocast()``
returns ``torch.autocast`` for bf16/fp16 and ``contextlib.nullcontext()`` for fp32, and the
``GradScaler`` is constructed with ``enabled=(precision == "fp16")`` (a disabled scaler's scale,
unscale_, step and update pass straight through to the loss and the optimizer).
"""
from __future__ import annotations

import contextlib
import math
import random
from dataclasses import dataclass
from typing import Callable, ContextManager

import numpy as np
import torch

from ddp_hpc.config import ConfigError, JobConfig

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def make_optimizer(cfg: JobConfig, params) -> torch.optim.Optimizer:
    o = cfg.optim
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    cls = torch.optim.Adam if o.name == "adam" else torch.optim.AdamW
    return cls(params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)


def make_scheduler(cfg: JobConfig, optimizer, total_steps: int):
    s = cfg.schedule

    def factor(step: int) -> float:   # a plain function: LambdaLR's state_dict stays tensor-free
        if s.warmup_steps and step < s.warmup_steps:
            return (step + 1) / s.warmup_steps
        if s.name == "cosine":
            span = max(1, total_steps - s.warmup_steps)
            progress = min(1.0, (step - s.warmup_steps) / span)
            return s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        if s.name == "step":
            return s.gamma ** ((step - s.warmup_steps) // s.step_size)
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@dataclass(frozen=True)
class Precision:
    """train.precision as the step uses it: the forward pass runs under ``autocast()``, the
    backward pass through ``scaler`` (both pass-throughs in fp32)."""

    autocast: Callable[[], ContextManager]
    scaler: torch.amp.GradScaler


def make_precision(precision: str, device: torch.device) -> Precision:
    """The autocast context factory and gradient scaler for train.precision on `device`."""
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError(
            f"train.precision=fp16 needs CUDA (GradScaler), but the device is {device}",
            "use train.precision=bf16 on CPU")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"train.precision=bf16 is not supported by {torch.cuda.get_device_name(device)} "
            f"({device})", "use train.precision=fp16 (with GradScaler) or fp32 on this GPU")
    dtype = _AUTOCAST_DTYPES.get(precision)
    autocast = contextlib.nullcontext
    if dtype is not None:
        autocast = lambda: torch.autocast(device.type, dtype=dtype)  # noqa: E731
    return Precision(autocast, torch.amp.GradScaler("cuda", enabled=precision == "fp16"))
