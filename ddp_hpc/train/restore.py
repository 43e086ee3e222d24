"""Restore from the freshest copy: a node's memory snapshot (train/memsnap.py) or the newest file
checkpoint, whichever holds the later step.

Every rank says, in one all_gather, what its node holds in memory (step, size) and rank 0 adds the
newest file checkpoint's step (a directory listing: no file is read for it). When some node holds
a memory snapshot at least as new as the newest file, the ranks of that node load it from their
memory; when any rank's node lacks it (a spare or replaced node, a node whose snapshot is older),
the lowest rank that holds it sends the file's bytes to every rank in one broadcast over the job's
own process group, and the shared filesystem is not read at all. Only when no node holds anything
newer does rank 0 pick the newest file checkpoint that loads, and every rank loads that one.

The state's per-rank part (each rank's RNG states) comes from the snapshot folders that still
hold it: one more all_gather of what each node holds; a rank whose part went with its node is
seeded from the other ranks' states (``train.reshape.rank_rng``), as on a change of world size.

The broadcast is a plain ``dist.broadcast`` of the file's bytes: the data loader's `Channel`
(data/wire.py) frames buckets of samples from a group's lowest rank, while the holder here is
any rank and the message is one file.
"""
from __future__ import annotations

import io
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ddp_hpc.errors import HintError
from ddp_hpc.judge.restarts import restored_text
from ddp_hpc.train.checkpoint import CheckpointError, find_latest_valid, list_checkpoints, load_checkpoint
from ddp_hpc.train.memsnap import NodeStore, comm_device, store_for

__all__ = ["Restored", "freshest", "node_store", "restore_run", "announce"]


@dataclass
class Restored:
    """Where a (re)start's state came from: ``source`` memory | peer | file | none, the node that
    held it, the time taken, the file (if any), the nodes of the snapshot's run that no longer hold
    it (gone, replaced, or emptied)."""

    step: int
    source: str
    node: str | None = None
    seconds: float = 0.0
    path: str | None = None
    lost: list[str] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)     # this run's nodes
    state: dict | None = None

    def line(self) -> str:
        """``restored step 212 from n1's memory (n2 was lost), 0.4 s`` (judge.restarts' words)."""
        return restored_text(self.event()) or "nothing to restore: starting at step 0"

    def event(self) -> dict:
        """The ``restored`` event's keys (runlogs/schema.py)."""
        return {"step": self.step, "source": self.source, "node": self.node,
                "seconds": round(self.seconds, 3), "path": self.path, "lost": self.lost}


def _gather(value: Any, distributed: bool) -> list:
    if not distributed:
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _broadcast_file(path: Path | None, size: int, src: int) -> torch.Tensor:
    """The bytes of ``path`` (read on rank ``src``) on every rank, as a CPU uint8 tensor."""
    buf = torch.empty(size, dtype=torch.uint8)
    if path is not None:
        with open(path, "rb") as f:
            f.readinto(memoryview(buf.numpy()))
    dev = comm_device()
    moved = buf.to(dev) if dev.type != "cpu" else buf
    dist.broadcast(moved, src=src)
    return moved.cpu() if dev.type != "cpu" else moved


def _held(store: NodeStore | None, files: str | Path | None, rank: int) -> dict:
    mem = store.newest() if store is not None else None
    newest_file = None
    if rank == 0 and files is not None:
        src = Path(files)
        found = [(0, src)] if src.is_file() else list_checkpoints(src)
        newest_file = found[0][0] if found else None
    return {"mem": mem[0] if mem else None, "size": mem[1].stat().st_size if mem else 0,
            "node": store.node if store is not None else None, "file": newest_file,
            "any_file": bool(rank == 0 and files is not None and Path(files).is_file())}


def _from_memory(store: NodeStore, table: list[dict], step: int, rank: int, distributed: bool,
                 map_location: Any) -> tuple[dict, str, int]:
    """(state, source, the sending rank): this node's snapshot, or the holder's sent over."""
    src = min(r for r, held in enumerate(table) if held["mem"] == step)
    mine = store is not None and table[rank]["mem"] == step
    path = store.folder / f"ckpt-{step:09d}.pt" if store is not None else None
    state, source = None, "memory"
    if any(held["mem"] != step for held in table):   # first the bytes to the ranks that lack them
        data = _broadcast_file(path if rank == src else None, table[src]["size"], src)
        if not mine:
            state, source = load_checkpoint(io.BytesIO(data.numpy().tobytes()), map_location), "peer"
    if mine:
        state = load_checkpoint(path, map_location)
    first_here = min(r for r, held in enumerate(table) if held["node"] == table[rank]["node"])
    parts: dict[int, dict] = {}
    # the first rank of each node reads the parts its node holds (also a node whose model snapshot
    # is older or gone: its ranks' RNG states may still be there)
    for held in _gather(store.parts(step) if store is not None and first_here == rank else {}, distributed):
        parts.update(held)
    written = int(state.get("world_size") or len(table))
    state["rng"] = [parts.get(r, {}).get("rng") for r in range(written)]
    return state, source, src


