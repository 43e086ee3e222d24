"""Does a warm standby fit the memory of its node? Asked by each standby rank
(``supervise/standby.py``) before it imports anything.

Why: a standby rank holds the memory of an imported torch for as long as it stands by (207-281
MiB of its own per rank, measured on the test cluster; `STANDBY_BYTES` counts 0.4 GiB), and it
runs inside the job: under a memory cgroup (Slurm's ``--mem`` with ``ConstrainRAMSpace``) that
memory counts against the job's, so a standby that did not fit would take the training ranks'
room and the kernel's OOM killer would end a rank of the job. A standby rank therefore steps back
(imports nothing, runs nothing, exits) unless, with every standby rank of its node counted, room
is left beyond a margin (`MARGIN_BYTES`, or a tenth of the limit when that is more: the job's own
peaks, an evaluation, a checkpoint's copy, come later):

- in the job's memory (`ddp_hpc.env.memory.job_memory`: the cgroup's limit less what the cgroup
  holds that the kernel cannot free; or Slurm's ``--mem`` less what the job's processes on the
  node hold, their resident sizes added up, when no cgroup is tighter), and
- in the node's available memory (the kernel's ``MemAvailable``), for what no limit counts.

A restart onto a node whose standby stepped back starts its ranks cold, as without
``--warm-standby``; the supervisor says why in the batch output and ``ddp-hpc status`` in one line
(`ddp_hpc.judge.restarts.standby_lines`, from the stepped-back lines in ``standby.out``).
"""
from __future__ import annotations

import os
from typing import Mapping

import psutil

from ddp_hpc.env.job import job_facts
from ddp_hpc.env.memory import job_memory, size_text

__all__ = ["STANDBY_BYTES", "MARGIN_BYTES", "refusal"]

#: what one standby rank is counted to hold: torch, torch.distributed and torch._dynamo imported
STANDBY_BYTES = 400 << 20
#: kept free beyond the standby ranks, at least (a tenth of the limit when that is more)
MARGIN_BYTES = 1 << 30


def _job_rss(job_id: str | None) -> int:
    """The resident bytes of this user's processes of Slurm job ``job_id`` on this node (the job
    their environment names), added up (shared pages count once per process: an overestimate)."""
    if not job_id:
        return 0
    uid, total = os.getuid(), 0
    for p in psutil.process_iter(["uids", "memory_info"]):
        try:
            if p.info["uids"] is None or p.info["uids"].real != uid or p.pid == os.getpid():
                continue
            if job_facts(p.environ()).job_id == job_id:
                total += p.info["memory_info"].rss
        except (psutil.Error, OSError, AttributeError):
            continue
    return total


def refusal(tasks: int, environ: Mapping[str, str] | None = None, available: int | None = None,
            total: int | None = None) -> str | None:
    """Why ``tasks`` standby ranks (this node's) do not fit its memory, in words; None when they
    do. ``available`` and ``total``: the node's memory (default: the kernel's). Memory that cannot
    be read is no room: the standby steps back and says why."""
    try:
        return _refusal(tasks, os.environ if environ is None else environ, available, total)
    except Exception as exc:  # noqa: BLE001 - a standby that cannot tell stands back
        return f"the node's memory could not be read ({type(exc).__name__}: {exc})"


def _refusal(tasks: int, env: Mapping[str, str], available: int | None, total: int | None) -> str | None:
    tasks = max(1, tasks)
    need = STANDBY_BYTES * tasks
    ranks = f"{tasks} standby rank{'s' if tasks > 1 else ''} need{'' if tasks > 1 else 's'} about {size_text(need)}"
    limit, held, where = job_memory(env)
    if where == "Slurm's --mem":
        held = _job_rss(job_facts(env).job_id)
    if limit is not None:
        free, margin = max(0, limit - held), max(MARGIN_BYTES, limit // 10)
        if need + margin > free:
            return (f"the job's memory has {size_text(free)} of {size_text(limit)} free ({where}); {ranks} "
                    f"and {size_text(margin)} stay free")
    if available is None or total is None:
        vm = psutil.virtual_memory()
        available = vm.available if available is None else available
        total = vm.total if total is None else total
    margin = max(MARGIN_BYTES, total // 10)
    if need + margin > available:
        return (f"the node has {size_text(available)} of {size_text(total)} available; {ranks} "
                f"and {size_text(margin)} stay free")
    return None
