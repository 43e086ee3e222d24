"""One rank's training run: resume, wrap the model, step through the epochs, stop cleanly when the
ranks agree to (preemption), then evaluate and return a TrainResult.

`Trainer.run` orchestrates three parts: `Stepper` (step.py: one optimizer step of `grad_accum`
micro-batches), `Cadence` (cadence.py: logging, preemption checks, eval and checkpoint rules) and
the checkpoint state kept here.  Over a plain DDP loop a step adds only a device-side loss
accumulation and a few attribute updates; every few steps an asynchronous all_reduce of the
preemption flag (preempt.py) and, per log interval, one of the interval's numbers (cadence.py),
neither waited for on the step that starts it (bench/overhead.py measures the overhead).

Exactness rules kept here:
- every rank starts from the same weights (same seed, and DDP broadcasts rank 0's anyway), then
  seeds its RNGs per rank (seed + rank) for dropout / augmentation;
- the epoch's sample order is DistributedSampler(shuffle, seed).set_epoch(epoch)'s, through a
  sampler whose position is global (samples consumed by all ranks, data/samplers.py); a resumed
  run skips exactly the samples already consumed, also on another number of ranks (reshape.py
  keeps the global batch), and DataLoaders get their own generator so creating one never draws
  from the global RNG (that would break bitwise resume);
- the loss of each micro-batch is divided by the number of micro-batches in its step, so 4 ranks
  x batch b x accum a give the same update as one process with batch 4ab (step.py).
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from ddp_hpc.config import ConfigError, JobConfig, config_to_dict
from ddp_hpc.data.samplers import ResumableDistributedSampler
from ddp_hpc.dist import group_has_peers
from ddp_hpc.exits import signal_name
from ddp_hpc.runlogs.gpu import GpuSampler, nvml_id
from ddp_hpc.runlogs.watchdog import HangWatch, dump_after
from ddp_hpc.runlogs.writer import RunLog, StepBar
from ddp_hpc.train import checkpoint as ckpt
from ddp_hpc.train.asyncsave import AsyncSaver, PendingSave
from ddp_hpc.train.build import make_optimizer, make_precision, make_scheduler, seed_everything
from ddp_hpc.train.cadence import Cadence
from ddp_hpc.train.memsnap import MemSnapshots
from ddp_hpc.train.metrics import evaluate
from ddp_hpc.train.parts import RankPlace, TrainParts
from ddp_hpc.train.preempt import PreemptionFlag, classify, job_end_time, requeue_if_wanted
from ddp_hpc.train.reshape import ResumePlan, plan_resume, rank_rng
from ddp_hpc.train.restore import announce, node_store, restore_run
from ddp_hpc.train.result import TrainResult
from ddp_hpc.train.step import Stepper

__all__ = ["Trainer", "TrainResult", "Position", "seed_everything"]


@dataclass
class Position:
    """Where a run is: optimizer steps done, the epoch, and micro-batches consumed in that epoch."""
    step: int = 0
    epoch: int = 0
    micro: int = 0


class Trainer:
    """Runs one rank's share of a job. Build it, call `run()`; collectives match across ranks."""

    def __init__(self, cfg: JobConfig, ctx, parts: TrainParts, log: RunLog, *,
                 checkpoint_dir: str | Path):
        self.cfg, self.ctx, self.log, self.parts = cfg, ctx, log, parts
        self.rank, self.world = ctx.env.rank, ctx.env.world_size
        self.device = torch.device(ctx.device)
        self.module, self.eval_data = parts.model, parts.eval_data
        self.ckpt_dir = Path(checkpoint_dir)
        self.distributed = group_has_peers()
        self.place = RankPlace(self.rank, self.world, self.device, self.distributed)
        t = cfg.train
        if t.strategy in ("dp", "single") and self.world > 1:
            raise ConfigError(
                f"train.strategy={t.strategy!r} runs in one process, but this job has "
                f"world_size={self.world}",
                f"use train.strategy=ddp with several processes, or launch one process for "
                f"{t.strategy}")
        self.precision = make_precision(t.precision, self.device)
        self.resumed_from, self._resume_state = self._resume()     # a collective
        self.plan = self._plan(self._resume_state)
        t = self.cfg.train                                          # the layout chosen at resume
        n = len(parts.train_data)
        self.batches_per_epoch = math.ceil(math.ceil(n / self.world) / t.batch_size)  # no drop_last
        self.steps_per_epoch = math.ceil(self.batches_per_epoch / t.grad_accum)       # ceil(n / G)
        total = t.epochs * self.steps_per_epoch
        if self.plan is not None and self.plan.warning:    # another global batch from here on
            s = self._resume_state
            total = (s["step"] + (t.epochs - s["epoch"]) * self.steps_per_epoch
                     - self.plan.samples // self.plan.layout.global_batch)
        self.total_steps = min(total, t.max_steps) if t.max_steps else total
        self.sampler = ResumableDistributedSampler(n, self.world, self.rank, t.seed)
        self.pos = Position()

    @property
    def step_done(self) -> int:
        """Optimizer steps done so far (the error event reports it when training fails)."""
        return self.pos.step

    # ------------------------------------------------------------------ set-up
    def _wrap(self) -> nn.Module:
        t = self.cfg.train
        self.module.to(self.device)
        if t.strategy == "dp":
            return nn.DataParallel(self.module)
        if self.distributed and t.strategy == "ddp":
            ids = [self.device.index] if self.device.type == "cuda" else None
            return DDP(self.module, device_ids=ids, find_unused_parameters=t.find_unused_parameters,
                       static_graph=t.static_graph)
        return self.module

    def _resume(self) -> tuple[str | None, dict | None]:
        """The freshest state held anywhere (a node's memory or the newest file checkpoint, a
        collective: train/restore.py); each rank gets it."""
        self.snaps, self.restored = None, None
        if not self.cfg.checkpoint.resume:
            return None, None
        store = node_store(self.ctx.env, self.cfg.checkpoint.memory_every_steps, self.log.warning,
                           key=os.path.abspath(self.ckpt_dir), note=self.log.info)   # this run's only
        self.restored = restore_run(self.ckpt_dir, store, self.rank, self.distributed, self.log, now=False)
        if store is not None:
            self.snaps = MemSnapshots(store, rank=self.rank, local_rank=self.ctx.env.local_rank,
                                      every=self.cfg.checkpoint.memory_every_steps, device=self.device,
                                      distributed=self.distributed, warn=self.log.warning,
                                      nodes=self.restored.nodes)
        return self.restored.path, self.restored.state

    def _restore(self, state: dict, resumed_from: str) -> None:
        """Optimizer, schedule, scaler, position and this rank's RNG state from a checkpoint."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):               # none in a checkpoint of an fp32/bf16 run
            self.precision.scaler.load_state_dict(state["scaler"])
        pos, plan = self.pos, self.plan
        pos.step, pos.epoch = state["step"], state["epoch"]
        pos.micro = plan.samples // plan.layout.per_micro       # a step boundary of this layout
        rng = rank_rng(state.get("rng") or [], self.rank)   # reshape.py: another world size too
        if isinstance(rng, dict):
            ckpt.set_rng_state(rng)
        else:
            seed_everything(rng)
        if plan.written.world != self.world:
            self.log.info(f"the RNG states of {plan.written.world} ranks carried onto {self.world}: "
                          f"rank {self.rank} " + ("goes on from the old rank's" if isinstance(rng, dict)
                                                  else "is seeded from the old ranks' states"))
        elif not isinstance(rng, dict):
            self.log.info(f"rank {self.rank}'s RNG states went with its node: it is seeded from the "
                          "other ranks' states")
        self.log.info(f"resumed from {resumed_from} at step {pos.step} (epoch {pos.epoch}, "
                      f"batch {pos.micro})")

    def _plan(self, state: dict | None) -> ResumePlan | None:
        """At resume: the layout that keeps the checkpoint's global batch on this many ranks
        (reshape.py); `cfg.train` takes its per-rank batch and accumulation."""
        if state is None:
            return None
        plan = plan_resume(state, self.cfg.train, self.world)
        lay = plan.layout
        self.cfg = replace(self.cfg, train=replace(self.cfg.train, batch_size=lay.batch_size,
                                                   grad_accum=lay.grad_accum))
        self.log.info(plan.note)
        if plan.warning:
            self.log.warning(plan.warning)
        return plan

    def _state(self) -> dict | None:
        """Collective (gathers every rank's RNG state); returns the checkpoint dict on rank 0."""
        rng = ckpt.rng_state()
        rngs = [None] * self.world
        if self.distributed:
            dist.all_gather_object(rngs, rng)
        else:
            rngs = [rng]
        if self.rank != 0:
            return None
        return {**self._state_core(self.pos.epoch, self.pos.micro), "rng": rngs}

    def _state_core(self, epoch: int, micro: int) -> dict:
        """The state every rank holds alike (no RNG states): a checkpoint's, a memory snapshot's."""
        t = self.cfg.train
        return {"epoch": epoch, "batch_in_epoch": micro,
                "model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.precision.scaler.state_dict() or None,   # {} from a disabled scaler
                "world_size": self.world, "config": config_to_dict(self.cfg),
                "batch_size": t.batch_size, "grad_accum": t.grad_accum,
                "samples_in_epoch": micro * t.batch_size * self.world,
                "time": time.time()}

    def _snapshot_state(self) -> dict:
        """A memory snapshot's state: an epoch's last step counts as the next epoch's start."""
        end = self.pos.micro >= self.batches_per_epoch
        return self._state_core(self.pos.epoch + 1 if end else self.pos.epoch, 0 if end else self.pos.micro)

    def _save(self) -> None:
        """Checkpoint the current position (a collective); rank 0 writes it, with checkpoint.async
        from a copy on a background thread (asyncsave.py; a failed earlier write raises here)."""
        step, state = self.pos.step, self._state()
        path = None
        if self.rank == 0:
            self.watch.alive("checkpoint", step, every_s=0.0)   # a long save is no hang
            path = str(self.saver.save(self.ckpt_dir, step, state, self.cfg.checkpoint.keep_last,
                                       blocking=not self.cfg.checkpoint.async_,
                                       tick=self._saving).path)
        self._last_saved = step
        self.result.checkpoint = path

    def _saving(self) -> None:
        self.watch.alive("checkpoint", self.pos.step)

    def _written(self, saved: PendingSave) -> None:
        """The writer's word that a checkpoint file is complete: its event and log line."""
        self.log.event("checkpoint", step=saved.step, path=str(saved.path),
                       blocking_s=round(saved.blocking_s, 6), write_s=round(saved.write_s, 6))
        self.log.info(f"checkpoint step {saved.step} -> {saved.path}", console=False)

    # ------------------------------------------------------------------ data
    def _epoch_batches(self, epoch: int, start_batch: int):
        t, nw = self.cfg.train, self.cfg.data.num_workers
        if self.parts.batches is not None:      # io != direct: data.io.make_train_batches
            return self.parts.batches(epoch, start_batch, t.batch_size)
        self.sampler.epoch, self.sampler.start = epoch, start_batch * t.batch_size * self.world
        gen = torch.Generator().manual_seed(t.seed * 100003 + epoch)
        return DataLoader(self.parts.train_data, batch_size=t.batch_size, sampler=self.sampler,
                          num_workers=nw, pin_memory=self.device.type == "cuda",
                          drop_last=False, generator=gen, persistent_workers=False)

    # ------------------------------------------------------------------ the run
    def run(self) -> TrainResult:
        cfg, resumed_from, state = self.cfg, self.resumed_from, self._resume_state
        self._resume_state = None
        if self.restored is not None:           # after the start event (run logs' contract)
            announce(self.restored, self.log, self.rank)
        if state is not None:
            self.module.load_state_dict(state["model"])
        self.model = self._wrap()
        self.optimizer = make_optimizer(cfg, self.model.parameters())
        self.scheduler = make_scheduler(cfg, self.optimizer, self.total_steps)
        seed_everything(cfg.train.seed + self.rank)
        if state is not None:
            self._restore(state, resumed_from)
        del state
        self._last_saved = self.pos.step
        self._last_epoch = self.pos.epoch - 1   # the last epoch trained in (for the final eval's label)
        self.result = TrainResult("completed", self.pos.step, self.pos.epoch, resumed_from=resumed_from)
        self.flag = PreemptionFlag(cfg.preempt.signal).install()
        self.end_time = job_end_time(self.ctx.env, self.rank, self.distributed)
        progress = StepBar(self.rank, self.total_steps, self.pos.step, cfg.log.progress)
        cadence = Cadence(cfg, self.place, total_steps=self.total_steps, log=self.log,
                          progress=progress, flag=self.flag,
                          lr=lambda: self.scheduler.get_last_lr()[0], on_step=self.parts.on_step)
        stepper = Stepper(self.model, self.parts, self.optimizer, self.scheduler,
                          precision=self.precision, train=cfg.train,
                          batches_per_epoch=self.batches_per_epoch, device=self.device)
        cadence.compute, cadence.snapshots = stepper.compute, self.snaps   # their seconds in step events
        self.watch = HangWatch(self.log, dump_after(cfg.train.collective_timeout_s)).start()
        self.saver = AsyncSaver(on_written=self._written, on_failed=self.log.warning)   # told at once
        gpu = nvml_id(self.device)
        sampler = GpuSampler(self.log, lambda: gpu).start() if gpu is not None else None
        try:
            self._loop(cadence, stepper)
            self.flag.drain()    # not on errors: a peer that died may never join that collective
            self.saver.wait(self._saving)   # the last file is complete (or this raises) before the
            if self.snaps is not None:      # snapshots go and the signal handlers are given back
                self.snaps.finish()     # the clean end: the node's snapshots go
        except BaseException:
            self.saver.close(self.log.warning)   # the last copy still lands; its failure is told
            raise
        finally:
            if self.snaps is not None:
                self.snaps.close()
            self.watch.stop()
            if sampler is not None:
                sampler.stop()
            self.flag.restore()
            progress.close()
        result = self.result
        result.loss = cadence.loss
        if result.status == "completed":
            self._finish(result)
        result.model = self.module
        # drop the DDP wrapper now, while the process group is alive: freed later (at interpreter
        # exit, after destroy_process_group) its reducer aborts the process now and then
        self.model = stepper.model = None
        return result

    def _loop(self, cadence: Cadence, stepper: Stepper) -> None:
        """Epochs until the last one or max_steps, or until the ranks agree to stop."""
        t, pos, result = self.cfg.train, self.pos, self.result
        while pos.epoch < t.epochs and pos.step < self.total_steps:
            if self._train_epoch(cadence, stepper):
                cadence.flush()          # the last step event before the checkpoint and preempt
                self._preempted()
                return
            cadence.end_epoch(pos.epoch, pos.step)
            result.epoch = self._last_epoch = pos.epoch
            if pos.micro < self.batches_per_epoch:          # max_steps reached mid-epoch
                result.step = pos.step
                if pos.step != self._last_saved:
                    self._save()
                return
            pos.epoch, pos.micro = pos.epoch + 1, 0
            result.epoch = pos.epoch
            if self.eval_data is not None and cadence.eval_due(pos.epoch):
                result.eval_metrics = self._evaluate(pos.epoch - 1, pos.step)
                self.watch.beat(pos.step)
            if cadence.epoch_checkpoint_due(pos.epoch, pos.step):
                self._save()
        result.step, result.epoch = pos.step, pos.epoch
        if pos.step != self._last_saved:
            self._save()

    def _train_epoch(self, cadence: Cadence, stepper: Stepper) -> bool:
        """Steps through the current epoch from `pos.micro` until it ends or max_steps is reached;
        True when the ranks agreed to stop (preemption)."""
        pos = self.pos
        cadence.start_epoch()
        self.model.train()
        for inputs, targets in cadence.timed(self._epoch_batches(pos.epoch, pos.micro)):
            loss, last = stepper.micro_batch(pos.micro, inputs, targets)
            self.watch.beat(pos.step)
            cadence.add(loss, targets.shape[0])
            pos.micro += 1
            if not last:
                continue
            stepper.optimizer_step()
            pos.step += 1
            cadence.after_step(pos.step, pos.epoch)
            if self.snaps is not None:
                self.snaps.after_step(pos.step, self._snapshot_state)
            if cadence.checkpoint_due(pos.step) and pos.micro < self.batches_per_epoch:
                self._save()
            if pos.step >= self.total_steps:
                return False
            if cadence.stop_now(pos.step):
                return True
        return False

    # ------------------------------------------------------------------ preemption
    def _preempted(self) -> None:
        """Every rank: checkpoint, log why, and (rank 0, under Slurm, for the preemption signal)
        requeue the job; the result says what happened."""
        flag, pos, log, result = self.flag, self.pos, self.log, self.result
        flag.drain()
        if pos.micro >= self.batches_per_epoch:   # the signal landed on an epoch's last step
            pos.epoch, pos.micro = pos.epoch + 1, 0
        self._save()
        self.saver.wait(self._saving)          # complete before the job is requeued
        sig = signal_name(flag.received) if flag.received else None
        reason = classify(flag.received_at, self.end_time, self.cfg.preempt.timelimit_window_s,
                          flag.received)
        log.event("preempt", signal=sig, reason=reason, step=pos.step)
        log.info(f"stopping at step {pos.step}: {reason} (signal {sig or 'on another rank'}); "
                 f"checkpoint {result.checkpoint or 'written by rank 0'}")
        result.status, result.step, result.epoch, result.reason = "preempted", pos.step, pos.epoch, reason
        result.requeued = requeue_if_wanted(flag, self.ctx.env, rank=self.rank,
                                            enabled=self.cfg.preempt.requeue,
                                            distributed=self.distributed, log=log,
                                            exclude=self.cfg.preempt.exclude_failed_nodes)

    # ------------------------------------------------------------------ evaluation
    def _evaluate(self, epoch: int, step: int) -> dict:
        """Exact evaluation after (0-based) `epoch`; a collective, identical on every rank."""
        t = self.cfg.train
        self._sync_buffers()
        # each eval batch's forward is a sign of life: a long evaluation is no hang
        hook = self.module.register_forward_hook(lambda *_: self.watch.alive("eval", step))
        try:
            metrics = evaluate(self.module, self.eval_data, self.parts.loss_fn, self.place,
                               batch_size=t.eval_batch_size or t.batch_size,
                               autocast=self.precision.autocast,
                               classification=self.parts.classification,
                               num_workers=self.cfg.data.num_workers)
        finally:
            hook.remove()
        self.log.event("eval", epoch=epoch, step=step, metrics=metrics)
        self.log.info("eval after epoch {}: {}".format(
            epoch, ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                             for k, v in metrics.items())))
        return metrics

    def _sync_buffers(self) -> None:
        """Give every rank rank 0's buffers (BatchNorm running stats drift apart per rank)."""
        if self.distributed:
            for b in self.module.buffers():
                dist.broadcast(b.data, src=0)

    def _finish(self, result: TrainResult) -> None:
        if self.cfg.train.sync_buffers_at_end:
            self._sync_buffers()
        if self.eval_data is not None:
            result.eval_metrics = self._evaluate(self._last_epoch, result.step)
