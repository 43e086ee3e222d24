"""A plain Lightning script (nothing of ddp_hpc in it): a tiny regression model on random data,
``Trainer(strategy="ddp")`` on CPU or GPU.  Under ``ddp-hpc submit`` ddp_hpc's Lightning callback
(docs/scripts.md, "Lightning and Hugging Face") reports its steps, epoch, loss and samples/s to
``ddp-hpc status`` with no change here.

    ddp-hpc submit -N 2 -G 2 --wait examples/lightning_trainer.py -- --devices 2 --num-nodes 2
    torchrun --nproc-per-node 2 examples/lightning_trainer.py --devices 2
"""
import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

try:
    import lightning.pytorch as pl
except ImportError:           # the older package name
    import pytorch_lightning as pl


class Regressor(pl.LightningModule):
    def __init__(self, features: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, 16), nn.ReLU(), nn.Linear(16, 1))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(1), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x).squeeze(1), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def loader(n: int, batch_size: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1)), batch_size=batch_size)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--num-nodes", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--ckpt", default=None, help="resume from this checkpoint ('last' finds one)")
    ap.add_argument("--root", default=None, help="Lightning's default_root_dir")
    args = ap.parse_args()
    trainer = pl.Trainer(accelerator="auto", devices=args.devices, num_nodes=args.num_nodes,
                         strategy="ddp", max_epochs=args.epochs, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=args.root is not None, default_root_dir=args.root,
                         log_every_n_steps=1)
    trainer.fit(Regressor(), loader(args.samples, args.batch_size, 0), loader(64, 32, 1),
                ckpt_path=args.ckpt)
    if trainer.is_global_zero:
        print(f"lightning_trainer: {trainer.world_size} ranks, {trainer.global_step} steps, "
              f"train_loss {float(trainer.callback_metrics['train_loss']):.4f}", flush=True)


if __name__ == "__main__":
    main()
