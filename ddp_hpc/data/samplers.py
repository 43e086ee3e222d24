"""Which samples each rank gets: exactly ``DistributedSampler(shuffle=True, drop_last=False)``,
from a position in the epoch that counts the samples all ranks together consumed.

Why here: the broadcast loader must deliver each rank the samples DistributedSampler would give
it without every rank building a sampler per member, and mid-epoch resume must skip the batches
already done without reading them.  :func:`epoch_indices` reproduces torch's algorithm (a
``randperm`` seeded with ``seed + epoch``, padded by wrapping to a multiple of the world size,
then every ``world_size``-th index); the tests compare it with torch's own sampler.

Why the position is global: ranks take the padded permutation round-robin, so after all ranks
consumed ``c`` samples (``c`` a multiple of the world size) they have consumed exactly positions
``[0, c)`` of the epoch's permutation, whatever the world size, and the padding only ever repeats
the permutation's first samples after its end.  A run resumed on another number of ranks starts
its ranks at position ``c`` of the same permutation (:class:`ResumableDistributedSampler`'s
``start``) and trains exactly the samples not seen yet.
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
    """This rank's share of the epoch's order from global position ``start``: the samples all
    ranks together consumed so far (a multiple of ``world_size``; 0 starts the epoch).

    ``epoch`` and ``start`` are plain attributes set before each iteration, so one DataLoader
    with persistent workers serves every epoch (the sampler runs in the main process).  From
    ``start = k * world_size`` it yields DistributedSampler's indices for this rank from its
    ``k``-th on.
    """

    def __init__(self, n: int, world_size: int, rank: int, seed: int):
        self.n, self.world_size, self.rank, self.seed = n, world_size, rank, seed
        self.epoch = 0
        self.start = 0

    def _skip(self) -> int:
        if self.start < 0 or self.start % self.world_size:
            raise ValueError(f"ResumableDistributedSampler: start={self.start} is not a multiple of "
                             f"world_size={self.world_size} (it counts samples of all ranks)")
        return self.start // self.world_size

    def __iter__(self):
        skip = self._skip()
        return iter(epoch_indices(self.n, self.world_size, self.rank, self.seed, self.epoch)[skip:])

    def __len__(self) -> int:
        return max(0, math.ceil(self.n / self.world_size) - self._skip())
