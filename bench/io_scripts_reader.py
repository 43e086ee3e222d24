"""The plain script bench/io_scripts.py submits: a torchrun-style reader of the benchmark's images.

    ddp-hpc submit --backend local -N 2 -G 2 --stage SHARED/imgs.lmdb=TRAIN bench/io_scripts_reader.py \
        --data SHARED/imgs --out RESULTS

Nothing in it is ddp_hpc's own loop: ``torch.distributed`` with env://, a ``DataLoader`` over a
``DistributedSampler`` (or ``ddp_hpc.data.BroadcastLoader``), and the dataset from ``ddp_hpc.data``
at ``$DDP_HPC_STAGE_TRAIN`` (set by ``--stage``) or ``--data``.  Every rank reads and decodes one
epoch, as bench/peers.py's cells do, and writes ``RESULTS/rank<R>.json``: samples, the dataset's
open time and the epoch's time, in wall-clock and in CPU seconds of the rank's process.
"""
import argparse
import io
import json
import os
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from ddp_hpc.data import BroadcastLoader, ImageFolderDataset, LMDBDataset, staged_path


def warm_decoder() -> None:
    """Decode one PNG made in memory: the decoder's one-time imports stay out of the timed epoch,
    as bench/peers.py's rank runner keeps them out of its cells (no shared file is read)."""
    from PIL import Image

    from ddp_hpc.data.images import decode_image

    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, format="PNG")
    decode_image(buf.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="the shared LMDB or image folder (without --stage)")
    ap.add_argument("--loader", choices=("dataloader", "broadcast"), default="dataloader")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=0, help="broadcast: reader threads")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    warm_decoder()
    t0, c0 = time.perf_counter(), time.process_time()
    path = staged_path("TRAIN", args.data)
    lmdb = os.path.isfile(os.path.join(path, "data.mdb"))
    ds = LMDBDataset(path) if lmdb else ImageFolderDataset(path)
    if args.loader == "broadcast":
        batches = BroadcastLoader(ds, args.batch, num_workers=args.workers)
    else:
        batches = DataLoader(ds, batch_size=args.batch, sampler=DistributedSampler(ds, seed=0))
    t1, c1 = time.perf_counter(), time.process_time()
    samples = sum(len(y) for _, y in batches)
    t2, c2 = time.perf_counter(), time.process_time()
    rank = dist.get_rank()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "node": int(os.environ["GROUP_RANK"]), "path": path, "samples": samples,
                   "open_s": t1 - t0, "epoch_s": t2 - t1,
                   "open_cpu_s": c1 - c0, "epoch_cpu_s": c2 - c1}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
