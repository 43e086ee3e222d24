"""Which samples each rank gets: exactly ``DistributedSampler(shuffle=True, drop_last=False)``.

Why here: the broadcast loader must deliver each rank the samples DistributedSampler would give
it without every rank building a sampler per member, and mid-epoch resume must skip the batches
already done without reading them.  :func:`epoch_indices` reproduces torch's algorithm (a
``randperm`` seeded with ``seed + epoch``, padded by wrapping to a multiple of the world size,
then every ``world_size``-th index); the tests compare it with torch's own sampler.
"""
from __future__ import annotations

import math

import torch
from torch.utils.data import Sampler

__all__ = ["epoch_permutation", "epoch_indices", "ResumableDistributedSampler", "batches_per_rank"]


def epoch_permutation(n: int, world_size: int, seed: int, epoch: int) -> list[int]:
    """The padded permutation of one epoch (length ``ceil(n / world_size) * world_size``)."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    perm = torch.randperm(n, generator=g).tolist()
    total = math.ceil(n / world_size) * world_size
    pad = total - n
    if pad:
        perm += (perm * math.ceil(pad / len(perm)))[:pad]
    return perm


def epoch_indices(n: int, world_size: int, rank: int, seed: int, epoch: int) -> list[int]:
    """This rank's indices for the epoch, in order (DistributedSampler's)."""
    return epoch_permutation(n, world_size, seed, epoch)[rank::world_size]


def batches_per_rank(n: int, world_size: int, batch_size: int) -> int:
    return math.ceil(math.ceil(n / world_size) / batch_size)


class ResumableDistributedSampler(Sampler):
    """DistributedSampler's order, starting ``start_batch * batch_size`` samples into the epoch.

    ``epoch`` and ``start`` are plain attributes set before each iteration, so one DataLoader
    with persistent workers serves every epoch (the sampler runs in the main process).
    """

    def __init__(self, n: int, world_size: int, rank: int, seed: int):
        self.n, self.world_size, self.rank, self.seed = n, world_size, rank, seed
        self.epoch = 0
        self.start = 0

    def __iter__(self):
        return iter(epoch_indices(self.n, self.world_size, self.rank, self.seed, self.epoch)[self.start:])

    def __len__(self) -> int:
        return max(0, math.ceil(self.n / self.world_size) - self.start)
