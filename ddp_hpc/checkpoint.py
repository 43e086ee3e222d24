"""Checkpoints for your own training script: ``save`` on every rank, ``load`` on every rank.

    from ddp_hpc import checkpoint

    state = checkpoint.load(ckpt_dir, model, opt)          # None on the first run
    start = state["step"] if state else 0
    ...
    checkpoint.save(ckpt_dir, model, opt, step=step, epoch=epoch)   # any plain extras
    saving = checkpoint.save(ckpt_dir, model, opt, step=step, blocking=False)   # in the background
    saving.wait()                                           # the file is complete (or this raises)
    checkpoint.snapshot(model, opt, step=step)              # every step: node memory, cheap
    ...
    checkpoint.discard_snapshots()                          # the clean end: the snapshots go

The files are the training core's (``ddp_hpc.train.checkpoint``): ``ckpt-<step>.pt`` written
atomically by rank 0 (a temporary file, fsync, rename), the newest ``keep_last`` kept, read with
``torch.load(weights_only=True)`` (no pickled code runs), a broken file skipped for the next newest.
The model's state dict is saved without DDP's ``module.`` prefix (the model is unwrapped), so a
checkpoint loads into a plain model as well as into a DDP one.  When torch.distributed is
initialised, ``save`` ends with a barrier (no rank runs ahead of the file, or, with
``blocking=False``, of the copy) and in ``load`` rank 0 picks the checkpoint and every rank loads
that one, so the directory must be one every node sees.

``blocking=False`` (``ddp_hpc.train.asyncsave``): rank 0 only copies the state to CPU buffers kept
between saves and a background thread writes the file; ``save`` returns a `Saving` handle.  One
save is in flight at a time (the next ``save`` waits for it); a failed write raises on the next
``save``, on ``wait()`` or the handle's ``wait()``, and is printed at exit otherwise; ``load``,
`ddp_hpc.preemption.requeue` and the interpreter's exit wait for the write.

``snapshot`` keeps the same state in node-local shared memory (``ddp_hpc.train.memsnap``: the
node's local rank 0 writes it in a background thread, no file, no barrier); ``load`` takes the
newest of the memory snapshots of every node and the files (``ddp_hpc.train.restore``: a node that
holds it sends it to the ranks whose node does not), so a restart inside the allocation goes on
from the last snapshot. ``discard_snapshots`` at the clean end removes them.
"""
from __future__ import annotations

import atexit
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddp_hpc.dist import group_initialized
from ddp_hpc.env import detect
from ddp_hpc.progress import rank_log
from ddp_hpc.train.asyncsave import AsyncSaver, PendingSave
from ddp_hpc.train.checkpoint import CheckpointError
from ddp_hpc.train.memsnap import MemSnapshots
from ddp_hpc.train.restore import node_store, restore_run

__all__ = ["save", "load", "wait", "snapshot", "discard_snapshots", "last_saved_step", "unwrap", "Saving",
           "CheckpointError"]

_PLAIN = (int, float, str, bool, type(None), torch.Tensor)
_last_saved: list[int] = []
_snaps: list[MemSnapshots] = []       # this process's snapshot writer, made by the first snapshot


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DistributedDataParallel / DataParallel / torch.compile wrappers."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


def _rank() -> int:
    return dist.get_rank() if group_initialized() else detect().rank


def _check_plain(value: Any, where: str) -> None:
    """Extras must load with weights_only=True: numbers, strings, tensors, lists and dicts."""
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_plain(v, f"{where}[{k!r}]")
    elif not isinstance(value, _PLAIN):
        raise CheckpointError(
            f"checkpoint.save: {where} ({type(value).__name__}) cannot be loaded again: "
            "torch.load(weights_only=True) refuses it",
            "pass plain numbers, strings, tensors, lists or dicts (e.g. float(x), x.tolist())")


def _written(saved: PendingSave) -> None:
    log = rank_log()
    if log is not None:
        log.event("checkpoint", step=saved.step, path=str(saved.path),
                  blocking_s=round(saved.blocking_s, 6), write_s=round(saved.write_s, 6))


_saver = AsyncSaver(on_written=_written)


class Saving:
    """What ``save(..., blocking=False)`` returns: `wait` blocks until the file is complete."""

    def __init__(self, pending: PendingSave | None) -> None:
        self._pending = pending

    @property
    def path(self) -> Path | None:
        """Where the file goes (rank 0); None on other ranks."""
        return self._pending.path if self._pending is not None else None

    @property
    def done(self) -> bool:
        return self._pending is None or self._pending.done

    def wait(self) -> Path | None:
        """The path once the file is complete (None on other ranks); a failed write raises a
        `CheckpointError` naming the file and the error."""
        return self._pending.wait() if self._pending is not None else None


