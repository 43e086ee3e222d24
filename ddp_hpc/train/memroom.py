"""Will the memory snapshots fit? Asked once, by each node's snapshot writer, before its first
snapshot (train/memsnap.py).

Why: a snapshot costs memory three times over. While one is written the node's folder holds two
(the new one is renamed over the old: a reader always finds a whole one), and the writer keeps a
copy of the state between snapshots (pinned on CUDA). A state that does not fit filled
``/dev/shm`` to 100 %, where DataLoader workers and NCCL need room too, and under a memory cgroup
(Slurm's ``--mem``) a tmpfs file counts against the job's memory and outlives a restart. So:

- the store's filesystem (``shutil.disk_usage``) must have room for two snapshots, less what this
  node's older snapshot already takes, and a margin;
- the job's memory must have room for the two and the copy: the tightest ``memory.max`` (cgroup
  v2) or ``memory.limit_in_bytes`` (v1) from this process's cgroup (``/proc/self/cgroup``) up to
  the root, less what the cgroup holds that the kernel cannot free (its page cache can go), or
  what the job asked Slurm for (``SLURM_MEM_PER_NODE`` / ``SLURM_MEM_PER_CPU``) when that is less:
  the job's budget, whether a cgroup enforces it or not.

The margin (`MARGIN_BYTES`, or a tenth of what the snapshots need when that is more) keeps room
for everything else on the node. The answer is the reason they do not fit, in words, or None.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Mapping

import torch

from ddp_hpc.env.memory import job_memory, size_text

__all__ = ["MARGIN_BYTES", "state_bytes", "does_not_fit", "size_text"]

MARGIN_BYTES = 256 << 20          # kept free beyond the snapshots (a test sets it to 0)


def state_bytes(state: Any) -> int:
    """The bytes of the tensors in a (nested) state: about a snapshot's size."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def _mount(path: Path) -> str:
    """The mount point that holds ``path`` (``/dev/shm``), for the words."""
    p = path.resolve()
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return str(p)


def does_not_fit(size: int, folder: Path, held: int, environ: Mapping[str, str] | None = None) -> str | None:
    """Why snapshots of ``size`` bytes do not fit in ``folder`` (which holds ``held`` bytes of
    this node's older snapshot) and the job's memory; None when they fit."""
    fs = _mount(folder)
    room = shutil.disk_usage(folder).free + held
    need = 2 * size
    if need + max(MARGIN_BYTES, need // 10) > room:
        return (f"memory snapshots off: the state ({size_text(size)} x 2) does not fit {fs} "
                f"({size_text(room)} free); file checkpoints go on")
    limit, used, where = job_memory(environ)   # the budget, enforced by a cgroup or not
    if limit is None:
        return None
    free = max(0, limit - used + held)    # the older snapshot goes when the new one is whole
    need = 3 * size
    if need + max(MARGIN_BYTES, need // 10) > free:
        return (f"memory snapshots off: the state ({size_text(size)} x 3: two in {fs}, one copy) does not "
                f"fit the job's memory ({size_text(free)} of {size_text(limit)} free, {where}); "
                f"file checkpoints go on")
    return None
