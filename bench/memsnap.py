"""The memory tier of checkpoints (ddp_hpc/train/memsnap.py, train/restore.py) against the file tier,
measured in one run on this machine.

For a training state of about 150 MB (an MLP of ~12M parameters with Adam: weights and two moments)
and, with ``--sizes 150,1500``, about 1.5 GB:

- the training step: forward, backward and Adam's step on a batch of ``--batch`` (CPU), the
  median of ``--repeat`` steps;
- the memory snapshot's cost to the training thread (`MemSnapshots.take`: the copy into the
  buffers kept between snapshots, after the last write ended) and its background write, the
  median of ``--repeat`` snapshots after a first one that allocates the buffers; the cost as a
  fraction of the step (target <= 1%: the interval ``checkpoint.memory_every_steps=0`` chooses
  is the cost over 1% of the step, rounded up) and as a fraction of a synchronous file save;
- a restore from a file (``load_checkpoint`` of a checkpoint on the local disk; the page cache is
  warm, so a shared filesystem is slower than this), from this node's memory (`freshest` reading
  the node's snapshot) and from a peer's memory (two gloo processes as two pretend nodes: rank 1's
  node holds nothing, rank 0 sends the snapshot over the process group), each the median of
  ``--repeat``, with its ratio to the file restore.

The ``demo`` line is the same for the demo's own model (jobs/demo.yaml: a 32-64-64-10 MLP with
SGD, batch 128): the state is tiny, so the snapshot's fixed costs (RNG states, the hand-over to the
writer thread) decide its fraction of the step.

    python bench/memsnap.py                      # ~150 MB, a minute or two
    python bench/memsnap.py --sizes 150,1500     # and ~1.5 GB (needs ~8 GB of memory)
    python bench/memsnap.py --json runs/memsnap.json

The machine may be shared: other processes' load inflates every figure; the ratios, measured in
the same run, are what to compare.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddp_hpc.launch import launch_distributed  # noqa: E402
from ddp_hpc.train.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from ddp_hpc.train.memsnap import MemSnapshots, NodeStore, job_folder  # noqa: E402
from ddp_hpc.train.restore import freshest  # noqa: E402

TARGET = 0.01


def _model(mb: int) -> tuple[nn.Module, int]:
    """An MLP whose weights plus Adam's two moments are about ``mb`` MB (4 layers of h x h)."""
    h = int((mb * 1e6 / 4 / 3 / 4) ** 0.5)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(h, h), nn.ReLU())]), h


def _demo() -> tuple[nn.Module, int]:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)), 32


def _setup(model: nn.Module, width: int, batch: int, opt_name: str):
    opt = torch.optim.Adam(model.parameters(), 1e-4) if opt_name == "adam" else \
        torch.optim.SGD(model.parameters(), 0.05, momentum=0.9)
    x = torch.randn(batch, width)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
    step()                                             # the optimizer's state exists from here
    return opt, step


def _median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _snapshot(store: NodeStore, state, repeat: int) -> tuple[float, float]:
    """(blocking, background write) seconds per snapshot, medians after the first."""
    snaps = MemSnapshots(store, rank=0, local_rank=0, every=1, device=torch.device("cpu"),
                         distributed=False, warn=print)
    snaps.take(0, state)
    snaps.wait()
    block, write = [], []
    for i in range(1, repeat + 1):
        t0 = time.perf_counter()
        snaps.take(i, state)
        t1 = time.perf_counter()
        snaps.wait()
        block.append(t1 - t0)
        write.append(time.perf_counter() - t1)
    snaps.close()
    return statistics.median(block), statistics.median(write)


