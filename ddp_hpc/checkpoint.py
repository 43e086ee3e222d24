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
save is in flight at a time (the next ``save`` waits for it); a failed write is told in the run
log at once and raises on the next ``save``, on ``wait()`` or the handle's ``wait()``; ``load``,
`ddp_hpc.preemption.requeue` and the interpreter's exit wait for the write.  A failure nobody
waited for is printed at exit with its traceback (``ddp_hpc.exec`` makes its ``error`` event of
it) and the script exits with status 1, not 0 (`_ExitStatus`).

Signs of life (with a run log, ``$DDP_HPC_LOG_DIR``): rank 0's ``save`` writes a ``progress`` event
of phase ``checkpoint`` as it starts and, like the training core, again at most every 5 s while
it waits for the previous write (``wait()`` too), then the ``checkpoint`` event once the file is
complete: the supervisor calls no hang in between, however long a big save takes.

``snapshot`` keeps the same state in node-local shared memory (``ddp_hpc.train.memsnap``: the
node's local rank 0 writes it in a background thread, no file, no barrier); ``load`` takes the
newest of the memory snapshots of every node and the files (``ddp_hpc.train.restore``: a node that
holds it sends it to the ranks whose node does not), so a restart inside the allocation goes on
from the last snapshot. ``discard_snapshots`` at the clean end removes them.  The snapshots belong
to a checkpoint directory, as the training core's do (``memsnap.job_folder``'s key): the one this
process gave ``load`` (what a restart loads again), else ``save``, as known at the first
``snapshot``; ``load`` reads only its directory's, so two runs in one job (a sweep's tasks) never
take or remove each other's.  Before ``load`` or ``save`` named a directory, ``snapshot`` takes
none (warned once).
"""
from __future__ import annotations

import atexit
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ddp_hpc.dist import group_initialized
from ddp_hpc.env import detect
from ddp_hpc.progress import hang_watch, rank_log
from ddp_hpc.train.asyncsave import AsyncSaver, PendingSave
from ddp_hpc.train.checkpoint import CheckpointError
from ddp_hpc.train.memsnap import MemSnapshots
from ddp_hpc.train.restore import node_store, restore_run

__all__ = ["save", "load", "wait", "snapshot", "discard_snapshots", "last_saved_step", "unwrap", "Saving",
           "CheckpointError"]

_PLAIN = (int, float, str, bool, type(None), torch.Tensor)
_last_saved: list[int] = []
_snaps: list[MemSnapshots] = []       # this process's snapshot writer, made by the first snapshot
_dirs: dict[str, str] = {}            # "load" / "save": the directory (absolute) each was last given
_told: set[str] = set()               # the one-time warnings given
_exit_status: list = []               # an `_ExitStatus` once the last write failed at exit
_PID = os.getpid()


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


def _write_failed(msg: str) -> None:
    """A background write failed (the writer's thread): the run log (else stderr) says so at once."""
    log = rank_log()
    if log is not None:
        log.warning(msg)
    else:
        print(f"ddp_hpc.checkpoint: {msg}", file=sys.stderr, flush=True)


_saver = AsyncSaver(on_written=_written, on_failed=_write_failed)


def _tick(step: int | None, now: bool = False) -> Callable[[], None] | None:
    """With a run log: what tells, at most every 5 s while a save is waited for, that this rank
    is saving (``HangWatch.alive``: a ``progress`` event of phase ``checkpoint``, as the training
    core's); ``now``: a save starts, its event goes at once (the supervisor then calls no hang
    until this rank's ``checkpoint`` event). None without a run log: nothing to tell."""
    watch = hang_watch()
    if watch is None:
        return None
    if now:
        watch.alive("checkpoint", step, every_s=0.0)
    return lambda: watch.alive("checkpoint", step)


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
        return self._pending.wait(_tick(self._pending.step)) if self._pending is not None else None


def save(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         step: int, keep_last: int = 3, blocking: bool = True, **extra: Any) -> Path | Saving | None:
    """Rank 0 writes ``<directory>/ckpt-<step>.pt`` (model without ``module.``, optimizer, extras)
    and returns its path; other ranks return None.  With ``blocking=False`` rank 0 copies the state
    and a background thread writes it: every rank gets a `Saving` handle.  Call it on every rank
    (a barrier when distributed).  A failed earlier background write raises here.  Extras come
    back from `load`."""
    _check_plain(extra, "extras")
    _dirs["save"] = os.path.abspath(directory)
    pending, failed = None, None
    if _rank() == 0:
        state = {"model": unwrap(model).state_dict(),
                 "optimizer": optimizer.state_dict() if optimizer is not None else None,
                 "epoch": extra.get("epoch"), "batch_in_epoch": extra.get("batch_in_epoch"),
                 "extra": extra}
        tick = _tick(int(step), now=True)   # opens the run log here: the writer's thread only writes
        try:
            pending = _saver.save(directory, int(step), state, keep_last, blocking=blocking, tick=tick)
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
    pending = _saver.pending
    return _saver.wait(_tick(pending.step) if pending is not None else None)


class _ExitStatus:
    """A script whose last checkpoint was not written must not end with status 0, and Python
    lets no exit handler change the status: this object, kept in a module global, ends the
    process with ``code`` when the interpreter's teardown frees it, after every ``atexit``
    handler ran and stdout/stderr were flushed (like `ddp_hpc.preemption`'s exit, without the
    rest of the native teardown)."""

    def __init__(self, code: int) -> None:
        self.code, self.pid, self._getpid, self._exit = code, os.getpid(), os.getpid, os._exit

    def __del__(self) -> None:
        if self._getpid() == self.pid:
            self._exit(self.code)


@atexit.register
def _wait_at_exit() -> None:
    """A script that ends without waiting: its last write ends first (Python joined the writer
    thread already). A failure is told on stderr and in the run log; unless the script already
    fails with an exception of its own (whose traceback must stay the last one: ``ddp_hpc.exec``
    makes the ``error`` event of it), the failure's traceback follows and the exit status becomes
    1 (also after ``sys.exit(n)``: Python does not tell n to an exit handler)."""
    if os.getpid() != _PID:      # a forked child: the write in flight is its parent's
        return
    try:
        _saver.wait()
    except CheckpointError as e:
        own = getattr(sys, "last_value", None) is not None     # the script failed by itself
        then = "" if own else "; the script exits with status 1"
        print(f"ddp_hpc.checkpoint: {e.problem}{then}", file=sys.stderr, flush=True)
        log = rank_log()
        if log is not None:
            log.warning(f"{e.problem}: the script's last checkpoint is missing{then}")
        if not own:
            traceback.print_exception(e)
            sys.stderr.flush()
            _exit_status.append(_ExitStatus(1))


def last_saved_step() -> int | None:
    """The step of the newest `save` in this process, None before the first."""
    return _last_saved[0] if _last_saved else None


def load(directory_or_file: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         map_location: Any = "cpu") -> dict | None:
    """Load the newest valid checkpoint in a directory (or the given file) into ``model`` (plain
    or DDP; saved with or without ``module.``) and ``optimizer``; returns the extras saved with it
    plus ``step``, or None when there is no checkpoint yet; a node's memory snapshot (`snapshot`)
    newer than the newest file is taken instead of it (only this directory's snapshots: two
    runs of one job keep theirs apart).  Call it on every rank."""
    _saver.join()                     # this process's background save first
    if _snaps:
        _snaps[0].wait()                # this process's last snapshot whole before the ranks compare
    env = detect()
    store = None
    if not Path(directory_or_file).is_file():
        _dirs["load"] = os.path.abspath(directory_or_file)
        store = node_store(env, 0, _warn, make=False, key=_dirs["load"])
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


def _snapshot_dir() -> str | None:
    """The checkpoint directory this process's snapshots belong to: `load`'s (what a restart
    loads again), else `save`'s; None before either."""
    return _dirs.get("load") or _dirs.get("save")


def _once(key: str, msg: str) -> None:
    if key not in _told:
        _told.add(key)
        log = rank_log()
        if log is not None:
            log.warning(msg)
        elif _rank() == 0:
            print(f"ddp_hpc.checkpoint: {msg}", file=sys.stderr, flush=True)


def _writer(model: nn.Module) -> MemSnapshots | None:
    """This process's snapshot writer for its checkpoint directory (None: none yet, or off)."""
    key = _snapshot_dir()
    if key is None:
        _once("no-dir", "no memory snapshot yet: snapshots belong to the checkpoint directory that "
                        "load() (else save()) was given, so that two runs of one job never take each "
                        "other's; call checkpoint.load(ckpt_dir, ...) before the first snapshot")
        return None
    env = detect()
    store = node_store(env, 0, _warn, key=key)
    if store is None:
        return None
    device = next(iter(unwrap(model).parameters()), torch.empty(0)).device
    return MemSnapshots(store, rank=_rank(), local_rank=env.local_rank, every=1, device=device,
                        distributed=group_initialized(), warn=_warn)


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, step: int,
             **extra: Any) -> None:
    """Every rank: keep the state `save` would write in node-local shared memory (the node's
    local rank 0 copies the model and optimizer, each rank its RNG states; written in the
    background, at most one snapshot in flight). No file, no barrier: call it every step or so.
    The snapshots belong to the directory this process gave `load` (else `save`): none before."""
    _check_plain(extra, "extras")
    if not _snaps:
        writer = _writer(model)
        if writer is None:
            return
        _snaps.append(writer)
    _snaps[0].take(int(step), lambda: {
        "model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "epoch": extra.get("epoch"), "batch_in_epoch": extra.get("batch_in_epoch"), "extra": extra})


def discard_snapshots() -> None:
    """Every rank, at the clean end of training: the snapshots' writes end, then each node's go
    (a barrier when distributed). A failed run keeps them for the restart."""
    if _snaps:
        _snaps.pop().finish()
