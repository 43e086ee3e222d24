"""The two calls the training loop makes for ``data.io``: open the data, then batch an epoch.

    ds = open_train_data(cfg.data, ctx, dataset_factory)            # once, on every rank
    for inputs, targets in make_train_batches(ds, cfg.data, ctx, batch_size=B, seed=S,
                                              epoch=e, start_batch=k, num_workers=W): ...
    close_train_data(ds, cfg.data, ctx, completed=True)             # optional stage cleanup

With ``data.io=stage`` each node leader logs where the data went, how many bytes, how long it took
and how (``copy`` | ``sbcast`` | ``reused``): a line in its ``rank<R>.log`` and a ``stage`` event
in its node's ``node<K>.events.jsonl`` when the run's log directory is known at staging time
(``$DDP_HPC_LOG_DIR``: the submit backends set it); otherwise :func:`take_stage_log` hands both
to the training core, which writes them once its run log is open.

``data.io``:
* ``direct``: ``dataset_factory()``, every rank reads its own files;
* ``lmdb``: ``LMDBDataset(data.lmdb_path)`` (one open per process);
* ``stage``: local rank 0 of each node copies ``data.lmdb_path`` (or the dataset's ``root``
  folder) to ``data.stage_to``; every rank then reads the node-local copy;
* ``broadcast``: the dataset (or ``data.lmdb_path``) stays on the shared directory and only the
  group readers of ``data.broadcast_groups`` read it.

Every path yields, for each rank, exactly ``DistributedSampler(shuffle=True, seed=seed,
drop_last=False)``'s samples for the epoch, in order, from batch ``start_batch`` on.
"""
from __future__ import annotations

import logging
import os
import weakref
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ddp_hpc.data.broadcast import BroadcastDataset, build_plan
from ddp_hpc.data.errors import IOConfigError, StageError
from ddp_hpc.data.lmdb import LMDBDataset
from ddp_hpc.data.nodestage import node_user, rank_user, release_on_node, stage_log_entry, stage_on_node, write_run_log
from ddp_hpc.data.samplers import ResumableDistributedSampler
from ddp_hpc.data.sbcast import sbcast_stage
from ddp_hpc.data.stage import StageResult, resolve_stage_dir, staged_here
from ddp_hpc.dist import group_has_peers, group_initialized

__all__ = ["open_train_data", "make_train_batches", "close_train_data", "take_stage_log", "IOConfigError",
           "STAGE_WAIT"]

log = logging.getLogger("ddp_hpc.data.io")
#: how long ranks wait for another node's staging before giving up (the default collective
#: timeout is 30 min; a first copy of a large dataset can take longer).
STAGE_WAIT = timedelta(hours=6)
_loaders: dict = {}
_staged: dict = {}        # id(dataset) -> (staged path, this node leader's name)
_stage_logs: dict = {}    # id(dataset) -> [(line, event fields)] not written to a run log yet


def _need_lmdb(data_cfg) -> str:
    if not data_cfg.lmdb_path:
        raise IOConfigError(f"data.io={data_cfg.io} needs data.lmdb_path, which is not set",
                            "pack the dataset once (python -m ddp_hpc.data pack SRC OUT.lmdb) and set "
                            "data.lmdb_path=OUT.lmdb")
    return data_cfg.lmdb_path


def _long_barrier_group():
    """A gloo group with a long timeout, created before staging (a collective)."""
    if not group_has_peers():
        return None
    return dist.new_group(backend="gloo", timeout=STAGE_WAIT)


def _stage_dataset(data_cfg, ctx, dataset_factory):
    env = ctx.env
    group = _long_barrier_group()
    if data_cfg.lmdb_path:
        base, src = None, data_cfg.lmdb_path
    else:
        base = dataset_factory()
        src = getattr(base, "root", None)
        if src is None or not hasattr(base, "relocated"):
            raise IOConfigError(f"data.io=stage without data.lmdb_path needs a dataset with a .root folder "
                                f"and .relocated(path); {type(base).__name__} has neither",
                                "set data.lmdb_path to a packed LMDB (python -m ddp_hpc.data pack)")
    dest = resolve_stage_dir(data_cfg.stage_to)
    _sbcast_to_nodes(src, dest, env, group)
    res = stage_on_node(src, dest, env, wait_timeout=STAGE_WAIT.total_seconds())
    if group is not None:
        dist.barrier(group=group)  # every node staged before anyone enters a training collective
        dist.destroy_process_group(group)
    ds = LMDBDataset(res.path) if base is None else base.relocated(res.path)
    _staged[id(ds)] = res.path
    if env.local_rank == 0:
        _log_stage(ds, res, env)
    return ds


def _sbcast_to_nodes(src: str, dest: str, env, group) -> None:
    """On several Slurm nodes, when a node leader has no copy of this attempt's source yet (a
    first start, a spare that joined): global rank 0 reads the source once and Slurm's ``sbcast``
    puts it on every node (:mod:`ddp_hpc.data.sbcast`), for the node leaders to adopt.  Not when
    the nodes stage to different paths (sbcast writes one path on every node).  A failed sbcast
    is a warning: the nodes then copy as usual."""
    if group is None or env.num_nodes < 2 or not env.in_slurm or not env.job_id:
        return
    place = zlib.crc32(os.path.abspath(dest).encode())   # sbcast needs one path on every node
    facts = torch.tensor([0.0, float(place), -float(place)], dtype=torch.float64)
    if env.local_rank == 0:
        facts[0] = float(not staged_here(src, dest, env.job_id))
    dist.all_reduce(facts, op=dist.ReduceOp.MAX, group=group)
    if facts[1] != -facts[2]:
        log.info("stage: the nodes stage to different folders (%s here); each node copies %s", dest, src)
    elif facts[0] and env.rank == 0:
        try:
            out = sbcast_stage(src, dest)
            log.info("stage: sbcast %s (%d bytes) to every node in %.2f s", src, out["bytes"], out["seconds"])
        except (StageError, OSError) as e:
            log.warning("stage: sbcast of %s failed, every node copies it: %s", src, e)
    dist.barrier(group=group)