def save(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         step: int, keep_last: int = 3, blocking: bool = True, **extra: Any) -> Path | Saving | None:
    """Rank 0 writes ``<directory>/ckpt-<step>.pt`` (model without ``module.``, optimizer, extras)
    and returns its path; other ranks return None.  With ``blocking=False`` rank 0 copies the state
    and a background thread writes it: every rank gets a `Saving` handle.  Call it on every rank
    (a barrier when distributed).  A failed earlier background write raises here.  Extras come
    back from `load`."""
    _check_plain(extra, "extras")
    pending, failed = None, None
    if _rank() == 0:
        state = {"model": unwrap(model).state_dict(),
                 "optimizer": optimizer.state_dict() if optimizer is not None else None,
                 "epoch": extra.get("epoch"), "batch_in_epoch": extra.get("batch_in_epoch"),
                 "extra": extra}
        rank_log()         # opened here, on the caller's thread: the writer's thread only writes
        try:
            pending = _saver.save(directory, int(step), state, keep_last, blocking=blocking)
        except CheckpointError as e:
            failed = e
    if group_initialized():
        dist.barrier()               # every rank passes it, also when rank 0 raises below
    if failed is not None:
        raise failed
    _last_saved[:] = [int(step)]
    if not blocking:
        return Saving(pending)
    return pending.path if pending is not None else None


def wait() -> Path | None:
    """Wait for this process's background save (``blocking=False``); its path, None when there
    is none, or its failure raised as a `CheckpointError`."""
    return _saver.wait()


@atexit.register
def _wait_at_exit() -> None:
    """A script that ends without waiting: its last write ends first, a failure is printed."""
    try:
        _saver.wait()
    except CheckpointError as e:
        print(f"ddp_hpc.checkpoint: {e}", file=sys.stderr, flush=True)
        log = rank_log()
        if log is not None:
            log.warning(str(e))


def last_saved_step() -> int | None:
    """The step of the newest `save` in this process, None before the first."""
    return _last_saved[0] if _last_saved else None


def load(directory_or_file: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         map_location: Any = "cpu") -> dict | None:
    """Load the newest valid checkpoint in a directory (or the given file) into ``model`` (plain
    or DDP; saved with or without ``module.``) and ``optimizer``; returns the extras saved with it
    plus ``step``, or None when there is no checkpoint yet; a node's memory snapshot (`snapshot`)
    newer than the newest file is taken instead of it.  Call it on every rank."""
    _saver.join()                     # this process's background save first
    if _snaps:
        _snaps[0].wait()                # this process's last snapshot whole before the ranks compare
    env = detect()
    store = None if Path(directory_or_file).is_file() else node_store(env, 0, _warn, make=False)
    got = restore_run(directory_or_file, store, _rank(), group_initialized(), rank_log(), map_location)
    if got.state is None:
        return None
    state = got.state
    weights = state["model"]
    if weights and all(k.startswith("module.") for k in weights):
        weights = {k.removeprefix("module."): v for k, v in weights.items()}
    unwrap(model).load_state_dict(weights)
    if optimizer is not None and state.get("optimizer") is not None:
        optimizer.load_state_dict(state["optimizer"])
    return {**(state.get("extra") or {}), "step": int(state["step"])}


def _warn(msg: str) -> None:
    log = rank_log()
    if log is not None:
        log.warning(msg)


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, step: int,
             **extra: Any) -> None:
    """Every rank: keep the state `save` would write in node-local shared memory (the node's
    local rank 0 copies the model and optimizer, each rank its RNG states; written in the
    background, at most one snapshot in flight). No file, no barrier: call it every step or so."""
    _check_plain(extra, "extras")
    if not _snaps:
        env = detect()
        store = node_store(env, 0, _warn)
        if store is None:
            return
        device = next(iter(unwrap(model).parameters()), torch.empty(0)).device
        _snaps.append(MemSnapshots(store, rank=_rank(), local_rank=env.local_rank, every=1, device=device,
                                   distributed=group_initialized(), warn=_warn))
    _snaps[0].take(int(step), lambda: {
        "model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "epoch": extra.get("epoch"), "batch_in_epoch": extra.get("batch_in_epoch"), "extra": extra})


def discard_snapshots() -> None:
    """Every rank, at the clean end of training: the snapshots' writes end, then each node's go
    (a barrier when distributed). A failed run keeps them for the restart."""
    if _snaps:
        _snaps.pop().finish()
