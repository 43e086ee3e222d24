"""The group-broadcast loader for a user's own script: :class:`BroadcastLoader`.

    import torch.distributed as dist
    from ddp_hpc.data import BroadcastLoader, LMDBDataset

    dist.init_process_group("gloo")                       # or nccl; env:// as torchrun sets it
    loader = BroadcastLoader(LMDBDataset("/shared/train.lmdb"), batch_size=64)
    for epoch in range(epochs):
        for inputs, targets in loader:                    # each pass is the next epoch
            ...

One rank per group (``groups="node"``: local rank 0 of each node) reads the shared dataset for its
whole group and ships every member its own samples over torch.distributed
(:class:`ddp_hpc.data.broadcast.BroadcastDataset`, the reader behind ``data.io=broadcast``).  Each
rank gets exactly what ``DistributedSampler(dataset, shuffle=True, seed=seed, drop_last=False)``
with ``set_epoch(epoch)`` would give it, in the same order, collated with torch's
``default_collate``.  Every rank must iterate every epoch to its end (the readers' collectives
pair with the members'), as with any DDP loop.

The loader holds process groups of its own.  ``dist.destroy_process_group()`` (the default group)
closes every live loader first (:meth:`BroadcastLoader.close`: its unfinished epoch iterators
stop, their reader threads are joined, its groups are destroyed and dropped), so a script need
not close or delete it, and none of its groups outlives the default one into interpreter exit
(reported to make gloo abort the process now and then: "terminate called without an active
exception").
"""
from __future__ import annotations

import functools
import weakref

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ddp_hpc.data.broadcast import BroadcastDataset, build_plan
from ddp_hpc.data.errors import IOConfigError
from ddp_hpc.data.samplers import batches_per_rank
from ddp_hpc.dist import group_initialized
from ddp_hpc.env import detect

__all__ = ["BroadcastLoader"]

_LIVE: "weakref.WeakSet[BroadcastLoader]" = weakref.WeakSet()


def _close_before_destroy() -> None:
    """Make ``torch.distributed.destroy_process_group()`` close every live loader before the
    default group goes (installed once, by the first loader; any other call passes through)."""
    if getattr(c10d.destroy_process_group, "_closes_loaders", False):
        return
    original = c10d.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(group=None):
        if group is None or group is dist.GroupMember.WORLD:
            for loader in list(_LIVE):
                loader.close()
        return original(group)

    destroy_process_group._closes_loaders = True   # type: ignore[attr-defined]
    c10d.destroy_process_group = dist.destroy_process_group = destroy_process_group


class BroadcastLoader:
    """Batches of this rank's ``DistributedSampler`` samples, read by one rank per group.

    ``groups``: ``node`` (one reader per node), ``strided`` (one rank per node per group) or
    ``two_level`` (rank 0 reads all); ``device``: the device collectives run on (a CUDA device
    under nccl; None: CPU, for gloo); ``bucket_mb``: small steps travel together in buckets of up
    to this many MiB (0: one collective per step); ``num_workers``: reader threads (worth it for
    datasets of small files on a slow filesystem).  Iterating starts the next epoch (0 first), as
    a DataLoader with ``sampler.set_epoch`` does; :meth:`set_epoch` picks one.  Creating it is a
    collective (it makes process groups): every rank, in the same order."""

    def __init__(self, dataset, batch_size: int, *, groups: str = "node", seed: int = 0, device=None,
                 bucket_mb: float = 1.0, num_workers: int = 0):
        if not group_initialized():
            raise IOConfigError("BroadcastLoader needs torch.distributed initialised first",
                                "call dist.init_process_group(...) (or ddp_hpc.dist.setup_ddp()) before "
                                "making the loader")
        if batch_size < 1 or bucket_mb < 0 or num_workers < 0:
            raise IOConfigError(f"BroadcastLoader: batch_size={batch_size}, bucket_mb={bucket_mb}, "
                                f"num_workers={num_workers}",
                                "give batch_size >= 1, bucket_mb >= 0 and num_workers >= 0")
        self.batch_size, self.seed, self.num_workers = batch_size, seed, num_workers
        self.dataset = BroadcastDataset(dataset, build_plan(detect(), groups, device),
                                        coalesce_bytes=int(bucket_mb * (1 << 20)))
        self.epoch = 0
        self._iterators: weakref.WeakSet = weakref.WeakSet()
        _close_before_destroy()
        _LIVE.add(self)

    def close(self) -> None:
        """Stop this loader's unfinished epochs (their reader threads joined) and destroy its
        process groups; ``dist.destroy_process_group()`` does it for every live loader.  Local
        (no collective); iterating afterwards is an error."""
        for it in list(self._iterators):
            try:
                it.close()
            except ValueError:   # running in another thread: it stops at its own end
                pass
        self.dataset.release()
        _LIVE.discard(self)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration delivers (its shuffle)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        """Batches per rank and epoch (the same on every rank)."""
        return batches_per_rank(len(self.dataset), self.dataset.plan.world_size, self.batch_size)

    def __iter__(self):
        if self.dataset.released:
            raise IOConfigError("BroadcastLoader: iterated after close() or destroy_process_group()",
                                "make a new BroadcastLoader after init_process_group(...)")
        epoch, self.epoch = self.epoch, self.epoch + 1
        it = self.dataset.batches(batch_size=self.batch_size, seed=self.seed, epoch=epoch,
                                  num_workers=self.num_workers)
        self._iterators.add(it)
        return it
