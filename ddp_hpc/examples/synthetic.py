"""Synthetic classification data: deterministic, generated in memory, identical on every rank.

Why: the demo and the tests need data that needs no download and no shared filesystem, whose
every sample is a pure function of (seed, index), so a 4-rank run and a 1-process run see exactly
the same samples.  Labels come from a fixed random linear teacher, so the task is learnable and the
demo's loss visibly falls.
"""
from __future__ import annotations

import torch
from torch.utils.data import Dataset


class SyntheticClassification(Dataset):
    """`size` samples of `in_dim` Gaussian features labelled by a random linear teacher."""

    def __init__(self, size: int = 4096, in_dim: int = 32, num_classes: int = 10, seed: int = 0,
                 noise: float = 0.1) -> None:
        if size <= 0 or in_dim <= 0 or num_classes <= 1:
            raise ValueError(f"SyntheticClassification(size={size}, in_dim={in_dim}, "
                             f"num_classes={num_classes}): need size > 0, in_dim > 0, "
                             f"num_classes > 1")
        g = torch.Generator().manual_seed(seed)
        teacher = torch.randn(in_dim, num_classes, generator=g)
        self.x = torch.randn(size, in_dim, generator=g)
        logits = self.x @ teacher + noise * torch.randn(size, num_classes, generator=g)
        self.y = logits.argmax(dim=1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def synthetic(**kwargs) -> SyntheticClassification:
    """Factory used by `data.dataset: synthetic`."""
    return SyntheticClassification(**kwargs)


BUILTIN_DATASETS = {"synthetic": synthetic}
