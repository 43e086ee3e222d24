"""Process group set-up for DDP under any launcher: ``setup_ddp()`` / ``cleanup_ddp()`` and groups.

``setup_ddp()`` takes the rank facts from ``ddp_hpc.env.detect()`` (srun, torchrun,
submitit, ``ddp_hpc.launch`` or a single process) and adds what usually goes wrong by hand:

- backend ``auto``: nccl when CUDA is usable and this rank has a GPU to bind, gloo otherwise;
- the device: ``cuda:<local_rank>`` when every task of a node sees all its GPUs
  (``--gpus-per-node``), ``cuda:0`` when each task sees only its own (``--gpus-per-task`` /
  ``--gpu-bind``), an ``EnvError`` with a HINT when a local rank has no GPU left;
- GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME set (only when unset, and logged) to the interface that
  routes to MASTER_ADDR: gloo otherwise advertises whatever the host name resolves to, and a host
  name resolving to 127.0.0.1 makes multi-node init time out;
- TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (setdefault) so a failed NCCL collective aborts the rank
  instead of hanging it.

Init methods: ``env://`` (MASTER_ADDR/MASTER_PORT/RANK/... exported from the DistEnv, never
replacing a different user value), ``tcp://HOST:PORT``, and ``file:///shared/path``: a rendezvous
file on a filesystem every node mounts. The file must be unique per job (e.g. include
``$SLURM_JOB_ID``) and must not exist yet: a stale file from an earlier run can make ranks meet
the wrong peers or hang.

    ctx = setup_ddp()                 # under srun / torchrun / python -m ddp_hpc.launch
    model = DDP(model.to(ctx.device), device_ids=ctx.device_ids)
    ...
    cleanup_ddp()
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Mapping, Sequence, Union
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from ddp_hpc.env import DistEnv, EnvError, detect, gpu_index, interface_for, route_interface, user_port, visible_gpus
from ddp_hpc.runlogs.startup import mark_rendezvous

log = logging.getLogger(__name__)

__all__ = ["DistContext", "setup_ddp", "cleanup_ddp", "group_initialized", "group_has_peers", "is_main",
           "barrier", "device_index", "select_device",
           "interface_for", "route_interface", "new_groups", "node_group", "leaders_group", "strided_groups",
           "gather_layout", "block_layout", "node_rank_lists", "leader_ranks", "strided_rank_lists",
           "NCCL_DEFAULTS"]

#: Set with setdefault before an nccl init: errors and timeouts of NCCL collectives tear the
#: process down (the launcher then reports it) instead of leaving it blocked forever.
NCCL_DEFAULTS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}

#: (node_rank, local_rank) of every global rank, in rank order.
Layout = Sequence[tuple[int, int]]


@dataclass(frozen=True)
class DistContext:
    """What ``setup_ddp`` set up: where this rank sits, the backend and the device to use."""

    env: DistEnv
    backend: str
    device: torch.device
    init_method: str = "env://"
    socket_ifname: str | None = None  # interface chosen for GLOO/NCCL_SOCKET_IFNAME (None: left alone)

    @property
    def device_ids(self) -> list[int] | None:
        """``device_ids`` for DistributedDataParallel: [index] on a GPU, None on CPU."""
        return [self.device.index] if self.device.type == "cuda" else None

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0


# --- device binding
def device_index(env: DistEnv, environ: Mapping[str, str] | None = None) -> int | None:
    """The CUDA device index this rank should use, or None to run on CPU (no GPU visible).

    The rule is `ddp_hpc.env.gpu_index` (shared with preflight, so both agree); ``environ``
    defaults to this process's environment for the GPU variables only (rank facts come from
    ``env``); without CUDA_VISIBLE_DEVICES the count is torch's.
    """
    gpu_vars = os.environ if environ is None else environ
    visible = visible_gpus(gpu_vars) if environ is not None else None
    if visible is None:
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return gpu_index(env, gpu_vars, visible)


def select_device(env: DistEnv, environ: Mapping[str, str] | None = None) -> torch.device:
    """``cuda:<device_index>`` when CUDA is usable and a device is bound, else ``cpu``."""
    idx = device_index(env, environ)
    if idx is None or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", idx)


# --- network interface: GLOO/NCCL_SOCKET_IFNAME
def _choose_ifname(backend: str, env: DistEnv, rdzv_host: str | None = None) -> str | None:
    var = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}.get(backend)
    if var is None:
        return None
    if os.environ.get(var):
        log.info("%s=%s set by the user; left alone", var, os.environ[var])
        return None
    target = rdzv_host or env.master_addr
    name = route_interface(env, rdzv_host)
    if name is None:
        log.warning("no local interface routes to %s; %s left unset", target, var)
        return None
    os.environ[var] = name
    log.info("%s=%s (the interface that routes to %s)", var, name, target)
    return name


# --- setup / cleanup
def _with_overrides(env: DistEnv, rank: int | None, world_size: int | None) -> DistEnv:
    """Tutorial-style ``setup_ddp(rank, world_size)``: defines the ranks of a plain single process,
    must agree with any real launcher's (a disagreement would hang the rendezvous)."""
    if rank is None and world_size is None:
        return env
    rank = env.rank if rank is None else int(rank)
    world_size = env.world_size if world_size is None else int(world_size)
    if env.launcher != "single":
        if (rank, world_size) != (env.rank, env.world_size):
            raise EnvError(
                f"setup_ddp(rank={rank}, world_size={world_size}) disagrees with the {env.launcher} "
                f"launcher's rank={env.rank}, world_size={env.world_size}.",
                "Call setup_ddp() without arguments under a launcher, or pass its values.")
        return env
    if world_size > 1 and user_port() is None:
        raise EnvError(
            f"setup_ddp(rank={rank}, world_size={world_size}) in processes started without a "
            "launcher and without MASTER_PORT: each would pick its own port and wait forever.",
            "Start them with ddp_hpc.launch.launch_distributed(fn, world_size) or set MASTER_ADDR "
            "and MASTER_PORT before spawning.")
    return dataclasses.replace(env, rank=rank, world_size=world_size, local_rank=rank,
                               local_world_size=world_size)


