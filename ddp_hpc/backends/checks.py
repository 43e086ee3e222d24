"""Resource checks against the nodes sinfo lists, after ``slurm.check_against_cluster`` chose
the partition: CPUs per node and memory per node.

Why: Slurm accepts a job whose tasks ask for more CPUs (or memory) than any node of its partition
has, and it then pends forever (reason "Resources" or "ReqNodeNotAvail") without a word. The
default ``--cpus-per-task`` is ``data.num_workers + 1``, so ``data.num_workers: 2`` on 2-CPU nodes
is such a job. Values sinfo does not know (0) skip their check.

    name = check_against_cluster(spec, partitions)
    check_resources(spec, partition_named(partitions, name))
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping, Sequence

from ddp_hpc.backends.spec import JobSpec, SpecError
from ddp_hpc.text import plural

__all__ = ["partition_named", "check_resources", "size_mb"]

_SIZE = re.compile(r"^(\d+)([KMGT]?)$", re.I)
_MB_PER_UNIT = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 * 1024}


def partition_named(partitions: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any]:
    """The sinfo row (``SlurmCLI.sinfo_partitions``) of partition ``name``."""
    for part in partitions:
        if part["name"] == name:
            return part
    raise SpecError(f"partition {name!r} is not in sinfo's list "
                    f"({', '.join(p['name'] for p in partitions) or 'none'})",
                    "pass --partition with one of those")


def size_mb(text: Any) -> int | None:
    """A Slurm memory size (``8G``, ``4000M``, ``4000``: megabytes, ``1T``, ``512K``) in whole
    megabytes, rounded up; None for anything else (a flag, a typo sbatch will refuse itself)."""
    m = _SIZE.match(str(text).strip()) if isinstance(text, (str, int)) else None
    if m is None:
        return None
    return math.ceil(int(m.group(1)) * _MB_PER_UNIT[m.group(2).upper()])


def _count(part: Mapping[str, Any], key: str) -> int:
    value = part.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _check_cpus(spec: JobSpec, part: Mapping[str, Any]) -> None:
    have = _count(part, "cpus_per_node")
    cpt, tpn = spec.cpus_per_task, spec.tasks_per_node
    if not have or cpt * tpn <= have:
        return
    fits = have // tpn
    if fits:
        fix = (f"use --cpus-per-task {fits} (the most that fits {plural(tpn, 'task')} on a "
               f"{have}-CPU node), or fewer tasks per node (--gpus) on more --nodes")
    else:
        fix = f"use --gpus {have} or fewer (one task per GPU, at least 1 CPU each) and more --nodes"
    raise SpecError(
        f"{plural(cpt, 'CPU')} per task x {plural(tpn, 'task')} per node = {cpt * tpn} CPUs, "
        f"but the nodes of partition {part['name']!r} have {have} (sinfo); Slurm would keep the "
        f"job pending forever",
        f"{fix}. Without --cpus-per-task (slurm.cpus_per_task) it is data.num_workers + 1, so "
        f"lowering data.num_workers lowers it too")


def _mem_requests(spec: JobSpec) -> list[tuple[str, int, str]]:
    """(what was asked for, MB per node, the option to change) for each memory option set."""
    out = []
    opts = spec.options
    mem = size_mb(opts.mem) if opts.mem is not None else None
    if mem:                                    # --mem 0: all of a node's memory
        out.append((f"--mem {opts.mem} ({mem} MB per node)", mem, "--mem"))
    per_cpu = size_mb(opts.sbatch_args.get("mem-per-cpu"))
    if per_cpu:
        cpus = spec.cpus_per_task * spec.tasks_per_node
        out.append((f"mem-per-cpu={opts.sbatch_args['mem-per-cpu']} x {cpus} CPUs per node "
                    f"= {per_cpu * cpus} MB per node", per_cpu * cpus, "mem-per-cpu"))
    per_gpu = size_mb(opts.sbatch_args.get("mem-per-gpu"))
    if per_gpu:
        gpus = spec.gpus_per_node
        out.append((f"mem-per-gpu={opts.sbatch_args['mem-per-gpu']} x {gpus} GPUs per node "
                    f"= {per_gpu * gpus} MB per node", per_gpu * gpus, "mem-per-gpu"))
    return out


def _check_mem(spec: JobSpec, part: Mapping[str, Any]) -> None:
    have = _count(part, "mem_per_node_mb")
    if not have:
        return
    for asked, mb, option in _mem_requests(spec):
        if mb <= have:
            continue
        if option == "--mem":
            fix = f"use --mem {have}M or less, or --mem 0 for all of a node's memory"
        else:
            per = spec.cpus_per_task * spec.tasks_per_node if option == "mem-per-cpu" \
                else spec.gpus_per_node
            fix = f"use --sbatch-arg {option}={have // per}M or less, or --mem instead"
        raise SpecError(f"{asked} is more than the nodes of partition {part['name']!r} have: "
                        f"{have} MB (sinfo); Slurm would keep the job pending forever", fix)


def check_resources(spec: JobSpec, partition: Mapping[str, Any]) -> None:
    """Refuse CPUs or memory per node that no node of ``partition`` (a row of
    ``SlurmCLI.sinfo_partitions``, with ``cpus_per_node`` and ``mem_per_node_mb``) has."""
    _check_cpus(spec, partition)
    _check_mem(spec, partition)
