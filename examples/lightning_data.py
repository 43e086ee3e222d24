"""A Lightning script whose DataModule reads what ``ddp-hpc submit --stage`` put on each node.

    ddp-hpc submit -N 2 -G 2 --stage data/images/train.lmdb=TRAIN examples/lightning_data.py
    ddp-hpc submit -N 2 -G 2 --stage data/images/train=TRAIN examples/lightning_data.py
    ddp-hpc submit -N 2 -G 2 examples/lightning_data.py --data data/images/train.lmdb --loader broadcast

Needs ``lightning`` (``pip install lightning``).  The DataModule opens ``$DDP_HPC_STAGE_TRAIN``
(else ``--data``) as ``ddp_hpc.data.LMDBDataset`` or ``ImageFolderDataset`` and hands Lightning a
plain DataLoader (Lightning adds the DistributedSampler), or ``ddp_hpc.data.BroadcastLoader``
(``--loader broadcast``: one reader per node; it already gives each rank its own samples, so
Lightning must not add a sampler: ``use_distributed_sampler=False``).  Lightning finds the ranks
from the torchrun variables ``ddp_hpc.exec`` sets (or from Slurm's under srun).  Rank 0 prints one
line, ``lightning_data: {...}``, with the path it read and the samples every rank trained on.
"""
import argparse
import gc
import json
import os

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from ddp_hpc.data import BroadcastLoader, ImageFolderDataset, LMDBDataset, staged_path


class ImagesData(L.LightningDataModule):
    """The training images: staged (``$DDP_HPC_STAGE_TRAIN``) or at ``data``."""

    def __init__(self, data: str | None, batch_size: int, loader: str) -> None:
        super().__init__()
        self.data, self.batch_size, self.loader = data, batch_size, loader
        self.path = self.dataset = None

    def setup(self, stage: str) -> None:
        self.path = staged_path("TRAIN", self.data)
        lmdb = os.path.isfile(os.path.join(self.path, "data.mdb"))
        self.dataset = LMDBDataset(self.path) if lmdb else ImageFolderDataset(self.path)

    def train_dataloader(self):
        if self.loader == "broadcast":
            return BroadcastLoader(self.dataset, self.batch_size)
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True)


class Classifier(L.LightningModule):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                 nn.Flatten(), nn.Linear(16, classes))
        self.seen = 0

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        self.seen += len(targets)
        return nn.functional.cross_entropy(self.net(inputs), targets)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=None, help="LMDB or image folder, when $DDP_HPC_STAGE_TRAIN is not set")
    ap.add_argument("--loader", choices=("dataloader", "broadcast"), default="dataloader")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    args = ap.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    data, model = ImagesData(args.data, args.batch_size, args.loader), Classifier()
    trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", 1)), max_epochs=args.epochs,
                        use_distributed_sampler=args.loader != "broadcast", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=data)
    seen = trainer.strategy.reduce(torch.tensor(float(model.seen)), reduce_op="sum")
    if trainer.global_rank == 0:
        print("lightning_data: " + json.dumps({"data": data.path, "kind": type(data.dataset).__name__,
                                                "loader": args.loader, "samples": int(seen),
                                                "ranks": trainer.world_size}), flush=True)
    del trainer, model, data   # DDP's parts go before their process group, not at interpreter exit
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