def _peer_worker(rank: int, world: int, folder: str, path: str, repeat: int) -> list[float]:
    """Rank 0's node holds the snapshot (a copy of ``path``), rank 1's nothing: rank 1's restores."""
    from ddp_hpc.dist import cleanup_ddp, setup_ddp
    setup_ddp()
    store = NodeStore(Path(folder) / f"node{rank}", f"node{rank}")
    store.make()
    if rank == 0:
        (store.folder / Path(path).name).write_bytes(Path(path).read_bytes())
    out = []
    for _ in range(repeat):
        got = freshest(None, store, rank=rank, distributed=True)
        assert got.source == ("memory" if rank == 0 else "peer"), got.source
        out.append(got.seconds)
    cleanup_ddp()
    return out


def _one(label: str, model: nn.Module, width: int, args, opt_name: str) -> dict:
    opt, step = _setup(model, width, args.batch, opt_name)
    step_s = _median_time(step, args.repeat)

    def state() -> dict:
        return {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 0, "batch_in_epoch": 0}
    job = f"bench-{uuid.uuid4().hex[:8]}"
    folder = job_folder(job)
    store = NodeStore(folder / "node0", "node0")
    store.make()
    with tempfile.TemporaryDirectory(dir=args.file_dir) as files:
        save_s = _median_time(lambda: save_checkpoint(files, 1, {**state(), "rng": []}, keep_last=1), args.repeat)
        path = next(Path(files).glob("ckpt-*.pt"))
        mb = path.stat().st_size / 1e6
        file_s = _median_time(lambda: load_checkpoint(path), args.repeat)
        block_s, write_s = _snapshot(store, state, args.repeat)
        mem_s = _median_time(lambda: freshest(None, store, rank=0, distributed=False), args.repeat)
        snap = store.newest()[1]
        peers = launch_distributed(_peer_worker, 2, args=(str(folder / "peer"), str(snap), args.repeat),
                                   nodes=2, timeout=1800)
        peer_s = statistics.median(peers[1])
    store.remove()
    NodeStore(folder / "peer" / "node0", "").remove()
    NodeStore(folder / "peer" / "node1", "").remove()
    NodeStore(folder / "peer", "").remove()
    return {"label": label, "state_mb": round(mb, 1), "step_s": step_s, "file_save_s": save_s,
            "snapshot_block_s": block_s, "snapshot_write_s": write_s,
            "snapshot_of_step": block_s / step_s, "snapshot_of_save": block_s / save_s,
            "auto_every_steps": max(1, -(-block_s // (TARGET * step_s))),
            "restore_file_s": file_s, "restore_memory_s": mem_s, "restore_peer_s": peer_s,
            "memory_vs_file": mem_s / file_s, "peer_vs_file": peer_s / file_s}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="150", help="state sizes in MB, comma separated (default 150)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--file-dir", default=None, help="where the file checkpoints go (default: the temp dir)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    print(f"{'state':>8} {'MB':>7} {'step s':>8} {'save s':>8} {'snap s':>8} {'of step':>8} {'every':>6} "
          f"{'file s':>8} {'memory s':>9} {'mem/file':>9} {'peer s':>8} {'peer/file':>10}", flush=True)
    demo_args = argparse.Namespace(**{**vars(args), "batch": 128})
    cases = [("demo", *_demo(), demo_args, "sgd")] + \
        [(f"~{mb} MB", *_model(mb), args, "adam") for mb in [int(s) for s in args.sizes.split(",")]]
    for case in cases:
        rows.append(r := _one(*case))
        print(f"{r['label']:>8} {r['state_mb']:7.1f} {r['step_s']:8.4f} {r['file_save_s']:8.4f} "
              f"{r['snapshot_block_s']:8.4f} {r['snapshot_of_step']:8.1%} {int(r['auto_every_steps']):6d} "
              f"{r['restore_file_s']:8.4f} {r['restore_memory_s']:9.4f} {r['memory_vs_file']:9.2f} "
              f"{r['restore_peer_s']:8.4f} {r['peer_vs_file']:10.2f}", flush=True)
    print(f"snapshot cost target: <= {TARGET:.0%} of a step; 'every': the interval checkpoint.memory_every_steps=0 "
          "chooses for that cost (this machine may be loaded by other work)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