def _from_file(files: str | Path, rank: int, distributed: bool, warn, map_location: Any,
               hint: str) -> tuple[str | None, dict | None]:
    """Rank 0 picks the newest file checkpoint that loads and tells the others; each loads it."""
    src, found = Path(files), None
    if rank == 0:
        found = (src, load_checkpoint(src, map_location)) if src.is_file() else \
            find_latest_valid(src, warn=warn, map_location=map_location)
    box = [str(found[0]) if found else None]
    if distributed:
        dist.broadcast_object_list(box, src=0)
    if box[0] is None or rank == 0:
        return box[0], (found[1] if found else None)
    try:
        return box[0], load_checkpoint(box[0], map_location)
    except Exception as exc:
        raise CheckpointError(f"rank {rank} cannot load checkpoint {box[0]} that rank 0 chose: "
                              f"{type(exc).__name__}: {exc}", hint) from exc


def freshest(files: str | Path | None, store: NodeStore | None, *, rank: int, distributed: bool,
             warn: Callable[[str], None] | None = None, map_location: Any = "cpu",
             hint: str = "keep checkpoints on a filesystem every node sees") -> Restored:
    """The newest state held anywhere (a collective: every rank calls it). ``files``: the
    checkpoint directory (or one file), ``store``: this node's snapshot folder (None: no memory
    tier); ``hint``: the fix when a rank cannot read the file rank 0 chose."""
    t0 = time.perf_counter()
    table = _gather(_held(store, files, rank), distributed)
    nodes = sorted({held["node"] for held in table if held["node"]})
    steps = [held["mem"] for held in table if held["mem"] is not None]
    best, newest_file = (max(steps) if steps else None), table[0]["file"]
    if best is not None and not table[0]["any_file"] and (newest_file is None or best >= newest_file):
        state, source, src = _from_memory(store, table, best, rank, distributed, map_location)
        holders = {held["node"] for held in table if held["mem"] == best}
        lost = sorted(set(state.get("nodes") or []) - holders)      # the snapshot's nodes that lost it
        path = str(store.folder.parent / table[src]["node"] / f"ckpt-{best:09d}.pt") if store else None
        return Restored(best, source, table[src]["node"], time.perf_counter() - t0, path, lost, nodes, state)
    if files is None:
        return Restored(0, "none", seconds=time.perf_counter() - t0, nodes=nodes)
    path, state = _from_file(files, rank, distributed, warn, map_location, hint)
    if path is None:
        return Restored(0, "none", seconds=time.perf_counter() - t0, nodes=nodes)
    return Restored(int(state["step"]), "file", None, time.perf_counter() - t0, path, [], nodes, state)


def node_store(env, every: int, warn: Callable[[str], None], make: bool = True,
               key: str | None = None, note: Callable[[str], None] | None = None) -> NodeStore | None:
    """This node's snapshot folder (made, with ``make``; ``key``: memsnap.job_folder's), None when
    snapshots are off (``every`` -1), outside a job (no job id: no restart inside an allocation to
    serve, and a later run must not find a stale snapshot), or the folder cannot be made (warned:
    the file tier goes on alone). Made, the node's local rank 0 also frees what ended jobs left
    beside it, in the background (``note`` hears what: `memsweep`)."""
    if every < 0 or not env.job_id:
        return None
    try:
        store = store_for(env, key=key)
        if make:
            store.make()
            if env.local_rank == 0:
                store.sweep_ended_jobs(note)
        return store
    except (OSError, HintError) as exc:
        warn(f"memory snapshots off: {exc}")
        return None


def restore_run(files: str | Path, store: NodeStore | None, rank: int, distributed: bool, log,
                map_location: Any = "cpu", now: bool = True) -> Restored:
    """`freshest` for the training loop (or a script: ``log`` may be None); ``now``: `announce`
    it at once (the loop does it after its ``start`` event)."""
    got = freshest(files, store, rank=rank, distributed=distributed, map_location=map_location,
                   warn=log.warning if log is not None else None,
                   hint=f"keep checkpoints on a filesystem every node sees (checkpoint.dir is {files})")
    if now:
        announce(got, log, rank)
    return got


def announce(got: Restored, log, rank: int) -> None:
    """Every rank writes its ``restored`` event; rank 0 logs where the state came from."""
    if log is not None:
        log.event("restored", **got.event())
        if rank == 0:
            log.info(got.line())
