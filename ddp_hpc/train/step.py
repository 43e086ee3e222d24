"""One optimizer step: `grad_accum` micro-batches, only the last one synchronised across ranks.

Why it looks like a hand-written DDP step: the toolkit must cost nothing measurable over one
(bench/overhead.py).  Every micro-batch runs forward under ``autocast()`` (a ``nullcontext`` in
fp32) and backward through ``scaler.scale`` (a pass-through when the scaler is disabled); on all
but the step's last micro-batch DDP's ``no_sync()`` skips the gradient all-reduce.  The loss of
each micro-batch is divided by the number of micro-batches in its step, so 4 ranks x batch b x
accum a give the same update as one process with batch 4ab; the epoch's last step may be shorter.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_hpc.config import TrainConfig
from ddp_hpc.instrument.compute import ComputeTimer
from ddp_hpc.train import checkpoint as ckpt
from ddp_hpc.train.build import Precision
from ddp_hpc.train.parts import TrainParts


class Stepper:
    """Runs micro-batches and optimizer steps for one rank; `model` may be the DDP wrapper of
    `parts.model` (the plain module, whose parameters and buffers are the real ones)."""

    def __init__(self, model: nn.Module, parts: TrainParts, optimizer, scheduler, *,
                 precision: Precision, train: TrainConfig, batches_per_epoch: int,
                 device: torch.device) -> None:
        self.model, self.module, self.loss_fn = model, parts.model, parts.loss_fn
        self.optimizer, self.scheduler = optimizer, scheduler
        self.autocast, self.scaler, self.device = precision.autocast, precision.scaler, device
        self.accum, self.batches_per_epoch = train.grad_accum, batches_per_epoch
        self.filter_zero_grads, self.clip_grad_norm = train.filter_zero_grads, train.clip_grad_norm
        self.params = list(self.module.parameters())
        self.can_skip_sync = isinstance(model, DDP)
        self.warm_up = self.can_skip_sync      # once per (re)start, identically on every rank
        self.compute = ComputeTimer()          # this rank's own forward time (compute_s)

    def micro_batch(self, micro: int, inputs: torch.Tensor, targets: torch.Tensor
                    ) -> tuple[torch.Tensor, bool]:
        """Forward and backward of the epoch's micro-batch number `micro`: (its detached loss,
        whether it is its step's last, after which `optimizer_step` must run)."""
        group_start = micro - micro % self.accum
        group_len = min(self.accum, self.batches_per_epoch - group_start)
        last = micro - group_start == group_len - 1
        inputs = inputs.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        if self.warm_up:
            self._warm_up_buckets(inputs, targets)
            self.warm_up = False
        sync = self.model.no_sync() if self.can_skip_sync and not last else contextlib.nullcontext()
        with sync:
            self.compute.ready()
            with self.autocast():
                loss = self.loss_fn(self.model(inputs), targets)
            scaled = loss / group_len if group_len > 1 else loss
            self.compute.backward(loss)
            self.scaler.scale(scaled).backward()
        return loss.detach(), last

    def optimizer_step(self) -> None:
        """Unscale, drop all-zero gradients and clip (when configured), step, zero, schedule."""
        self.scaler.unscale_(self.optimizer)
        if self.filter_zero_grads:
            for p in self.params:
                if p.grad is not None and not p.grad.any():
                    p.grad = None
        if self.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def _warm_up_buckets(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """One discarded forward/backward (on the first real batch) so DDP settles its buckets.

        DDP all-reduces the first iteration with buckets in parameter order, then rebuilds them
        in the order gradients became ready.  A resumed run would otherwise all-reduce its first
        step with the initial layout where the uninterrupted run used the rebuilt one; with more
        than 2 ranks the summation order per element changes and the result differs in the last
        bit.  Warming up at every (re)start makes every real step use the rebuilt layout, so a
        resumed run stays bitwise equal.  RNG states, buffers and gradients are restored."""
        rng = ckpt.rng_state()
        buffers = {k: b.detach().clone() for k, b in self.module.named_buffers()}
        with self.autocast():
            loss = self.loss_fn(self.model(inputs), targets)
        loss.backward()
        self.model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for k, b in self.module.named_buffers():
                b.copy_(buffers[k])
        ckpt.set_rng_state(rng)