def _log_stage(ds, res: StageResult, env) -> None:
    line, fields = stage_log_entry(res, node_user(env))
    log.info(line)
    if not write_run_log(env, line, fields):
        _stage_logs[id(ds)] = [(line, fields)]  # for take_stage_log, once the run log is open


def take_stage_log(dataset) -> list[tuple[str, dict]]:
    """The ``(line, stage event fields)`` of this rank's staging not yet in a run log (none once
    taken; none on ranks that did not lead a node's staging): the training core writes them with
    ``log.info(line)`` and ``log.event("stage", **fields)`` after it opened its run log."""
    return _stage_logs.pop(id(dataset), [])


def open_train_data(data_cfg, ctx, dataset_factory):
    """The training dataset for ``data_cfg.io`` (every rank calls it at the same point)."""
    io = data_cfg.io
    if io == "direct":
        return dataset_factory()
    if io == "lmdb":
        return LMDBDataset(_need_lmdb(data_cfg))
    if io == "stage":
        return _stage_dataset(data_cfg, ctx, dataset_factory)
    if io == "broadcast":
        inner = LMDBDataset(data_cfg.lmdb_path) if data_cfg.lmdb_path else dataset_factory()
        if not group_initialized():
            raise IOConfigError("data.io=broadcast needs torch.distributed initialised (setup_ddp) first",
                                "call ddp_hpc.dist.setup_ddp() first, or train through fit / run_job, which do")
        device = ctx.device if getattr(ctx, "backend", "gloo") == "nccl" else None
        return BroadcastDataset(inner, build_plan(ctx.env, data_cfg.broadcast_groups, device),
                                coalesce_bytes=int(data_cfg.broadcast_bucket_mb * (1 << 20)))
    raise IOConfigError(f"data.io={io!r} is not direct, lmdb, stage or broadcast", "set data.io=direct")


def _loader(dataset, ctx, batch_size: int, seed: int, num_workers: int):
    """One DataLoader per (dataset, batch size, workers): persistent workers survive epochs."""
    key = (id(dataset), batch_size, seed, num_workers)
    hit = _loaders.get(key)
    if hit is not None and hit[0]() is dataset:
        return hit[1], hit[2]
    env = ctx.env
    sampler = ResumableDistributedSampler(len(dataset), env.world_size, env.rank, seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                        persistent_workers=num_workers > 0, drop_last=False,
                        pin_memory=getattr(ctx, "device", torch.device("cpu")).type == "cuda")
    _loaders[key] = (weakref.ref(dataset), loader, sampler)
    weakref.finalize(dataset, _loaders.pop, key, None)
    return loader, sampler


def make_train_batches(dataset, data_cfg, ctx, *, batch_size: int, seed: int, epoch: int,
                       start_batch: int = 0, num_workers: int = 0):
    """This rank's (inputs, targets) batches of ``epoch`` from batch ``start_batch`` on."""
    if batch_size < 1 or start_batch < 0:
        raise ValueError(f"make_train_batches: batch_size={batch_size}, start_batch={start_batch} "
                         "(need batch_size >= 1 and start_batch >= 0)")
    if isinstance(dataset, BroadcastDataset):
        return dataset.batches(batch_size=batch_size, seed=seed, epoch=epoch, start_batch=start_batch,
                               num_workers=num_workers)
    loader, sampler = _loader(dataset, ctx, batch_size, seed, num_workers)
    sampler.epoch, sampler.start = epoch, start_batch * batch_size * ctx.env.world_size  # global
    # A fresh iterator draws its base seed from `generator`, or from the global torch RNG when
    # there is none -- which would shift dropout & co. and break bitwise mid-epoch resume.
    loader.generator = torch.Generator().manual_seed(seed * 100003 + epoch)
    return iter(loader)


def close_train_data(dataset, data_cfg, ctx, *, completed: bool) -> None:
    """End of training (every rank calls it): give the staged copy back when ``data.stage_cleanup``
    and the run completed; a preempted run keeps it for its requeue.  A barrier first, so no rank
    still reads the copy when it goes.  Every rank of a node is a user of its copy
    (:mod:`ddp_hpc.data.nodestage`); the last one out, on whichever node shares the folder,
    removes it.  A removal that fails is logged as a warning with what is left and how to remove
    it; the run still counts as completed."""
    path = _staged.pop(id(dataset), None)
    _stage_logs.pop(id(dataset), None)
    if not (path and completed and data_cfg.stage_cleanup):
        return
    if group_has_peers():
        dist.barrier()
    env = ctx.env
    try:
        outcome, left = release_on_node(path, env)
    except (OSError, StageError) as e:
        msg = f"stage cleanup of {path} failed: {e}"
        if not write_run_log(env, msg, warning=True):  # RunLog.warning also prints it
            log.warning(msg)
        return
    msg = {"removed": f"stage cleanup: removed {path}",
           "kept": f"stage cleanup: {rank_user(env)} is done with {path}; kept for {', '.join(left)} (the "
                   "last one out removes it)",
           "gone": f"stage cleanup: {path} was already removed by another node leader sharing it"}[outcome]
    log.info(msg)
    if env.local_rank == 0:  # node leaders' run logs say what became of the copy
        write_run_log(env, msg)
