"""The process tree of a local launch: where each rank sits, what it is told, how it is ended.

Every rank gets the torchrun-style variables RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR, MASTER_PORT plus DDP_HPC_LAUNCHER=local, DDP_HPC_NUM_NODES and
DDP_HPC_JOB_ID, so `ddp_hpc.env.detect()` derives the same DistEnv it would on a cluster.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import time
import uuid
from typing import Mapping, Sequence

import psutil

from ddp_hpc.env import HostGpus
from ddp_hpc.env.sources import LOCAL_LAUNCHER
from ddp_hpc.errors import HintError

KILL_GRACE_S = 3.0  # SIGTERM first, SIGKILL after this many seconds


class LaunchError(HintError, ValueError):
    """A local launch asked for something impossible (a layout, an empty command)."""


def node_layout(world_size: int, nodes: int | Sequence[int]) -> list[int]:
    """Processes per pretend node: ``nodes`` as a count (even split) or explicit counts (3, 1)."""
    if isinstance(nodes, int):
        if nodes < 1 or world_size < 1 or world_size % nodes:
            raise LaunchError(f"world_size={world_size} does not split evenly over nodes={nodes}",
                              "pass nodes as per-node counts, e.g. nodes=(3, 1), for an uneven layout")
        return [world_size // nodes] * nodes
    counts = [int(n) for n in nodes]
    if not counts or min(counts) < 1 or sum(counts) != world_size:
        raise LaunchError(f"nodes={tuple(counts)} must be positive per-node counts summing to "
                          f"world_size={world_size}", "e.g. nodes=(3, 1) for world_size=4")
    return counts


def pretend_node_gpus(counts: Sequence[int], host: HostGpus) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES of each pretend node: node k gets the next ``counts[k]`` of the
    machine's GPUs, as a real node of ``--gpus-per-node=G`` would see its own G, so no two ranks
    share a GPU. None when the machine has no GPU (gloo on the CPU, any layout);
    ``LaunchError`` when the layout needs more GPUs than there are."""
    if not host.ids:
        return None
    need = sum(counts)
    if need > len(host.ids):
        raise LaunchError(
            f"{need} ranks ({len(counts)} pretend node(s) x {'/'.join(map(str, sorted(set(counts))))}) "
            f"need one GPU each, but this machine has {len(host.ids)} ({host.source})",
            f"ask for at most {len(host.ids)} ranks in all (pretend nodes take GPUs of their own), "
            "or run every rank on the CPU with CUDA_VISIBLE_DEVICES= (empty) in front of the command")
    starts = [sum(counts[:k]) for k in range(len(counts))]
    return [",".join(host.ids[s:s + n]) for s, n in zip(starts, counts)]


def local_rank_env(counts: Sequence[int], master_port: int, job_id: str,
                   master_addr: str = "127.0.0.1",
                   gpus: Sequence[str] | None = None) -> list[dict[str, str]]:
    """The local-launcher variables of every rank, ranks laid out node by node; with ``gpus``
    (``pretend_node_gpus``), each rank's CUDA_VISIBLE_DEVICES is its node's."""
    world, out = sum(counts), []
    for node, n in enumerate(counts):
        for local in range(n):
            out.append({
                **({"CUDA_VISIBLE_DEVICES": gpus[node]} if gpus is not None else {}),
                "RANK": str(len(out)), "LOCAL_RANK": str(local), "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(n), "GROUP_RANK": str(node),
                "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
                "DDP_HPC_LAUNCHER": LOCAL_LAUNCHER, "DDP_HPC_NUM_NODES": str(len(counts)),
                "DDP_HPC_JOB_ID": job_id,
            })
    return out


