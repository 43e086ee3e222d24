"""Cross-rank reductions, exact distributed evaluation, and process resource samples.

Why exact evaluation needs its own sampler: DistributedSampler pads the index list so every rank
gets the same count, duplicating samples when len(dataset) is not divisible by the world size, so a
mean over ranks is biased.  Here every rank takes indices ``rank, rank + W, ...`` with no padding,
sums (not averages) loss and correct predictions and counts samples, and one all_reduce(SUM) of
those float64 sums gives exactly the single-process numbers.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, ContextManager, Sized

import psutil
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Sampler

from ddp_hpc.dist import group_has_peers
from ddp_hpc.train.parts import RankPlace


class UnpaddedDistributedSampler(Sampler[int]):
    """Indices rank, rank+W, rank+2W, ... of range(len(dataset)): each sample exactly once overall."""

    def __init__(self, dataset: Sized, num_replicas: int, rank: int) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside [0, {num_replicas})")
        self.n, self.num_replicas, self.rank = len(dataset), num_replicas, rank

    def __iter__(self):
        return iter(range(self.rank, self.n, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.n, self.num_replicas))


def all_reduce_sum(values: list[float], device: torch.device | str = "cpu") -> list[float]:
    """Sum a few numbers over all ranks in one collective (float64: exact for counts < 2**53)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if group_has_peers():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


class AsyncSum:
    """Sum a device scalar and a few host numbers over all ranks without stopping the step path.

    The constructor issues one all_reduce(SUM, async_op=True) and returns at once; `result()`
    waits for it, typically one step later, when it has long finished.  Nothing here makes the
    host wait for the device: the device scalar is copied into the vector on the device, the host
    numbers are written with scalar fills (no host-to-device copy), and on CUDA the reduced vector
    is copied into pinned host memory behind an event, so `result()` waits for that collective and
    copy only, not for the steps queued after it.  Every rank must create one where the others do
    and call `result()` at the same program point (it may complete a collective)."""

    def __init__(self, device_value: torch.Tensor, host_values: list[float],
                 device: torch.device) -> None:
        vec = torch.empty(1 + len(host_values), dtype=torch.float64, device=device)
        vec[0] = device_value
        for i, v in enumerate(host_values, 1):
            vec[i] = v
        self.work = dist.all_reduce(vec, op=dist.ReduceOp.SUM, async_op=True) if group_has_peers() else None
        self.event = None
        self.host = vec
        if vec.is_cuda:
            if self.work is not None:
                self.work.wait()         # NCCL: the current stream waits for it, not the host
                self.work = None
            self.host = torch.empty(vec.shape, dtype=vec.dtype, pin_memory=True)
            self.host.copy_(vec, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def result(self) -> list[float]:
        """The sums, identical on every rank (waits for the collective if still running)."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset, loss_fn: Callable, place: RankPlace, *, batch_size: int,
             autocast: Callable[[], ContextManager] = contextlib.nullcontext, classification: bool = True,
             num_workers: int = 0) -> dict:
    """Exact loss/accuracy over `dataset` split across `place`'s ranks; identical on every rank.

    `model` must be the plain module (not the DDP wrapper): ranks see different batch counts and
    DDP's per-forward buffer broadcast would then wait forever."""
    was_training = model.training
    model.eval()
    device = place.device
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                        sampler=UnpaddedDistributedSampler(dataset, place.world, place.rank),
                        pin_memory=device.type == "cuda")
    loss_sum = correct = count = 0.0
    for inputs, targets in loader:
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with autocast():
            out = model(inputs)
        n = targets.shape[0]
        loss_sum += float(loss_fn(out.float(), targets).double()) * n
        if classification and out.dim() == 2:
            correct += float((out.argmax(dim=1) == targets).sum())
        count += n
    model.train(was_training)
    loss_sum, correct, count = all_reduce_sum([loss_sum, correct, count], device)
    metrics = {"loss": loss_sum / max(count, 1.0), "count": int(count)}
    if classification:
        metrics["accuracy"] = correct / max(count, 1.0)
        metrics["correct"] = int(correct)
    return metrics


class ResourceSampler:
    """RSS (MB) and CPU percent of this process since the previous sample (psutil).

    Each sample reads /proc twice; with frequent step events (fast steps, a small
    log.every_n_steps) a new one is taken at most every `min_interval_s` seconds and the newest
    is repeated in between, which also keeps the CPU percent from being measured over a few
    milliseconds."""

    def __init__(self, min_interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.proc = psutil.Process()
        self.proc.cpu_percent(None)
        self.min_interval_s, self.clock = min_interval_s, clock
        self._last: dict | None = None
        self._at = clock()

    def sample(self) -> dict:
        now = self.clock()
        if self._last is None or now - self._at >= self.min_interval_s:
            self._last = {"rss_mb": round(self.proc.memory_info().rss / 2**20, 1),
                          "cpu_percent": self.proc.cpu_percent(None)}
            self._at = now
        return dict(self._last)
