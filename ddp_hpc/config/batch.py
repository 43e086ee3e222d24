"""The global batch on a number of ranks: which layouts keep it, as a job's config allows.

One optimizer step trains on the global batch G = ranks x per-rank batch x accumulation steps.
A run resumed on W ranks (``train/reshape.py``: a requeue on another node count, or the restart
supervisor going on with fewer nodes, ``--min-nodes``) keeps G with the configured per-rank batch
b when G is a multiple of b x W (accumulation G / (b x W)); with ``train.allow_batch_size_change``
when G is a multiple of W (the largest per-rank batch up to b that divides G / W); with
``train.allow_global_batch_change`` it goes on with another global batch, so any W does.

`keeping_layout` is that rule; `check_node_counts` applies it at submit time to every node count
the restart supervisor may go on with after the counts a job may start on, so the supervisor never
plans a world the config refuses.
"""
from __future__ import annotations

from dataclasses import dataclass

from ddp_hpc.config.sections import TrainConfig
from ddp_hpc.config.typed import ConfigError

__all__ = ["BatchLayout", "divisors", "keeping_layout", "check_node_counts"]


@dataclass(frozen=True)
class BatchLayout:
    """How one optimizer step is spread: ranks x per-rank batch x accumulation steps."""

    world: int
    batch_size: int
    grad_accum: int

    @property
    def global_batch(self) -> int:
        return self.world * self.batch_size * self.grad_accum

    @property
    def per_micro(self) -> int:
        """Samples all ranks consume per micro-batch."""
        return self.world * self.batch_size


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def keeping_layout(global_batch: int, world: int, train: TrainConfig) -> BatchLayout | None:
    """A layout on ``world`` ranks with ``global_batch`` that ``train`` allows, or None (a change
    of the global batch, ``train.allow_global_batch_change``, is not this function's)."""
    g, b = global_batch, train.batch_size
    if g % (b * world) == 0:
        return BatchLayout(world, b, g // (b * world))
    if train.allow_batch_size_change and g % world == 0:
        per_rank = g // world
        b2 = max(d for d in divisors(per_rank) if d <= b)
        return BatchLayout(world, b2, per_rank // b2)
    return None


def check_node_counts(train: TrainConfig, starts: range, counts: range, tasks_per_node: int,
                      flags: str) -> None:
    """Refuse (ConfigError) a job that may start on any node count of ``starts`` and go on with
    fewer, any of ``counts`` (``flags``: the options that say so, for the message), when a resume
    on one of them could not keep the global batch the run started with, naming those counts and
    the settings that allow them."""
    if train.allow_global_batch_change:
        return
    bad: dict[int, list[int]] = {}          # node count -> the start counts it cannot keep
    loose: set[int] = set()                 # ... of which allow_batch_size_change would keep it
    for n in starts:
        g = BatchLayout(n * tasks_per_node, train.batch_size, train.grad_accum).global_batch
        for m in counts:
            if m < n and keeping_layout(g, m * tasks_per_node, train) is None:
                bad.setdefault(m, []).append(n)
                if g % (m * tasks_per_node) == 0:
                    loose.add(m)
    if not bad:
        return
    t, b, a = tasks_per_node, train.batch_size, train.grad_accum
    said = "; ".join(
        f"{m} nodes after starting on {', '.join(map(str, ns))} (global batch "
        f"{', '.join(str(n * t * b * a) for n in ns)} is not a multiple of per-rank batch {b} x {m * t} ranks)"
        for m, ns in sorted(bad.items()))
    fine = [m for m in counts if m not in bad]
    hints = ["set train.allow_batch_size_change=true (the per-rank batch shrinks to keep the global batch)"
             if set(bad) <= loose else None,
             "set train.allow_global_batch_change=true (the run goes on with the nearest global batch)",
             f"allow only the node counts that keep it ({', '.join(map(str, fine))})" if fine else None]
    raise ConfigError(
        f"{flags}: the run may go on with a node count that cannot keep its global batch "
        f"(train.batch_size={b} x train.grad_accum={a} x {t} ranks per node x nodes): {said}",
        "; or ".join(h for h in hints if h))
