"""The job's memory on this node: the tightest memory cgroup limit above this process and what
the cgroup holds that the kernel cannot free (`cgroup_memory`), what the job asked Slurm for
(`slurm_memory`), and the two together (`job_memory`): the budget a process of the job must fit
in, whether a cgroup enforces it or not. Read by the memory snapshots (``train/memroom.py``)
before their first snapshot and by a warm standby rank (``supervise/standroom.py``) before it
imports torch; nothing here imports torch.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

from ddp_hpc.env.job import job_facts

__all__ = ["PROC_CGROUP", "CGROUP_FS", "cgroup_memory", "slurm_memory", "job_memory", "size_text"]

PROC_CGROUP = "/proc/self/cgroup"
CGROUP_FS = "/sys/fs/cgroup"
_NO_LIMIT = 1 << 60               # cgroup v1 writes "no limit" as a number near 2**63


def size_text(n: float) -> str:
    """``3.2 GB``, ``850.0 MB`` (powers of ten, as df -H)."""
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


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


def job_memory(environ: Mapping[str, str] | None = None) -> tuple[int | None, int, str]:
    """(limit, bytes held, where the limit is from) of the job on this node: the cgroup's
    (`cgroup_memory`), or what the job asked Slurm for when that is less (held then counts as 0:
    Slurm's number is a budget, not a reading); (None, 0, "") without either."""
    limit, used, where = cgroup_memory(PROC_CGROUP, CGROUP_FS)
    asked = slurm_memory(environ)
    if asked is not None and (limit is None or asked < limit):
        return asked, 0, "Slurm's --mem"
    return limit, used or 0, where
