"""Test-only dataset factories for the status tests: real training that fails on one rank.

Used through the config's import-path form, e.g.
``data.dataset=tests.cluster.status_helpers:failing_synthetic data.kwargs.fail_rank=3``.
The failure comes from inside the training loop (a sample fetch), after a few steps, so the
failing rank has written start/step events like a real job that dies mid-run.
"""
from __future__ import annotations

import os
import time

import torch.distributed as dist
from torch.utils.data import Dataset

from ddp_hpc.examples.synthetic import SyntheticClassification


class InjectedFailure(RuntimeError):
    """The exception the failing rank raises (its name is what status must report)."""


class FailingSynthetic(Dataset):
    """The demo's synthetic data; on rank ``fail_rank`` the ``after``-th fetch raises."""

    def __init__(self, fail_rank: int = 3, after: int = 1500, **kwargs):
        self.data = SyntheticClassification(**kwargs)
        self.fail_rank, self.after, self.fetched = int(fail_rank), int(after), 0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        self.fetched += 1
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else -1
        if rank == self.fail_rank and self.fetched > self.after:
            raise InjectedFailure(f"injected failure on rank {rank} after {self.after} samples")
        return self.data[i]


def failing_synthetic(**kwargs) -> FailingSynthetic:
    """Factory for ``data.dataset``."""
    return FailingSynthetic(**kwargs)


class SlowSynthetic(Dataset):
    """The demo's data, each fetch sleeping ``delay`` seconds: a run that lasts long enough to be
    watched (and cancelled or requeued) without using CPU. With ``until`` (a path), only until
    that file exists: a test lets the run finish once it has seen what it waited for, however
    slow the machine was until then."""

    def __init__(self, delay: float = 0.002, until: str | None = None, **kwargs):
        self.data = SyntheticClassification(**kwargs)
        self.delay, self.until, self.fetched = float(delay), until, 0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        self.fetched += 1
        if self.until and self.fetched % 50 == 0 and os.path.exists(self.until):
            self.delay = 0.0
        if self.delay:
            time.sleep(self.delay)
        return self.data[i]


def slow_synthetic(**kwargs) -> SlowSynthetic:
    """Factory for ``data.dataset``."""
    return SlowSynthetic(**kwargs)


class OneSlowRank(SlowSynthetic):
    """``delay`` per fetch on every rank, ``slow_delay`` on rank ``slow_rank``: a straggler whose
    data loader is slow (the rank is read from RANK, which ddp_hpc exports before training)."""

    def __init__(self, slow_rank: int = 3, slow_delay: float = 0.02, **kwargs):
        super().__init__(**kwargs)
        if int(os.environ.get("RANK", "-1")) == int(slow_rank):
            self.delay = float(slow_delay)


def one_slow_rank(**kwargs) -> OneSlowRank:
    """Factory for ``data.dataset``."""
    return OneSlowRank(**kwargs)
