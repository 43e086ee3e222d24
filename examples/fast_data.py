"""A plain torchrun-style script that trains on many small images, read fast on a shared filesystem.

    ddp-hpc data make-images data/images/train --count 2048
    ddp-hpc data pack data/images/train data/images/train.lmdb
    ddp-hpc submit -N 2 -G 2 --stage data/images/train.lmdb=TRAIN examples/fast_data.py   # node-local LMDB
    ddp-hpc submit -N 2 -G 2 --stage data/images/train=TRAIN examples/fast_data.py        # node-local folder
    ddp-hpc submit -N 2 -G 2 examples/fast_data.py --data data/images/train.lmdb --loader broadcast
    torchrun --nproc-per-node 2 examples/fast_data.py --data data/images/train             # no ddp_hpc launcher

The data is ``$DDP_HPC_STAGE_TRAIN`` when the job staged it (``--stage SRC=TRAIN``), else
``--data``: an LMDB made by ``ddp-hpc data pack`` (``ddp_hpc.data.LMDBDataset``) or a
class-per-folder image folder (``ddp_hpc.data.ImageFolderDataset``).  ``--loader dataloader`` (the
default) reads with torch's DataLoader and DistributedSampler; ``--loader broadcast`` has one rank
per node read for its node (``ddp_hpc.data.BroadcastLoader``).  Rank 0 prints one line,
``fast_data: {...}``, with what it read and its samples/s (the mean over ranks, each rank's samples
over its own training loop time, first epoch included).
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from ddp_hpc import report
from ddp_hpc.data import BroadcastLoader, ImageFolderDataset, LMDBDataset, staged_path


def open_dataset(path: str):
    """A packed LMDB (a folder holding data.mdb) or an image folder, as a map-style dataset."""
    if os.path.isfile(os.path.join(path, "data.mdb")):
        return LMDBDataset(path)
    return ImageFolderDataset(path)


def make_loader(dataset, args):
    """-> (loader, set_epoch): torch's DataLoader + DistributedSampler, or the broadcast loader."""
    if args.loader == "broadcast":
        loader = BroadcastLoader(dataset, args.batch_size, seed=args.seed, num_workers=args.workers)
        return loader, loader.set_epoch
    sampler = DistributedSampler(dataset, seed=args.seed)   # shuffle=True, drop_last=False
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        persistent_workers=args.workers > 0)
    return loader, sampler.set_epoch


def small_cnn(classes: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(16, classes))


def train(args) -> dict:
    path = staged_path("TRAIN", args.data)            # the node-local copy when the job staged one
    dataset = open_dataset(path)
    loader, set_epoch = make_loader(dataset, args)
    torch.manual_seed(args.seed)
    model = DDP(small_cnn(len(dataset.classes)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    samples, step, loss = 0, 0, torch.zeros(())
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        set_epoch(epoch)
        for inputs, targets in loader:
            loss = nn.functional.cross_entropy(model(inputs), targets)
            opt.zero_grad()
            loss.backward()
            opt.step()
            samples, step = samples + len(targets), step + 1
            report(step=step, loss=loss.detach(), epoch=epoch)
    seconds = time.perf_counter() - t0
    rate = torch.tensor([samples / seconds, samples], dtype=torch.float64)
    dist.all_reduce(rate)
    return {"data": path, "kind": type(dataset).__name__, "loader": args.loader, "epochs": args.epochs,
            "samples": int(rate[1]), "samples_per_s_rank": float(rate[0]) / dist.get_world_size(),
            "loss": round(float(loss), 4), "ranks": dist.get_world_size()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=None, help="LMDB or image folder, when $DDP_HPC_STAGE_TRAIN is not set")
    ap.add_argument("--loader", choices=("dataloader", "broadcast"), default="dataloader")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--workers", type=int, default=0, help="DataLoader workers (broadcast: reader threads)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = train(args)
    if dist.get_rank() == 0:
        print("fast_data: " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
