"""A script organised the way Lightning users write one -- a module with ``training_step`` and
``configure_optimizers``, a ``Trainer`` with ``fit`` -- in plain torch (Lightning is not needed),
with torchrun-style ``env://`` initialisation, so it runs under torchrun, srun or ddp_hpc alike.

    ddp-hpc launch --nodes 2 --procs-per-node 2 -- python -m ddp_hpc.exec -- python examples/lightning_style.py
    torchrun --nproc-per-node 2 examples/lightning_style.py --max-steps 100

The Trainer is where ddp_hpc comes in: it resumes from the newest checkpoint, reports progress for
``ddp-hpc status``, and on preemption saves a checkpoint and exits 75 (requeued under Slurm).
"""
import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddp_hpc import checkpoint, preemption, report


class LitRegressor(nn.Module):
    """What a LightningModule holds: the model, one training step, its optimizer."""

    def __init__(self, features: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, 16), nn.ReLU(), nn.Linear(16, 1))
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(1)

    def training_step(self, model: nn.Module, batch: tuple) -> torch.Tensor:
        x, y = batch               # `model` is this module, wrapped in DDP: call it, not self
        return nn.functional.mse_loss(model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class Trainer:
    """The part of Lightning's Trainer this example needs: DDP set-up, epochs over a distributed
    sampler, resume, checkpoints, progress and preemption."""

    def __init__(self, max_steps: int, ckpt_dir: str, batch_size: int = 32) -> None:
        self.max_steps, self.ckpt_dir, self.batch_size = max_steps, ckpt_dir, batch_size
        preemption.install()
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(self.backend)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cpu")
        if self.backend == "nccl":
            self.device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
            torch.cuda.set_device(self.device)

    def fit(self, module: LitRegressor, dataset: TensorDataset) -> float:
        module.to(self.device)
        opt = module.configure_optimizers()
        model = DDP(module, device_ids=[self.device.index] if self.device.index is not None else None)
        state = checkpoint.load(self.ckpt_dir, model, opt)
        step, epoch = (state["step"], state["epoch"]) if state else (0, 0)
        sampler = DistributedSampler(dataset, num_replicas=self.world, rank=self.rank, seed=0)
        loss = torch.zeros((), device=self.device)
        while step < self.max_steps:
            sampler.set_epoch(epoch)
            for batch in DataLoader(dataset, batch_size=self.batch_size, sampler=sampler, drop_last=True):
                loss = module.training_step(model, [t.to(self.device) for t in batch])
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                report(step=step, total=self.max_steps, loss=loss.detach(), epoch=epoch)
                if preemption.requested():
                    checkpoint.save(self.ckpt_dir, model, opt, step=step, epoch=epoch)
                    preemption.requeue()
                if step >= self.max_steps:
                    break
            epoch += 1   # a resumed run restarts the epoch it stopped in (simple, not exact)
        checkpoint.save(self.ckpt_dir, model, opt, step=step, epoch=epoch)
        del model     # free DDP while the process group exists
        gc.collect()
        return loss.item()

    def teardown(self) -> None:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-steps", type=int, default=40, help="optimizer steps in all")
    ap.add_argument("--ckpt-dir", default="checkpoints/lightning_style", help="where checkpoints go")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 8, generator=gen)
    dataset = TensorDataset(x, torch.sin(x).sum(1))
    torch.manual_seed(0)
    trainer = Trainer(args.max_steps, args.ckpt_dir)
    loss = trainer.fit(LitRegressor(), dataset)
    if trainer.rank == 0:
        print(f"lightning_style: {trainer.world} ranks, {args.max_steps} steps, final loss {loss:.4f}", flush=True)
    trainer.teardown()


if __name__ == "__main__":
    main()
