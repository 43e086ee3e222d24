"""The DDP training loop: one optimizer step = `grad_accum` micro-batches, only the last synchronised.

Why it looks like a hand-written DDP loop: the toolkit must cost nothing measurable over one
(bench/overhead.py).  Per step it adds only an asynchronous one-integer all_reduce (the
preemption flag, see preempt.py) and a device-side loss accumulation; metrics are reduced across
ranks once per `log.every_n_steps` steps, in one collective.

Exactness rules kept here:
- every rank starts from the same weights (same seed, and DDP broadcasts rank 0's anyway), then
  seeds its RNGs per rank (seed + rank) for dropout / augmentation;
- the epoch's sample order is DistributedSampler(shuffle, seed).set_epoch(epoch); a resumed run
  skips exactly the micro-batches already consumed (`batch_in_epoch`), and DataLoaders get their
  own generator so creating one never draws from the global RNG (that would break bitwise resume);
- the loss of each micro-batch is divided by the number of micro-batches in its step, so 4 ranks
  x batch b x accum a give the same update as one process with batch 4ab.
"""
from __future__ import annotations

import contextlib
import math
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from ddp_hpc.config import JobConfig, config_to_dict
from ddp_hpc.train import checkpoint as ckpt
from ddp_hpc.train.metrics import ResourceSampler, all_reduce_sum, evaluate
from ddp_hpc.train.preempt import (PreemptionFlag, classify, job_end_time, requeue,
                                    slurm_end_time)
from ddp_hpc.runlogs.writer import Progress, RunLog


#: with preempt.check_every_steps=0 the flag is all-reduced about this often (seconds of training):
#: on fast steps a collective every step would cost measurable throughput, on slow steps (>= this)
#: every step is checked
PREEMPT_CHECK_S = 0.2


@dataclass
class TrainResult:
    """What a rank's training ended with. `status`: completed | preempted."""
    status: str
    step: int
    epoch: int
    loss: float | None = None
    eval_metrics: dict = field(default_factory=dict)
    reason: str | None = None          # preemption | timelimit (when preempted)
    requeued: bool = False
    checkpoint: str | None = None
    resumed_from: str | None = None
    model: Any = None                  # the plain (unwrapped) module, in-process only
    model_state: bytes | None = None   # set when the result was pickled (see __getstate__)

    def __getstate__(self) -> dict:
        """Pickle the weights as torch.save bytes instead of the module: results travel back
        from spawned ranks through a pipe, and a pickled tensor would point at shared memory of
        a process that is exiting."""
        import io
        state = dict(self.__dict__)
        if state.get("model") is not None:
            buf = io.BytesIO()
            torch.save(state["model"].state_dict(), buf)
            state["model_state"], state["model"] = buf.getvalue(), None
        return state

    def state_dict(self) -> dict:
        """The trained weights (no ``module.`` prefix), in-process or after pickling."""
        if self.model is not None:
            return self.model.state_dict()
        if self.model_state is None:
            raise ValueError("this TrainResult carries no model")
        import io
        return torch.load(io.BytesIO(self.model_state), weights_only=True)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _in_slurm(env) -> bool:
    """A Slurm job step (srun, submitit on Slurm, torchrun under srun): requeue on preemption."""
    return bool(getattr(env, "in_slurm", env.launcher == "slurm"))


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


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


