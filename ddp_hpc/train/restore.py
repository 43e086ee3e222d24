"""Restore from the freshest copy: a node's memory snapshot (train/memsnap.py) or the newest file
checkpoint, whichever holds the later step.

Every rank says, in one all_gather, what its node holds in memory (step, size) and rank 0 adds the
newest file checkpoint's step (a directory listing: no file is read for it). When some node holds
a memory snapshot at least as new as the newest file, the ranks of that node load it from their
memory; when any rank's node lacks it (a spare or replaced node, a node whose snapshot is older),
the lowest rank that holds it sends the file's bytes to the ranks that lack it, and only to them,
in bounded chunks (train/peercopy.py), and the shared filesystem is not read at all. Only when no
node holds anything newer does rank 0 pick the newest file checkpoint that loads, and every rank
loads that one.

A memory restore that fails on any rank (a receiver out of CPU or GPU memory, a node's broken
snapshot) is a cache miss, not the end of the job: every rank says whether its part worked (one
all_gather, so that all decide alike and none waits for the others), and on any failure all load
the file checkpoint instead; the ``restored`` event's ``fallback`` and each rank's log say why.
Only when no file checkpoint loads either is it an error: starting at step 0 would silently throw
the trained state away.

The state's per-rank part (each rank's RNG states) comes from the snapshot folders that still
hold it: one more all_gather of what each node holds; a rank whose part went with its node is
seeded from the other ranks' states (``train.reshape.rank_rng``), as on a change of world size.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from ddp_hpc.errors import HintError
from ddp_hpc.judge.restarts import restored_text
from ddp_hpc.train.checkpoint import CheckpointError, find_latest_valid, list_checkpoints, load_checkpoint
from ddp_hpc.train.memsnap import NodeStore, event_of, store_for
from ddp_hpc.train.peercopy import BytesView, release, send_file, subgroup, words

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
    fallback: str | None = None     # why a memory restore failed and the files were read instead

    def line(self) -> str:
        """``restored step 212 from n1's memory (n2 was lost), 0.4 s`` (judge.restarts' words)."""
        return restored_text(self.event()) or "nothing to restore: starting at step 0"

    def event(self) -> dict:
        """The ``restored`` event's keys (runlogs/schema.py)."""
        return {"step": self.step, "source": self.source, "node": self.node,
                "seconds": round(self.seconds, 3), "path": self.path, "lost": self.lost,
                **({"fallback": self.fallback} if self.fallback else {})}


def _gather(value: Any, distributed: bool) -> list:
    if not distributed:
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


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


_STOPPED = "no bytes: the send stopped on another rank"


def _from_memory(store: NodeStore, table: list[dict], step: int, rank: int, distributed: bool,
                 map_location: Any) -> tuple[dict | None, str, int, str | None]:
    """(state, source, the sending rank, None), or (None, ..., why) when any rank failed: this
    node's snapshot, or the holder's sent over (peercopy.py) to the ranks that lack it. Every rank
    says whether its part worked (one all_gather), so all go on from the files together."""
    src = min(r for r, held in enumerate(table) if held["mem"] == step)
    mine = store is not None and table[rank]["mem"] == step
    path = store.folder / f"ckpt-{step:09d}.pt" if store is not None else None
    lack = [r for r, held in enumerate(table) if held["mem"] != step]
    state, source, error = None, "memory", None
    if lack:                         # first the bytes to the ranks that lack them, and only to them
        group, member = subgroup([src, *lack]), rank == src or rank in lack
        if member:
            data, error = send_file(path if rank == src else None, table[src]["size"], src, group)
            if rank in lack and error is None and data is not None:
                try:
                    state, source = load_checkpoint(BytesView(data), map_location), "peer"
                except Exception as exc:  # noqa: BLE001 - said to every rank, then the files
                    error = words(exc)
            elif rank in lack and error is None:
                error = _STOPPED
            del data
        release(group, member)
    if mine and error is None:
        try:
            state = load_checkpoint(path, map_location)
        except Exception as exc:  # noqa: BLE001 - said to every rank, then the files
            error = words(exc)
    failed = [(r, e) for r, e in enumerate(_gather(error, distributed)) if e]
    if failed:
        r, e = min(failed, key=lambda f: (f[1] == _STOPPED, f[0]))     # a cause before its echoes
        return None, source, src, f"restore of step {step} from {table[src]['node']}'s memory failed (rank {r}: {e})"
    first_here = min(r for r, held in enumerate(table) if held["node"] == table[rank]["node"])
    parts: dict[int, dict] = {}
    # the first rank of each node reads the parts its node holds (also a node whose model snapshot
    # is older or gone: its ranks' RNG states may still be there)
    for held in _gather(store.parts(step) if store is not None and first_here == rank else {}, distributed):
        parts.update(held)
    written = int(state.get("world_size") or len(table))
    state["rng"] = [parts.get(r, {}).get("rng") for r in range(written)]
    return state, source, src, None


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
    fallback = None
    if best is not None and not table[0]["any_file"] and (newest_file is None or best >= newest_file):
        state, source, src, fallback = _from_memory(store, table, best, rank, distributed, map_location)
        if fallback is None:
            holders = {held["node"] for held in table if held["mem"] == best}
            lost = sorted(set(state.get("nodes") or []) - holders)      # the snapshot's nodes that lost it
            path = str(store.folder.parent / table[src]["node"] / f"ckpt-{best:09d}.pt") if store else None
            return Restored(best, source, table[src]["node"], time.perf_counter() - t0, path, lost, nodes, state)
        (warn or (lambda m: warnings.warn(m, stacklevel=3)))(f"{fallback}; going on from the file checkpoints")
    path, state = _from_file(files, rank, distributed, warn, map_location, hint) if files is not None else (None, None)
    if path is None and fallback is not None:
        raise CheckpointError(f"{fallback}, and no file checkpoint loads (checkpoint directory: {files})",
                              "set checkpoint.memory_every_steps=-1 to start from step 0 without the "
                              "snapshots, or free memory on the nodes that lacked the snapshot and restart")
    if path is None:
        return Restored(0, "none", seconds=time.perf_counter() - t0, nodes=nodes)
    return Restored(int(state["step"]), "file", None, time.perf_counter() - t0, path, [], nodes, state,
                    fallback=fallback)


def node_store(env, every: int, warn: Callable[[str], None], make: bool = True,
               key: str | None = None, note: Callable[[str], None] | None = None) -> NodeStore | None:
    """This node's snapshot folder (made, with ``make``; ``key``: memsnap.job_folder's), None when
    snapshots are off (``every`` -1), outside a job (no job id: no restart inside an allocation to
    serve, and a later run must not find a stale snapshot), or the folder cannot be made (warned:
    the file tier goes on alone). Made, the node's local rank 0 also frees what ended jobs left
    beside it, in the background (``note`` hears what, `memsweep`; and a ``memsnap`` event of status
    ``swept`` in the run log, which status shows: the sweep deletes files, so it says so)."""
    if every < 0 or not env.job_id:
        return None
    try:
        store = store_for(env, key=key)
        if make:
            store.make()
            if env.local_rank == 0:
                store.sweep_ended_jobs(_told(note, warn))
        return store
    except (OSError, HintError) as exc:
        warn(f"memory snapshots off: {exc}")
        return None


def _told(note: Callable[[str], None] | None, warn: Callable[[str], None]) -> Callable[[str], None]:
    """What the sweep says, to ``note`` and as a ``memsnap`` event (status ``swept``)."""
    event = event_of(warn)

    def tell(text: str) -> None:
        if note is not None:
            note(text)
        event("memsnap", status="swept", why=text, step=None)
    return tell


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
