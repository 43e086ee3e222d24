"""The images job's samples/s per ``data.io`` with the GPU as the consumer (scripts/gpu-check.sh's IO figure).

    python bench/io_cuda.py                       # ~1 minute on one H100; one rank per GPU
    python bench/io_cuda.py --count 8192 --epochs 4 --out gpu-io.txt

``python -m ddp_hpc.run jobs/images.yaml`` (small_cnn, batch 32 per rank, data.num_workers as the
job has it unless ``--workers``) on a fresh image set in a temporary folder, once per data.io
(direct, lmdb, stage, broadcast), one rank per GPU (``ddp_hpc.launch``, one node). The figure is
the best epoch's samples/s (all ranks) after the first epoch, from the run log's epoch events; the
first epoch is shown beside it (``--drop-caches``: after dropping the page cache, root only; it
slows every other user of the machine, so only on a machine of your own). The
files sit on a local disk, so this measures what each cure costs the GPU's feed on one node, not
a shared filesystem (bench/sharedfs.py and docs/io.md do that on CPU).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
IOS = ("direct", "lmdb", "stage", "broadcast")


def _drop_caches() -> bool:
    if os.geteuid() != 0 or not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        return False
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    return True


def _epochs(log_root: Path) -> list[float]:
    from ddp_hpc.judge.nodefiles import rank_events
    out = []
    for run in sorted({f.parent for f in log_root.rglob("*.events.jsonl")}):
        out += [e["samples_per_s"] for e in rank_events(run, 0).events if e["event"] == "epoch"]
    return out


def _run(io: str, data: Path, tmp: Path, a, procs: int) -> dict:
    from ddp_hpc.launch import run_local
    argv = [sys.executable, "-m", "ddp_hpc.run", str(REPO / "jobs" / "images.yaml"), f"data.io={io}",
            f"data.kwargs.root={data}/train", f"data.eval_kwargs.root={data}/eval", f"train.epochs={a.epochs}",
            f"log.dir={tmp}/logs", f"checkpoint.dir={tmp}/ckpt", f"data.stage_to={tmp}/local",
            "checkpoint.every_epochs=0", "train.eval_every_epochs=0", "log.progress=off"]
    argv += [f"data.lmdb_path={data}/train.lmdb"] if io != "direct" else []
    argv += [f"data.num_workers={a.workers}"] if a.workers is not None else []
    (tmp / "local").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDP_HPC_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cold = a.drop_caches and _drop_caches()
    t0 = time.perf_counter()
    res = run_local(argv, nodes=1, procs_per_node=procs, log_dir=tmp / "out", env=env)
    wall = time.perf_counter() - t0
    if not res.ok:
        raise SystemExit(f"bench/io_cuda.py: data.io={io} failed; rank 0's output ends:\n"
                         f"{(tmp / 'out' / 'rank0.out').read_text(errors='replace')[-3000:]}")
    sps = _epochs(tmp / "logs")
    return {"io": io, "best": max(sps[1:] or sps), "first": sps[0], "cold": cold, "wall": wall}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--count", type=int, default=4096, help="training images (PNG, 16x16, 10 classes)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per run (the first is reported apart)")
    p.add_argument("--workers", type=int, default=None, help="data.num_workers (default: the job's)")
    p.add_argument("--procs", type=int, default=None, help="ranks, one per GPU (default: every GPU)")
    p.add_argument("--out", default=None, help="also write the table to this file")
    p.add_argument("--drop-caches", action="store_true",
                   help="drop the page cache before each run (root; a machine of your own)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/io_cuda.py: error: torch.cuda.is_available() is False: the GPU is the consumer "
              "here.\nHINT: run it on a machine with an NVIDIA GPU (scripts/gpu-check.sh, docs/gpu.md).",
              file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO))
    from ddp_hpc.data.pack import pack
    from ddp_hpc.examples.images import make_images
    procs = a.procs or torch.cuda.device_count()
    with tempfile.TemporaryDirectory(prefix="io_cuda-") as tmp:
        data = Path(tmp) / "data"
        make_images(data / "train", count=a.count, seed=0, progress=False)
        make_images(data / "eval", count=256, seed=1, progress=False)
        pack(data / "train", data / "train.lmdb", progress=False)
        rows = [_run(io, data, Path(tmp) / io, a, procs) for io in IOS]
    lines = [f"images job (jobs/images.yaml, small_cnn) on {torch.cuda.get_device_name(0)} x {procs} rank(s): "
             f"{a.count} PNG 16x16, {a.epochs} epochs, batch 32/rank, data.num_workers="
             f"{a.workers if a.workers is not None else 'as the job'}, files on a local disk",
             f"{'data.io':10s} {'samples/s':>12s} {'first epoch':>12s}  {'run wall s':>10s}"]
    lines += [f"{r['io']:10s} {r['best']:12.0f} {r['first']:12.0f}{' (cold)' if r['cold'] else '       '}"
              f" {r['wall']:10.1f}" for r in rows]
    lines.append("samples/s: the best epoch after the first, all ranks together (run log epoch events)")
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