class Trainer:
    """Runs one rank's share of a job. Build it, call `run()`; collectives match across ranks."""

    def __init__(self, cfg: JobConfig, ctx, model: nn.Module, train_data, eval_data, loss_fn,
                 log: RunLog, *, checkpoint_dir: str | Path, batches: Callable | None = None,
                 classification: bool = True, on_step: Callable[[int, int], None] | None = None):
        self.cfg, self.ctx, self.log = cfg, ctx, log
        self.rank, self.world = ctx.env.rank, ctx.env.world_size
        self.device = torch.device(ctx.device)
        self.module = model
        self.train_data, self.eval_data, self.loss_fn = train_data, eval_data, loss_fn
        self.ckpt_dir = Path(checkpoint_dir)
        self.classification, self.on_step = classification, on_step
        self._batches_fn = batches          # io != direct: ddp_hpc.data.io.make_train_batches
        self.distributed = _distributed()
        t = cfg.train
        if t.strategy in ("dp", "single") and self.world > 1:
            raise ValueError(f"train.strategy={t.strategy!r} runs in one process, but this job has "
                             f"world_size={self.world}.\nHINT: use train.strategy=ddp with several "
                             f"processes, or launch one process for {t.strategy}")
        if t.precision == "fp16" and self.device.type != "cuda":
            raise ValueError(f"train.precision=fp16 needs CUDA (GradScaler), but the device is "
                             f"{self.device}.\nHINT: use train.precision=bf16 on CPU")
        self.autocast = None
        if t.precision in ("bf16", "fp16"):
            dtype = torch.bfloat16 if t.precision == "bf16" else torch.float16
            self.autocast = lambda: torch.autocast(self.device.type, dtype=dtype)
        self.scaler = torch.amp.GradScaler("cuda") if t.precision == "fp16" else None
        per_rank = math.ceil(len(train_data) / self.world)       # DistributedSampler, no drop_last
        self.batches_per_epoch = math.ceil(per_rank / t.batch_size)
        self.steps_per_epoch = math.ceil(self.batches_per_epoch / t.grad_accum)
        total = t.epochs * self.steps_per_epoch
        self.total_steps = min(total, t.max_steps) if t.max_steps else total
        self.sampler = DistributedSampler(train_data, num_replicas=self.world, rank=self.rank,
                                          shuffle=True, seed=t.seed, drop_last=False)

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
        with self.autocast() if self.autocast is not None else contextlib.nullcontext():
            loss = self.loss_fn(self.model(inputs), targets)
        loss.backward()
        self.model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for k, b in self.module.named_buffers():
                b.copy_(buffers[k])
        ckpt.set_rng_state(rng)

    def _resume(self) -> tuple[str | None, dict | None]:
        """Rank 0 picks the newest valid checkpoint and tells the others; each rank loads it."""
        if not self.cfg.checkpoint.resume:
            return None, None
        found = ckpt.find_latest_valid(self.ckpt_dir, warn=self.log.warning) if self.rank == 0 else None
        box = [str(found[0]) if found else None]
        if self.distributed:
            dist.broadcast_object_list(box, src=0)
        path = box[0]
        if path is None:
            return None, None
        if self.rank == 0:
            return path, found[1]
        try:
            return path, ckpt.load_checkpoint(path)
        except Exception as e:
            raise RuntimeError(f"rank {self.rank} cannot load checkpoint {path} that rank 0 chose: "
                               f"{type(e).__name__}: {e}\nHINT: checkpoint.dir must be on a "
                               f"filesystem every node sees (it is {self.ckpt_dir})") from e

    def _state(self, epoch: int, batch_in_epoch: int) -> dict | None:
        """Collective (gathers every rank's RNG state); returns the checkpoint dict on rank 0."""
        rng = ckpt.rng_state()
        rngs = [None] * self.world
        if self.distributed:
            dist.all_gather_object(rngs, rng)
        else:
            rngs = [rng]
        if self.rank != 0:
            return None
        return {"epoch": epoch, "batch_in_epoch": batch_in_epoch,
                "model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler else None,
                "rng": rngs, "world_size": self.world, "config": config_to_dict(self.cfg),
                "time": time.time()}

    def _save(self, step: int, epoch: int, batch_in_epoch: int) -> str | None:
        state = self._state(epoch, batch_in_epoch)
        path = None
        if self.rank == 0:
            path = str(ckpt.save_checkpoint(self.ckpt_dir, step, state, self.cfg.checkpoint.keep_last))
            self.log.event("checkpoint", step=step, path=path)
            self.log.info(f"checkpoint step {step} -> {path}", console=False)
        self._last_saved = step
        return path

    # ------------------------------------------------------------------ data
    def _epoch_batches(self, epoch: int, start_batch: int):
        t, nw = self.cfg.train, self.cfg.data.num_workers
        if self._batches_fn is not None:
            return self._batches_fn(epoch, start_batch)
        self.sampler.set_epoch(epoch)
        indices = list(self.sampler)[start_batch * t.batch_size:]
        gen = torch.Generator().manual_seed(t.seed * 100003 + epoch)
        return DataLoader(self.train_data, batch_size=t.batch_size, sampler=indices,
                          num_workers=nw, pin_memory=self.device.type == "cuda",
                          drop_last=False, generator=gen, persistent_workers=False)

    # ------------------------------------------------------------------ the loop
    def run(self) -> TrainResult:
        cfg, t, log = self.cfg, self.cfg.train, self.log
        resumed_from, state = self._resume()
        if state is not None:
            self.module.load_state_dict(state["model"])
        self.model = self._wrap()
        self.optimizer = make_optimizer(cfg, self.model.parameters())
        self.scheduler = make_scheduler(cfg, self.optimizer, self.total_steps)
        step, epoch, start_batch = 0, 0, 0
        seed_everything(t.seed + self.rank)
        if state is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            if self.scaler is not None and state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])
            step, epoch, start_batch = state["step"], state["epoch"], state["batch_in_epoch"]
            if state.get("world_size") == self.world:
                ckpt.set_rng_state(state["rng"][self.rank])
            else:
                log.warning(f"world size changed from {state.get('world_size')} to {self.world}: "
                            f"restarting epoch {epoch} from its first batch with fresh RNG seeds")
                start_batch = 0
            log.info(f"resumed from {resumed_from} at step {step} (epoch {epoch}, batch {start_batch})")
        self._last_saved = step
        self._last_epoch = epoch - 1        # the last epoch trained in (for the final eval's label)
        del state

        flag = PreemptionFlag(cfg.preempt.signal).install()
        end_time = self._end_time()
        progress = Progress(self.rank, self.total_steps, step, cfg.log.progress)
        res = ResourceSampler()
        result = TrainResult("completed", step, epoch, resumed_from=resumed_from)
        try:
            result = self._loop(step, epoch, start_batch, flag, progress, res, result, end_time)
            flag.drain()         # not on errors: a peer that died may never join that collective
        finally:
            flag.restore()
            progress.close()
        if result.status == "completed":
            self._finish(result)
        result.model = self.module
        # drop the DDP wrapper now, while the process group is alive: freed later (at interpreter
        # exit, after destroy_process_group) its reducer aborts the process now and then
        self.model = None
        return result

    def _loop(self, step, epoch, start_batch, flag, progress, res, result, end_time) -> TrainResult:
        cfg, t, log = self.cfg, self.cfg.train, self.log
        model, opt, sched = self.model, self.optimizer, self.scheduler
        accum, nb = t.grad_accum, self.batches_per_epoch
        can_skip_sync = warm_up = isinstance(model, DDP)
        every = cfg.log.every_n_steps
        auto_check = cfg.preempt.check_every_steps == 0
        check_every = cfg.preempt.check_every_steps or 1    # auto: every step until measured
        win_steps = 0
        zero = torch.zeros((), device=self.device)
        win_loss, win_micro, win_samples, win_t0 = zero.clone(), 0, 0, time.perf_counter()
        params = [p for p in self.module.parameters()]
        self.step_done = step                                # read by the error event on failure
        while epoch < t.epochs and step < self.total_steps:
            ep_loss, ep_micro, ep_samples, ep_t0 = zero.clone(), 0, 0, time.perf_counter()
            micro = start_batch
            model.train()
            for inputs, targets in self._epoch_batches(epoch, start_batch):
                group_start = micro - micro % accum
                group_len = min(accum, nb - group_start)
                last = micro - group_start == group_len - 1
                inputs = inputs.to(self.device, non_blocking=True)
                targets = targets.to(self.device, non_blocking=True)
                if warm_up:                   # once per (re)start, identically on every rank
                    self._warm_up_buckets(inputs, targets)
                    warm_up = False
                sync = contextlib.nullcontext() if last or not can_skip_sync else model.no_sync()
                with sync:
                    if self.autocast is not None:
                        with self.autocast():
                            loss = self.loss_fn(model(inputs), targets)
                    else:
                        loss = self.loss_fn(model(inputs), targets)
                    scaled = loss / group_len if group_len > 1 else loss
                    if self.scaler is not None:
                        self.scaler.scale(scaled).backward()
                    else:
                        scaled.backward()
                detached = loss.detach()
                win_loss += detached
                ep_loss += detached
                n = targets.shape[0]
                win_micro += 1
                ep_micro += 1
                win_samples += n
                ep_samples += n
                micro += 1
                if not last:
                    continue
                # ---- optimizer step
                if self.scaler is not None:
                    self.scaler.unscale_(opt)
                if t.filter_zero_grads:
                    for p in params:
                        if p.grad is not None and not p.grad.any():
                            p.grad = None
                if t.clip_grad_norm:
                    torch.nn.utils.clip_grad_norm_(params, t.clip_grad_norm)
                if self.scaler is not None:
                    self.scaler.step(opt)
                    self.scaler.update()
                else:
                    opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step()
                step += 1
                self.step_done = step
                win_steps += 1
                progress.update(1)
                if self.on_step is not None:
                    self.on_step(step, epoch)
                if step % every == 0 or step == self.total_steps:
                    tot_loss, tot_micro, tot_samples, tot_time = all_reduce_sum(
                        [float(win_loss), win_micro, win_samples, time.perf_counter() - win_t0],
                        self.device)
                    result.loss = tot_loss / max(tot_micro, 1)
                    sps = tot_samples / max(tot_time / self.world, 1e-9)
                    if auto_check:      # same reduced numbers on every rank -> same interval
                        step_s = tot_time / self.world / max(win_steps, 1)
                        check_every = max(1, min(1000, int(PREEMPT_CHECK_S / max(step_s, 1e-9))))
                    log.event("step", epoch=epoch, step=step, total_steps=self.total_steps,
                              loss=result.loss, lr=sched.get_last_lr()[0], samples_per_s=sps,
                              **res.sample())
                    if progress.lines:
                        log.info(f"epoch {epoch} step {step}/{self.total_steps} "
                                 f"loss {result.loss:.4f} {sps:.0f} samples/s")
                    win_loss, win_micro, win_samples, win_t0 = zero.clone(), 0, 0, time.perf_counter()
                    win_steps = 0
                if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0 \
                        and micro < nb:
                    result.checkpoint = self._save(step, epoch, micro)
                if step >= self.total_steps:
                    break
                if step % check_every == 0 and flag.poll(self.distributed):
                    return self._preempted(flag, step, epoch, micro, nb, result, end_time)
            # ---- end of epoch (or max_steps inside it)
            finished_epoch = micro >= nb
            tot_loss, tot_micro, tot_samples, tot_time = all_reduce_sum(
                [float(ep_loss), ep_micro, ep_samples, time.perf_counter() - ep_t0], self.device)
            ep_mean = tot_loss / max(tot_micro, 1)
            ep_sps = tot_samples / max(tot_time / self.world, 1e-9)
            log.event("epoch", epoch=epoch, step=step, loss=ep_mean, samples_per_s=ep_sps)
            log.info(f"epoch {epoch} done: step {step}/{self.total_steps} loss {ep_mean:.4f} "
                     f"{ep_sps:.0f} samples/s")
            result.epoch = self._last_epoch = epoch
            if not finished_epoch:          # max_steps reached mid-epoch
                result.step = step
                if step != self._last_saved:
                    result.checkpoint = self._save(step, epoch, micro)
                return result
            epoch, start_batch = epoch + 1, 0
            result.epoch = epoch
            ev = t.eval_every_epochs
            if self.eval_data is not None and ev and epoch % ev == 0 and epoch < t.epochs:
                result.eval_metrics = self._evaluate(epoch - 1, step)
            ce, cs = cfg.checkpoint.every_epochs, cfg.checkpoint.every_steps
            if (ce and epoch % ce == 0) or (cs and step % cs == 0) or epoch >= t.epochs \
                    or step >= self.total_steps:
                result.checkpoint = self._save(step, epoch, 0)
        result.step, result.epoch = step, epoch
        if step != self._last_saved:
            result.checkpoint = self._save(step, epoch, 0)
        return result

    def _end_time(self) -> float | None:
        """When this job's time limit ends (for telling a time limit from a preemption)."""
        end = job_end_time()
        env = self.ctx.env
        if end is None and _in_slurm(env) and env.job_id:
            box = [slurm_end_time(env.job_id) if self.rank == 0 else None]
            if self.distributed:
                dist.broadcast_object_list(box, src=0)
            end = box[0]
        return end

    def _preempted(self, flag, step, epoch, micro, nb, result, end_time) -> TrainResult:
        log = self.log
        flag.drain()
        if micro >= nb:                      # the signal landed on an epoch's last step
            epoch, micro = epoch + 1, 0
        path = self._save(step, epoch, micro)
        sig = signal.Signals(flag.received).name if flag.received else None
        reason = classify(flag.received_at, end_time, self.cfg.preempt.timelimit_window_s)
        log.event("preempt", signal=sig, reason=reason, step=step)
        log.info(f"stopping at step {step}: {reason} (signal {sig or 'on another rank'}); "
                 f"checkpoint {path or 'written by rank 0'}")
        requeued = False
        env = self.ctx.env
        if self.rank == 0 and _in_slurm(env) and not flag.requeue_wanted:
            log.info("not requeuing: SIGTERM (a user's scancel, or Slurm ending or requeueing the job itself)")
        if (self.rank == 0 and _in_slurm(env) and env.job_id and self.cfg.preempt.requeue
                and flag.requeue_wanted):
            try:
                requeue(env.job_id)
                requeued = True
                log.event("requeue", job_id=env.job_id)
                log.info(f"requeued Slurm job {env.job_id}")
            except Exception as e:  # noqa: BLE001 - report, then exit with the preempt code
                log.warning(f"requeue of job {env.job_id} failed: {type(e).__name__}: {e}")
        if self.distributed:
            box = [requeued]
            dist.broadcast_object_list(box, src=0)
            requeued = bool(box[0])
        result.status, result.step, result.epoch = "preempted", step, epoch
        result.reason, result.requeued, result.checkpoint = reason, requeued, path
        return result

    def _evaluate(self, epoch: int, step: int) -> dict:
        """Exact evaluation after (0-based) `epoch`; a collective, identical on every rank."""
        t = self.cfg.train
        self._sync_buffers()
        metrics = evaluate(self.module, self.eval_data, self.loss_fn, rank=self.rank,
                           world_size=self.world, batch_size=t.eval_batch_size or t.batch_size,
                           device=self.device, autocast=self.autocast,
                           classification=self.classification, num_workers=self.cfg.data.num_workers)
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
