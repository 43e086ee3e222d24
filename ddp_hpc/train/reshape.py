"""Resuming a checkpoint on another number of ranks with the same global batch.

A checkpoint records how its run was laid out (world size W, per-rank batch b, accumulation
steps a: the global batch G = W x b x a samples per optimizer step) and how many samples of the
epoch's permutation all ranks together consumed (`samples_in_epoch`, always at a step boundary,
so a multiple of G).  Every optimizer step k of an epoch trains on positions [kG, (k+1)G) of that
permutation whatever the layout, so a run resumed on W' ranks with b' x a' x W' = G continues with
exactly the samples not yet seen and makes the same updates, up to the summation order of a
different accumulation (see data/samplers.py).

`plan_resume` chooses the new layout: the configured per-rank batch with the accumulation that
keeps G; else, with ``train.allow_batch_size_change``, the largest per-rank batch up to the
configured one that keeps it (``config.batch.keeping_layout``: the rule submit also checks every
node count of a job against); else, with ``train.allow_global_batch_change``, the configured batch
with the accumulation nearest to G (the run goes on from the last step boundary of the new global
batch at or before the checkpoint's position); else it refuses with the numbers and the choices.
Checkpoints written before these fields existed give their layout from their saved config (and
their world size), else from the current config.

The RNG states (`rank_rng`): a checkpoint keeps every rank's (Python, NumPy, torch, CUDA). On
another number of ranks, rank r of the new run goes on from the state of rank r of the old one
while there is one (fewer ranks: the first ones keep their streams); a rank the old run did not
have is seeded from a hash of every old rank's torch state and its own rank, so each new rank
gets a stream of its own, the same on every resume of the same checkpoint.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ddp_hpc.config import ConfigError, TrainConfig
from ddp_hpc.config.batch import BatchLayout, divisors, keeping_layout

__all__ = ["BatchLayout", "ResumePlan", "written_layout", "samples_done", "plan_resume", "rank_rng"]


@dataclass(frozen=True)
class ResumePlan:
    """What a resume does: the layout written, the layout chosen, where in the epoch the run goes
    on (samples consumed over all ranks), the log line, and a warning when the user allowed a
    change of the global batch."""

    written: BatchLayout
    layout: BatchLayout
    samples: int
    note: str
    warning: str | None = None


def written_layout(state: dict, train: TrainConfig, world: int) -> BatchLayout:
    """The layout `state` was written with (older checkpoints: their saved config, else ours)."""
    saved = (state.get("config") or {}).get("train") or {}
    return BatchLayout(int(state.get("world_size") or world),
                       int(state.get("batch_size") or saved.get("batch_size") or train.batch_size),
                       int(state.get("grad_accum") or saved.get("grad_accum") or train.grad_accum))


def samples_done(state: dict, written: BatchLayout) -> int:
    """Samples of the checkpoint's epoch that all ranks together consumed."""
    if state.get("samples_in_epoch") is not None:
        return int(state["samples_in_epoch"])
    return int(state["batch_in_epoch"]) * written.per_micro


def _refusal(written: BatchLayout, world: int, train: TrainConfig, step: int) -> ConfigError:
    g, b = written.global_batch, train.batch_size
    choices = []
    if g % b == 0:
        worlds = ", ".join(map(str, divisors(g // b)))
        choices.append(f"run on a number of ranks that divides {g} / {b} = {g // b} ({worlds})")
    if g % world == 0:
        per_rank = g // world
        b2 = max(d for d in divisors(per_rank) if d <= b)
        choices.append(f"set train.allow_batch_size_change=true (per-rank batch {b2} x "
                       f"accumulation {per_rank // b2} keeps it)")
    a2 = max(1, round(g / (b * world)))
    choices.append(f"set train.allow_global_batch_change=true to go on with global batch "
                   f"{b * a2 * world} (accumulation {a2})")
    return ConfigError(
        f"cannot resume step {step} on {world} ranks with the same global batch: it was written "
        f"by {written.world} ranks x per-rank batch {written.batch_size} x accumulation "
        f"{written.grad_accum} = global batch {g}, and {g} is not a multiple of per-rank batch "
        f"{b} x {world} ranks = {b * world}",
        "; or ".join(choices) + " (a changed config finds this checkpoint with "
        "checkpoint.dir=<its directory>)")


def plan_resume(state: dict, train: TrainConfig, world: int) -> ResumePlan:
    """The layout and position of a run resuming `state` on `world` ranks (see the module)."""
    written, step = written_layout(state, train, world), int(state["step"])
    samples = samples_done(state, written)
    layout, warning = keeping_layout(written.global_batch, world, train), None
    if layout is None:
        if not train.allow_global_batch_change:
            raise _refusal(written, world, train, step)
        a2 = max(1, round(written.global_batch / (train.batch_size * world)))
        layout = BatchLayout(world, train.batch_size, a2)
        kept = samples // layout.global_batch * layout.global_batch
        warning = (f"train.allow_global_batch_change: global batch {written.global_batch} -> "
                   f"{layout.global_batch} (per-rank batch {layout.batch_size}, accumulation "
                   f"{a2}, {world} ranks); the epoch goes on at sample {kept} of its order "
                   f"({samples - kept} samples before the checkpoint's position are trained again)")
        samples = kept
    batch = (f"{written.batch_size}" if layout.batch_size == written.batch_size
             else f"{written.batch_size} -> {layout.batch_size}")
    kept_text = (f"global batch {layout.global_batch} kept" if warning is None
                 else f"global batch {written.global_batch} -> {layout.global_batch} changed")
    note = (f"resuming step {step} written by {written.world} ranks on {world} ranks: per-rank "
            f"batch {batch}, accumulation {written.grad_accum} -> {layout.grad_accum} ({kept_text})")
    return ResumePlan(written, layout, samples, note, warning)


def rank_rng(states: list, rank: int) -> dict | int:
    """Rank ``rank``'s RNGs on resuming a checkpoint whose ranks saved ``states``: the state of
    the old rank of the same number (a dict for ``checkpoint.set_rng_state``), or for a rank the
    old run did not have a seed (an int for ``seed_everything``) hashed from all old ranks' torch
    states and ``rank``: deterministic, and another one for every new rank."""
    if rank < len(states) and isinstance(states[rank], dict):
        return states[rank]
    h = hashlib.sha256()
    for st in states:
        torch_state = st.get("torch") if isinstance(st, dict) else None
        h.update(bytes(torch_state.numpy().tobytes()) if torch_state is not None else b"-")
    h.update(f"rank {rank}".encode())
    return int.from_bytes(h.digest()[:8], "little") % 2**63
