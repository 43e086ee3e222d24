"""Overhead of the toolkit's training loop against a plain hand-written DDP loop.

Same processes (one local launch), same model, data, batch size and optimizer; the two loops
alternate `--reps` times and the best time of each counts (the machine is shared; the best run is
the least disturbed).  The plain loop is the seed exercise's: DistributedSampler + DataLoader,
zero_grad / forward / backward / step, `loss.item()` every step, rank 0 saves the weights.  The toolkit run is `fit()` with
its defaults (run logs every 10 steps, the preemption flag check, a final checkpoint), only the
progress output off.

    python bench/overhead.py                 # 2 processes, prints samples/s and the ratio
    python bench/overhead.py --procs 4 --epochs 3
    python bench/overhead.py --device cuda   # GPUs: a ResNet-style CNN in bf16 (bench/overhead_cuda.py)

Target: ratio (toolkit / plain) >= 0.97.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch


def _plain(model, data, batch_size: int, epochs: int, lr: float, rank: int, world: int,
           tmp: str) -> float:
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler
    ddp = DDP(model)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    crit = torch.nn.CrossEntropyLoss()
    torch.distributed.barrier()
    t0 = time.perf_counter()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        epoch_loss = 0.0
        for x, y in loader:
            opt.zero_grad()
            loss = crit(ddp(x), y)
            loss.backward()
            opt.step()
            epoch_loss += loss.item()
    if rank == 0:                        # the seed saves the trained weights from rank 0
        torch.save(ddp.module.state_dict(), f"{tmp}/plain_model.pt")
    torch.distributed.barrier()
    return time.perf_counter() - t0


def _toolkit(model, data, batch_size: int, epochs: int, lr: float, tmp: str) -> float:
    from ddp_hpc.train import fit
    overrides = [f"train.batch_size={batch_size}", f"train.epochs={epochs}", f"optim.lr={lr}",
                 "optim.momentum=0.9", "log.progress=off", f"log.dir={tmp}/logs",
                 f"checkpoint.dir={tmp}/ckpt", "checkpoint.every_epochs=0", "checkpoint.resume=false"]
    torch.distributed.barrier()
    t0 = time.perf_counter()
    fit(model, data, overrides=overrides)
    torch.distributed.barrier()
    return time.perf_counter() - t0


def _worker(rank: int, world: int, args_d: dict, tmp: str):
    from ddp_hpc.dist import cleanup_ddp, setup_ddp
    from ddp_hpc.examples.models import MLP
    from ddp_hpc.examples.synthetic import SyntheticClassification
    a = argparse.Namespace(**args_d)
    setup_ddp()
    try:
        data = SyntheticClassification(size=a.size, in_dim=a.in_dim, num_classes=10, seed=0)
        times = {"plain": [], "toolkit": []}
        for rep in range(a.reps):
            order = ("plain", "toolkit") if rep % 2 == 0 else ("toolkit", "plain")
            for kind in order:                # alternate who goes first
                torch.manual_seed(0)
                model = MLP(in_dim=a.in_dim, hidden=a.hidden, num_classes=10, depth=a.depth)
                if kind == "plain":
                    t = _plain(model, data, a.batch_size, a.epochs, 0.05, rank, world, tmp)
                else:
                    t = _toolkit(model, data, a.batch_size, a.epochs, 0.05, f"{tmp}/rep{rep}")
                times[kind].append(t)
        return times
    finally:
        cleanup_ddp()


def _device(argv) -> str:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    return pre.parse_known_args(argv)[0].device


def main(argv=None) -> int:
    if _device(argv) == "cuda":      # its own model and options: bench/overhead_cuda.py --help
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from overhead_cuda import main as cuda_main
        return cuda_main(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: this MLP benchmark; cuda: bench/overhead_cuda.py (one rank per GPU)")
    p.add_argument("--procs", type=int, default=2, help="local processes (ranks)")
    p.add_argument("--size", type=int, default=16384, help="samples")
    p.add_argument("--in-dim", type=int, default=128, help="MLP input width")
    p.add_argument("--hidden", type=int, default=512, help="MLP hidden width")
    p.add_argument("--depth", type=int, default=2, help="MLP hidden layers")
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--epochs", type=int, default=2, help="epochs per timed run")
    p.add_argument("--reps", type=int, default=4,
                   help="timed runs of each loop, alternating; the best counts")
    a = p.parse_args(argv)
    from ddp_hpc.launch import launch_distributed
    with tempfile.TemporaryDirectory() as tmp:
        per_rank = launch_distributed(_worker, a.procs, args=(vars(a), tmp), timeout=1800)
    samples = a.size * a.epochs       # all ranks together (DistributedSampler pads < procs)
    # a step ends when the slowest rank ends: per repetition take the max over ranks
    best = {k: min(max(r[k][i] for r in per_rank) for i in range(a.reps))
            for k in ("plain", "toolkit")}
    sps = {k: samples / v for k, v in best.items()}
    print(f"processes {a.procs}, model MLP({a.in_dim}->{a.hidden}x{a.depth}->10), batch "
          f"{a.batch_size}/rank, {a.size} samples x {a.epochs} epochs, best of {a.reps}")
    print(f"plain DDP loop : {sps['plain']:10.1f} samples/s ({best['plain']:.2f} s)")
    print(f"ddp_hpc fit()  : {sps['toolkit']:10.1f} samples/s ({best['toolkit']:.2f} s)")
    print(f"ratio toolkit/plain: {sps['toolkit'] / sps['plain']:.3f}  (target >= 0.97)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