def _check_init_method(init_method: str) -> str:
    url = urlparse(init_method)
    if url.scheme == "env" and init_method == "env://":
        return init_method
    if url.scheme == "tcp":
        try:
            ok = bool(url.hostname) and url.port is not None
        except ValueError:
            ok = False
        if ok:
            return init_method
        raise EnvError(f"init_method={init_method!r} needs a host and a port.",
                       "Write it as tcp://HOST:PORT, e.g. tcp://n001:29500.")
    if url.scheme == "file":
        path = Path(url.path)
        if url.netloc or not url.path or not path.is_absolute():
            raise EnvError(f"init_method={init_method!r} needs an absolute path.",
                           "Write it as file:///shared/dir/<unique-per-job-name>.")
        if not path.parent.is_dir():
            raise EnvError(f"init_method={init_method!r}: directory {path.parent} does not exist "
                           "on this node.",
                           "Use a directory on a filesystem every node mounts (not /tmp).")
        return init_method
    raise EnvError(f"init_method={init_method!r} is not supported.",
                   "Use env://, tcp://HOST:PORT or file:///shared/path.")


def _backend_and_device(backend: str, env: DistEnv) -> tuple[str, torch.device]:
    """Resolve ``auto`` (nccl when this rank has a usable GPU, gloo otherwise) and the device."""
    if backend not in ("auto", "gloo", "nccl"):
        raise EnvError(f"backend={backend!r} is not supported.",
                       "Use backend='auto' (nccl with GPUs, gloo otherwise), 'nccl' or 'gloo'.")
    idx = device_index(env)
    cuda = idx is not None and torch.cuda.is_available()
    if backend == "auto":
        backend = "nccl" if cuda and dist.is_nccl_available() else "gloo"
    elif backend == "nccl" and not cuda:
        raise EnvError(f"backend='nccl' but this rank has no usable GPU (device index {idx}, "
                       f"torch.cuda.is_available()={torch.cuda.is_available()}).",
                       "Use backend='auto' or 'gloo' on CPU, or request GPUs for the job.")
    return backend, torch.device("cuda", idx) if cuda else torch.device("cpu")


def setup_ddp(rank: int | None = None, world_size: int | None = None, *,
              env: DistEnv | None = None, backend: str = "auto", init_method: str = "env://",
              timeout: timedelta | float = timedelta(minutes=30)) -> DistContext:
    """Initialise the default process group for this rank and bind its device (see module doc).

    ``timeout`` (a timedelta or seconds) bounds the rendezvous and, for gloo and nccl with
    async error handling, every collective. A world of one still gets a (trivial) process
    group, so the same code runs everywhere.
    """
    if group_initialized():
        raise EnvError("setup_ddp: the default process group is already initialised.",
                       "Call cleanup_ddp() first, or use the process group that exists.")
    env = _with_overrides(env or detect(), rank, world_size)
    init_method = _check_init_method(init_method)
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    backend, device = _backend_and_device(backend, env)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if backend == "nccl":
        for k, v in NCCL_DEFAULTS.items():
            os.environ.setdefault(k, v)
    rdzv_host = urlparse(init_method).hostname if init_method.startswith("tcp://") else None
    ifname = _choose_ifname(backend, env, rdzv_host)
    if init_method == "env://":
        env.export()
    kwargs = {"device_id": device} if backend == "nccl" else {}
    called = time.time()
    dist.init_process_group(backend=backend, init_method=init_method, rank=env.rank,
                            world_size=env.world_size, timeout=timeout, **kwargs)
    mark_rendezvous(called)   # the restart phases' import and rendezvous (runlogs/startup.py)
    log.info("rank %d/%d (node %d, local %d) backend=%s device=%s init=%s", env.rank,
             env.world_size, env.node_rank, env.local_rank, backend, device, init_method)
    return DistContext(env, backend, device, init_method, ifname)