def new_job_id() -> str:
    """A job id for a local launch: ``local-<date>-<time>-<6 hex digits>``."""
    return f"local-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def thread_env(procs_per_node: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """OMP_NUM_THREADS for ranks sharing a machine (cores // ranks, at least 1), unless set:
    torch's default of one thread per core in every rank oversubscribes the CPU (torchrun
    does the same)."""
    environ = os.environ if environ is None else environ
    if "OMP_NUM_THREADS" in environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // max(1, procs_per_node)))}


def limit_threads() -> None:
    """Apply OMP_NUM_THREADS in a child where torch was imported before it was set (forkserver
    preload): OpenMP read the variable too early."""
    torch = sys.modules.get("torch")
    n = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and n.isdigit() and int(n) > 0:
        torch.set_num_threads(int(n))


#: how far a process's start time may lie from the one recorded for its pid (clock rounding)
PID_TIME_SLACK_S = 1.0


def start_time(pid: int) -> float | None:
    """When process ``pid`` started (unix seconds), or None when there is no such process: what
    a job record keeps beside each pid, so a pid reused later is not taken for the job's."""
    try:
        return psutil.Process(int(pid)).create_time()
    except (psutil.Error, ValueError):
        return None


def live_processes(pids: Sequence[int]) -> list[psutil.Process]:
    """The live processes among ``pids`` (zombies left out): for this process's own children,
    whose pids no other process can take before they are reaped."""
    out = []
    for pid in pids:
        try:
            p = psutil.Process(int(pid))
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.Error, ValueError, TypeError):
            continue
    return out


def recorded_processes(pids: Sequence[int], times: Sequence[float | None] | None) -> list[psutil.Process]:
    """The live processes among a job record's ``pids`` that are still the ones recorded: each
    started at the time recorded beside its pid (``times``, same order). A pid with no time
    recorded (its process had ended when the record was written, or an old record) is never
    taken: whatever runs under that pid now is another process. The one check of "is this pid
    still the job's", for ``ddp-hpc cancel`` (what it signals) and status (what runs)."""
    times = list(times or [])
    out = []
    for i, pid in enumerate(pids):
        known = times[i] if i < len(times) else None
        if known is None:
            continue
        for p in live_processes([pid]):
            try:
                if abs(p.create_time() - float(known)) <= PID_TIME_SLACK_S:
                    out.append(p)
            except psutil.Error:
                continue
    return out


def recorded_alive(pids: Sequence[int] | None, times: Sequence[float | None] | None,
                   host: str | None) -> bool | None:
    """Whether a job record's processes still run: True when any of them does
    (`recorded_processes`), False when none does or the list is empty (the local driver's word
    that it finished), None when this machine cannot tell: no pids were recorded, or they were
    recorded on another ``host``."""
    if pids is not None and len(pids) == 0:
        return False
    if not pids:
        return None
    if host and host not in (socket.gethostname(), socket.getfqdn(), "localhost"):
        return None
    return bool(recorded_processes(pids, times))


def unrecorded_pids(pids: Sequence[int], times: Sequence[float | None] | None) -> list[int]:
    """The pids of ``pids`` with no start time recorded beside them (`recorded_processes` never
    takes them): what ``ddp-hpc cancel`` names as left alone."""
    times = list(times or [])
    return [int(pid) for i, pid in enumerate(pids) if (times[i] if i < len(times) else None) is None]


def stop_processes(procs: Sequence[psutil.Process], grace: float = KILL_GRACE_S,
                   groups: Sequence[int] = ()) -> list[int]:
    """SIGTERM each process and its descendants, and the process group of each pid in ``groups``
    that still leads one (a local rank's session: the script under ``ddp_hpc.exec``, DataLoader
    workers); SIGKILL whatever is left after ``grace`` seconds. Returns the pids that needed
    SIGKILL."""
    tree: dict[int, psutil.Process] = {}
    for p in procs:
        for q in [p, *_children(p)]:
            tree.setdefault(q.pid, q)
    _signal_all(tree.values(), groups, signal.SIGTERM)
    _, alive = psutil.wait_procs(list(tree.values()), timeout=grace)
    _signal_all(alive, [g for g in groups if any(p.pid == g for p in alive)], signal.SIGKILL)
    psutil.wait_procs(alive, timeout=KILL_GRACE_S)
    return sorted(p.pid for p in alive)


def _children(p: psutil.Process) -> list[psutil.Process]:
    try:
        return p.children(recursive=True)
    except psutil.Error:
        return []


def _signal_all(procs, leaders: Sequence[int], sig: int) -> None:
    """Send ``sig`` to every process, and to the group of each leader that still leads one."""
    for pid in leaders:
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass
