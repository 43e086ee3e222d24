"""What every rank process of bench/peers.py does: time one epoch per (scenario, technique) cell,
count its shared-directory IO, record which samples it got, then test mid-epoch resume.

Each scenario runs ``a["rounds"]`` rounds of every technique in turn.  A cell is the first epoch
of a fresh job: node-local caches emptied, then the loader is opened
(ddp_hpc's staging happens here) and one epoch is read and decoded.  Its time is open + epoch,
because the peers fill their node-local caches while the epoch runs.  Scenarios:

* ``warm``: rank 0 reads the technique's shared files once beforehand (page cache filled);
* ``cold``: rank 0 drops the page cache beforehand (bench/sharedfs.py's ``drop_caches``, root only);
* ``simfs``: a SIMULATED metadata-bound shared filesystem: ``delay_s`` of sleep per open of a
  shared file.  ddp_hpc's readers get it from ``fsio.watch`` exactly as in bench/sharedfs.py; the
  peers get the same sleep from the audit hook of ``peers_fs``.
"""
from __future__ import annotations

import gc
import importlib
import os
import shutil
import time

import peers_fs
from peers_loaders import CACHES, OURS, io_bench, make, shared_dir
from peers_pack import import_streaming, sample_hash


def _hashes(batches) -> list[int]:
    return [sample_hash(x[i], y[i]) for x, y in batches for i in range(len(x))]


def _prepare(label, scenario, ctx, a) -> None:
    """Between cells: empty this node's peer caches, then fill or drop the page cache."""
    import torch.distributed as dist

    from ddp_hpc.data import lmdb as ddp_lmdb

    ddp_lmdb.close_all()
    gc.collect()  # loaders of the previous cell release their files and shared memory
    dist.barrier()
    if ctx.env.local_rank == 0:
        shutil.rmtree(os.path.join(os.environ["TMPDIR"], CACHES), ignore_errors=True)
    if ctx.env.rank == 0 and scenario == "cold":
        io_bench().drop_caches()
    if ctx.env.rank == 0 and scenario == "warm":
        for folder, _, files in os.walk(shared_dir(label, a)):
            for name in files:
                with open(os.path.join(folder, name), "rb") as f:
                    while f.read(1 << 20):
                        pass
    dist.barrier()


def _cell(label, scenario, delay_s, ctx, a) -> dict:
    from ddp_hpc.data import fsio

    _prepare(label, scenario, ctx, a)
    ours = label in OURS
    if ours:  # ddp_hpc's readers: counted and slowed by fsio, as in bench/sharedfs.py
        fsio.watch(a["shared"], delay_s)
    peers_fs.watch(a["shared"], 0.0 if ours else delay_s)
    t0, c0 = time.perf_counter(), time.process_time()
    loader = make(label, ctx, a, f"{scenario}-{label.replace(' ', '_')}")
    t1 = time.perf_counter()
    batches = [(x, y) for x, y in loader.epoch()]
    t2, c2 = time.perf_counter(), time.process_time()
    counted, by_fsio = peers_fs.snapshot(), fsio.snapshot()
    peers_fs.unwatch()
    fsio.unwatch()
    loader.close()
    return {"scenario": scenario, "technique": label, "samples": sum(len(x) for x, _ in batches),
            "open_s": t1 - t0, "epoch_s": t2 - t1, "cpu_s": c2 - c0,
            "opens_hook": counted["opens"], "bytes_wrapped": counted["bytes"],
            "opens_fsio": by_fsio["opens"] if ours else None, "bytes_fsio": by_fsio["bytes"] if ours else None,
            "hashes": _hashes(batches)}


def _resume(label, ctx, a, k) -> dict:
    """Stop after ``k`` batches, keep the loader's state, resume with a fresh loader (node-local
    caches emptied in between: the requeued job may land on other nodes)."""
    _prepare(label, "resume", ctx, a)
    first = make(label, ctx, a, "resume")  # the same paths for both halves, as a requeued job has
    it = first.epoch()
    head = [next(it) for _ in range(k)]
    state = first.state(k)
    del it
    first.close()
    _prepare(label, "resume", ctx, a)
    second = make(label, ctx, a, "resume")
    try:
        rest = list(second.resume(state)) if state is not None else list(second.epoch())
        error = None
    except Exception as e:  # a peer that cannot resume this way: recorded, checked as "no"
        rest, error = [], f"{type(e).__name__}: {e}"
    second.close()
    return {"k": k, "has_state": state is not None, "first": _hashes(head), "rest": _hashes(rest), "error": error}


SHM_ROOT = "/dev/shm/ddp_hpc_peers"  # one sub-folder per pretend node, made and removed by peers.py


def _node_shm(node: int) -> None:
    """Give this rank its pretend node's own /dev/shm, as separate machines have.

    MosaicML Streaming coordinates the ranks of a node through POSIX shared memory with fixed
    names (``/000000_locals``, ...); two pretend nodes on one machine would share those names and
    collide.  So each rank enters a private mount namespace (root only) and bind-mounts its node's
    folder over /dev/shm: the ranks of a node share it, the nodes do not.  Done before torch
    starts threads (unshare(CLONE_NEWNS) needs an unshared fs_struct)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, ms_rec, ms_private, ms_bind = 0x00020000, 0x4000, 0x40000, 0x1000
    folder = os.path.join(SHM_ROOT, f"node{node}").encode()
    for call, args in (("unshare", (clone_newns,)), ("mount", (None, b"/", None, ms_rec | ms_private, None)),
                       ("mount", (folder, b"/dev/shm", None, ms_bind, None))):
        if getattr(libc, call)(*args) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{call}{args}: {os.strerror(err)} (the per-node /dev/shm needs root)")


def run_rank(rank, world_size, a):
    import torch

    from ddp_hpc.data.images import decode_image
    from ddp_hpc.dist import cleanup_ddp, setup_ddp

    _node_shm(int(os.environ["GROUP_RANK"]))
    torch.set_num_threads(1)
    ctx = setup_ddp()
    os.environ["TMPDIR"] = os.path.join(a["work"], "local", f"node{ctx.env.node_rank}")
    os.environ["NNODES"] = str(a["nodes"])  # LitData's own variable for the node count (CPU)
    os.makedirs(os.environ["TMPDIR"], exist_ok=True)
    peers_fs.install()
    for name in ("litdata", "webdataset"):  # one-time imports stay out of the first cell
        importlib.import_module(name)
    import_streaming()
    first_png = next(f for f in sorted(os.listdir(os.path.join(a["shared"], "imgs", "class_00"))))
    with open(os.path.join(a["shared"], "imgs", "class_00", first_png), "rb") as f:
        decode_image(f.read())
    gc.freeze()  # the imports' objects leave the collector's scans: _prepare's gc.collect stays cheap
    out = {"rank": rank, "node": ctx.env.node_rank, "cells": [], "resume": {}}
    t0 = time.perf_counter()
    say = (lambda msg: print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", flush=True)) if rank == 0 else (lambda m: 0)
    say("rank 0 ready")
    scenarios = [("warm", 0.0)] + ([("cold", 0.0)] if a["cold"] else []) + [("simfs", a["delay_s"])]
    for scenario, delay_s in scenarios:
        for rnd in range(a["rounds"]):  # techniques interleaved, so a busy spell hits them alike
            for label in a["techniques"]:
                out["cells"].append({**_cell(label, scenario, delay_s, ctx, a), "round": rnd})
                cell = out["cells"][-1]
                say(f"{scenario} round {rnd} {label}: {cell['samples']} samples, {cell['epoch_s']:.2f} s")
    k = max(1, -(-a["files"] // world_size) // a["batch"] // 2)
    for label in a["techniques"] if a.get("resume", True) else ():   # bench/io_scripts.py: no resume test
        out["resume"][label] = _resume(label, ctx, a, k)
        say(f"resume test {label}")
    cleanup_ddp()
    return out