def cleanup_ddp() -> None:
    """Destroy the default process group without a barrier; a no-op when none exists.

    A DistributedDataParallel wrapper sits in a reference cycle; freed only at interpreter exit,
    after the group is gone, its reducer aborts the process now and then ("terminate called
    without an active exception"). Collecting first frees it while the group still exists.

    Create one process group per process: a second ``setup_ddp`` on the same MASTER_PORT right
    after this can reach a peer's old store before that peer has torn it down (no barrier here,
    so that a failing rank can always leave) and fail with "Connection closed by peer".
    """
    if group_initialized():
        gc.collect()
        dist.destroy_process_group()


def group_initialized() -> bool:
    """torch.distributed is available and the default process group exists (a world of one too)."""
    return dist.is_available() and dist.is_initialized()


def group_has_peers() -> bool:
    """The default process group exists and holds more than this rank: collectives reach peers."""
    return group_initialized() and dist.get_world_size() > 1


def is_main() -> bool:
    """Rank 0 of the initialised world (True in a plain single process)."""
    return not group_initialized() or dist.get_rank() == 0


def barrier(group=None) -> None:
    """``dist.barrier`` that is a no-op without a process group."""
    if group_initialized():
        dist.barrier(group=group)


# --- groups
def block_layout(tasks_per_node: Sequence[int]) -> list[tuple[int, int]]:
    """(node_rank, local_rank) per rank with ranks laid out node by node, e.g. (3, 1)."""
    return [(node, local) for node, n in enumerate(tasks_per_node) for local in range(n)]


def _layout(x: Union[DistEnv, Layout]) -> list[tuple[int, int]]:
    if not isinstance(x, DistEnv):
        return [(int(n), int(lr)) for n, lr in x]
    if x.world_size != x.num_nodes * x.local_world_size:
        raise EnvError(
            f"uneven layout ({x.world_size} ranks, {x.num_nodes} nodes, {x.local_world_size} on "
            f"node {x.node_rank}): one rank's DistEnv cannot tell the other nodes' rank counts.",
            "Pass the layout (gather_layout(env) in a running job, or block_layout([3, 1])).")
    return block_layout([x.local_world_size] * x.num_nodes)


def _ranks_by(x: Union[DistEnv, Layout], field: int) -> list[list[int]]:
    """Ranks grouped by field 0 (node rank) or 1 (local rank) of their layout entry, in key order."""
    lists: dict[int, list[int]] = {}
    for rank, where in enumerate(_layout(x)):
        lists.setdefault(where[field], []).append(rank)
    return [lists[k] for k in sorted(lists)]


def node_rank_lists(x: Union[DistEnv, Layout]) -> list[list[int]]:
    """The ranks of each node, node by node: 2x2 -> [[0, 1], [2, 3]]."""
    return _ranks_by(x, 0)


def strided_rank_lists(x: Union[DistEnv, Layout]) -> list[list[int]]:
    """The ranks sharing a local rank, across nodes: 6 ranks on 2 nodes -> [0,3],[1,4],[2,5]."""
    return _ranks_by(x, 1)


def leader_ranks(x: Union[DistEnv, Layout]) -> list[int]:
    """Local rank 0 of each node: 2x2 -> [0, 2]."""
    return strided_rank_lists(x)[0]


def gather_layout(env: DistEnv) -> list[tuple[int, int]]:
    """Every rank's (node_rank, local_rank), gathered over the world (a collective): exact for
    uneven and non-contiguous (cyclic) rank placements."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, (env.node_rank, env.local_rank))
    return [tuple(t) for t in out]


def new_groups(rank_lists: Sequence[Sequence[int]], *, timeout: timedelta | None = None):
    """Create every group on every rank in the same order (torch requires it); return the
    caller's group, or None when the caller is in none. All ranks must call it with equal lists.
    """
    lists = [[int(r) for r in ranks] for ranks in rank_lists]
    world, seen = dist.get_world_size(), {}
    for ranks in lists:
        for r in ranks:
            if not 0 <= r < world:
                raise ValueError(f"new_groups: rank {r} in {ranks} is outside 0..{world - 1}")
            if r in seen:
                raise ValueError(f"new_groups: rank {r} is in both {seen[r]} and {ranks}; "
                                 "groups of one call must not overlap")
            seen[r] = ranks
        if not ranks:
            raise ValueError(f"new_groups: empty rank list in {lists}")
    mine, _ = dist.new_subgroups_by_enumeration(lists, timeout=timeout)
    return mine


def node_group(env: DistEnv):
    """The group of this rank's node (a collective: every rank calls it)."""
    return new_groups(node_rank_lists(gather_layout(env)))


def leaders_group(env: DistEnv):
    """Local rank 0 of every node; None on the other ranks (a collective: every rank calls it)."""
    return new_groups([leader_ranks(gather_layout(env))])


def strided_groups(env: DistEnv):
    """This rank's group of equal local ranks across nodes (a collective: every rank calls it)."""
    return new_groups(strided_rank_lists(gather_layout(env)))
