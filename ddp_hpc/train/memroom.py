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

from ddp_hpc.env import job_facts

__all__ = ["MARGIN_BYTES", "PROC_CGROUP", "CGROUP_FS", "cgroup_memory", "slurm_memory", "state_bytes",
           "does_not_fit", "size_text"]

MARGIN_BYTES = 256 << 20          # kept free beyond the snapshots (a test sets it to 0)
PROC_CGROUP = "/proc/self/cgroup"
CGROUP_FS = "/sys/fs/cgroup"
_NO_LIMIT = 1 << 60               # cgroup v1 writes "no limit" as a number near 2**63


def size_text(n: float) -> str:
    """``3.2 GB``, ``850.0 MB`` (powers of ten, as df -H)."""
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def state_bytes(state: Any) -> int:
    """The bytes of the tensors in a (nested) state: about a snapshot's size."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path) -> dict[str, int]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v) for k, _, v in (ln.partition(" ") for ln in lines) if v.strip().isdigit()}


def _held(folder: Path, current: int, v2: bool) -> int:
    """What the cgroup at ``folder`` holds that the kernel cannot free: all of it but the page
    cache (tmpfs pages, shmem, are cache too, and stay)."""
    st = _stat(folder / "memory.stat")
    if v2:
        cache, shmem = st.get("file", 0), st.get("shmem", 0)
    else:
        cache, shmem = st.get("total_cache", st.get("cache", 0)), st.get("total_shmem", st.get("shmem", 0))
    return max(0, current - max(0, cache - shmem))


def cgroup_memory(proc_cgroup: str | Path | None = None, cgroup_fs: str | Path | None = None,
                  ) -> tuple[int | None, int | None, str]:
    """(limit, bytes held, where the limit is from) of this process's memory cgroup: the tightest
    limit from its own cgroup up to the root; (None, None, "") without one."""
    try:
        lines = Path(proc_cgroup or PROC_CGROUP).read_text().splitlines()
    except OSError:
        return None, None, ""
    fs, best = Path(cgroup_fs or CGROUP_FS), (None, None, "")
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "":
            base, limit_file, used_file, v2 = fs, "memory.max", "memory.current", True
        elif "memory" in controllers.split(","):
            base, limit_file, used_file, v2 = fs / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes", False
        else:
            continue
        here = base / path.strip().lstrip("/")
        for folder in (here, *here.parents):
            limit = _read_int(folder / limit_file)
            if limit is not None and limit < _NO_LIMIT and (best[0] is None or limit < best[0]):
                used = _read_int(folder / used_file)
                best = (limit, None if used is None else _held(folder, used, v2), f"cgroup {limit_file}")
            if folder == base:
                break
    return best


def slurm_memory(environ: Mapping[str, str] | None = None) -> int | None:
    """The job's memory on this node as Slurm says it (``--mem``, ``--mem-per-cpu``: env.job_facts),
    None when it does not (0 is the whole node: no limit of the job's own)."""
    mb = job_facts(environ).memory_mb
    return mb << 20 if mb else None


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
    limit, used, where = cgroup_memory()
    asked = slurm_memory(environ)     # what the job asked for: the budget, enforced by a cgroup or not
    if asked is not None and (limit is None or asked < limit):
        limit, used, where = asked, 0, "Slurm's --mem"
    if limit is None:
        return None
    free = max(0, limit - (used or 0) + held)    # the older snapshot goes when the new one is whole
    need = 3 * size
    if need + max(MARGIN_BYTES, need // 10) > free:
        return (f"memory snapshots off: the state ({size_text(size)} x 3: two in {fs}, one copy) does not "
                f"fit the job's memory ({size_text(free)} of {size_text(limit)} free, {where}); "
                f"file checkpoints go on")
    return None
