"""What happens between optimizer steps: every N steps, at a preemption check, at an epoch's end.

Why it costs nothing measurable per step: losses are summed on the device (no host sync); a log
interval's numbers are summed across ranks by one all_reduce that is started at its last step
and read back at the next step boundary (it runs while that step computes), after which its
``step`` event is written; the preemption flag is all-reduced asynchronously every
``check_every`` steps (see preempt.py); process resources are sampled at most once a second.  With
``preempt.check_every_steps=0`` the check interval follows the measured step time: every step
until the first log interval's numbers are back, then about every `PREEMPT_CHECK_S` seconds of
training.  Every rank reads the reduced numbers at the same step and computes the same interval
from them, so collectives always match.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from ddp_hpc.config import JobConfig
from ddp_hpc.instrument.compute import ComputeTimer
from ddp_hpc.runlogs.writer import RunLog, StepBar
from ddp_hpc.train.metrics import AsyncSum, ResourceSampler, all_reduce_sum
from ddp_hpc.train.parts import RankPlace
from ddp_hpc.train.preempt import PreemptionFlag

#: with preempt.check_every_steps=0 the flag is all-reduced about this often (seconds of training):
#: on fast steps a collective every step would cost measurable throughput, on slow steps (>= this)
#: every step is checked
PREEMPT_CHECK_S = 0.2


class Window:
    """Running sums over a span of micro-batches (a log interval or an epoch), loss on the device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.zero = torch.zeros((), device=device)
        self.reset()

    def reset(self) -> None:
        self.loss, self.micro, self.samples, self.steps = self.zero.clone(), 0, 0, 0
        self.t0 = time.perf_counter()

    def add(self, loss: torch.Tensor, samples: int) -> None:
        self.loss += loss
        self.micro += 1
        self.samples += samples

    def reduce(self, world: int) -> tuple[float, float, float]:
        """Collective: (mean loss per micro-batch, samples/s, seconds per rank) over all ranks."""
        return _means(all_reduce_sum(
            [float(self.loss), self.micro, self.samples, time.perf_counter() - self.t0], self.device),
            world)

    def start_reduce(self) -> AsyncSum:
        """Collective, not waited for: the sums of `reduce`, read later with `_means`."""
        return AsyncSum(self.loss, [self.micro, self.samples, time.perf_counter() - self.t0],
                        self.device)


def _means(sums: list[float], world: int) -> tuple[float, float, float]:
    loss, micro, samples, seconds = sums
    per_rank = seconds / world
    return loss / max(micro, 1), samples / max(per_rank, 1e-9), per_rank


@dataclass
class _Interval:
    """A finished log interval whose cross-rank sums are under way, and what its event needs."""
    step: int
    epoch: int
    steps: int
    lr: float
    data_s: float
    compute_s: float | None
    snapshot_s: float | None
    resources: dict
    sums: AsyncSum


class Cadence:
    """Logging, the preemption check interval and the checkpoint/eval rules of one rank's run."""

    def __init__(self, cfg: JobConfig, place: RankPlace, *, total_steps: int, log: RunLog,
                 progress: StepBar, flag: PreemptionFlag, lr: Callable[[], float],
                 on_step: Callable[[int, int], None] | None) -> None:
        self.cfg, self.total_steps, self.world = cfg, total_steps, place.world
        self.log, self.progress, self.flag, self.distributed = log, progress, flag, place.distributed
        self.lr, self.on_step = lr, on_step or (lambda step, epoch: None)
        self.every = cfg.log.every_n_steps
        self.auto_check = cfg.preempt.check_every_steps == 0
        self.check_every = cfg.preempt.check_every_steps or 1    # auto: every step until measured
        self.interval, self.this_epoch = Window(place.device), Window(place.device)
        self.resources = ResourceSampler()
        self.loss: float | None = None       # mean loss of the newest log interval, all ranks
        self.data_wait = 0.0                 # this rank's seconds waiting for batches, this interval
        #: this rank's own forward time (the `Stepper`'s ComputeTimer, set by the loop)
        self.compute: ComputeTimer | None = None
        self.snapshots = None     # the run's MemSnapshots: their seconds on the training thread (goodput)
        self._pending: _Interval | None = None

    def timed(self, batches):
        """``batches``, adding the time each one took to arrive to `data_wait`: this rank's own
        time (step events are written after a collective, so their times are the same on every
        rank; a rank with a slow loader shows here)."""
        it = iter(batches)
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            self.data_wait += time.perf_counter() - t0
            yield item

    def start_epoch(self) -> None:
        self.this_epoch.reset()

    def add(self, loss: torch.Tensor, samples: int) -> None:
        """After each micro-batch."""
        self.interval.add(loss, samples)
        self.this_epoch.add(loss, samples)

    def after_step(self, step: int, epoch: int) -> None:
        """After each optimizer step: progress, the caller's hook, the previous log interval's
        step event, and every N steps the start of this interval's reduction (a collective)."""
        self.interval.steps += 1
        self.progress.update(1)
        self.on_step(step, epoch)
        self.flush()
        if step % self.every == 0 or step == self.total_steps:
            w = self.interval
            data_s = self.data_wait / max(w.steps, 1)
            self.data_wait = 0.0
            compute_s = self.compute.take(w.steps) if self.compute is not None else None
            snapshot_s = self.snapshots.take_spent() if self.snapshots is not None else None
            self._pending = _Interval(step, epoch, w.steps, self.lr(), round(data_s, 6),
                                      None if compute_s is None else round(compute_s, 6),
                                      None if snapshot_s is None else round(snapshot_s, 6),
                                      self.resources.sample(), w.start_reduce())
            w.reset()

    def flush(self) -> None:
        """Write the step event of the newest log interval, once its sums are back.  Every rank
        calls it at the same steps (the next step, an epoch's end, the end of training): it may
        wait for the collective, and it sets the automatic preemption check interval."""
        p, self._pending = self._pending, None
        if p is None:
            return
        self.loss, sps, seconds = _means(p.sums.result(), self.world)
        if self.auto_check:      # same reduced numbers on every rank, same step -> same interval
            step_s = seconds / max(p.steps, 1)
            self.check_every = max(1, min(1000, int(PREEMPT_CHECK_S / max(step_s, 1e-9))))
        self.log.event("step", epoch=p.epoch, step=p.step, total_steps=self.total_steps,
                       loss=self.loss, lr=p.lr, samples_per_s=sps, data_s=p.data_s, compute_s=p.compute_s,
                       **({} if p.snapshot_s is None else {"snapshot_s": p.snapshot_s}), **p.resources)
        if self.progress.lines:
            self.log.info(f"epoch {p.epoch} step {p.step}/{self.total_steps} "
                          f"loss {self.loss:.4f} {sps:.0f} samples/s")

    def checkpoint_due(self, step: int) -> bool:
        """A mid-run checkpoint after this step (checkpoint.every_steps)."""
        every = self.cfg.checkpoint.every_steps
        return bool(every) and step % every == 0

    def stop_now(self, step: int) -> bool:
        """Collective at check steps: True on every rank once all ranks agreed to stop."""
        return step % self.check_every == 0 and self.flag.poll(self.distributed)

    def end_epoch(self, epoch: int, step: int) -> None:
        """At an epoch's end (or where max_steps ended it): the epoch event (a collective), after
        the step event of its last log interval."""
        self.flush()
        loss, sps, _ = self.this_epoch.reduce(self.world)
        self.log.event("epoch", epoch=epoch, step=step, loss=loss, samples_per_s=sps)
        self.log.info(f"epoch {epoch} done: step {step}/{self.total_steps} loss {loss:.4f} "
                      f"{sps:.0f} samples/s")

    def eval_due(self, epochs_done: int) -> bool:
        """Evaluate after this many finished epochs (not after the last: the final eval runs then)."""
        every = self.cfg.train.eval_every_epochs
        return bool(every) and epochs_done % every == 0 and epochs_done < self.cfg.train.epochs

    def epoch_checkpoint_due(self, epochs_done: int, step: int) -> bool:
        """A checkpoint at the start of epoch `epochs_done`: every_epochs, every_steps, or the end."""
        ce, cs = self.cfg.checkpoint.every_epochs, self.cfg.checkpoint.every_steps
        return bool((ce and epochs_done % ce == 0) or (cs and step % cs == 0)
                    or epochs_done >= self.cfg.train.epochs or step >= self.total_steps)
