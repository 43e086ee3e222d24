"""A torchrun-style DDP script that survives preemption: it checkpoints when the job is told to
stop, exits 75, and the next run (a requeued Slurm job, or the same command again) resumes.

    ddp-hpc launch --nodes 2 --procs-per-node 2 -- python -m ddp_hpc.exec -- python examples/preemptible.py
    torchrun --nproc-per-node 2 examples/preemptible.py --steps 500 --sleep 0.01
    ddp-hpc submit -N 2 -G 4 -t 02:00:00 examples/preemptible.py   # Slurm: requeued on preemption

Plain torch.distributed (env:// from torchrun's variables); the ddp_hpc lines are the preemption
check (`ddp_hpc.preemption`), the checkpoints (`ddp_hpc.checkpoint`) and progress for
``ddp-hpc status`` (`ddp_hpc.report`), each a no-op cost where it is not needed.
"""
import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_hpc import checkpoint, preemption, report


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50, help="optimizer steps in all")
    ap.add_argument("--ckpt-dir", default="checkpoints/preemptible", help="where checkpoints go")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep per step (testing)")
    ap.add_argument("--lr", type=float, default=0.1, help="learning rate")
    ap.add_argument("--ckpt-every", type=int, default=0, help="also checkpoint every N steps (0: only "
                    "when stopped and at the end): what a restart after a fault resumes from")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    preemption.install()                      # from here on USR2 / SIGTERM only set a flag
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if backend == "nccl":                     # LOCAL_RANK, or 0 when each task sees one GPU
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1).to(device), device_ids=[device.index] if device.index is not None else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    state = checkpoint.load(args.ckpt_dir, model, opt)       # None on the first run
    start = state["step"] if state else 0
    w_true = torch.arange(8.0, device=device) / 8

    loss = torch.zeros((), device=device)
    for step in range(start, args.steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)   # each rank, each step its own data
        x = torch.randn(64, 8, generator=gen).to(device)
        loss = torch.nn.functional.mse_loss(model(x).squeeze(1), x @ w_true)
        opt.zero_grad()
        loss.backward()
        opt.step()
        report(step=step + 1, total=args.steps, loss=loss.detach())
        time.sleep(args.sleep)
        if args.ckpt_every and (step + 1) % args.ckpt_every == 0:
            checkpoint.save(args.ckpt_dir, model, opt, step=step + 1)
        if preemption.requested():                          # the same answer on every rank
            checkpoint.save(args.ckpt_dir, model, opt, step=step + 1)
            if rank == 0:
                print(f"preemptible: stopped at step {step + 1} of {args.steps}; checkpoint saved", flush=True)
            preemption.requeue()                            # exits 75 (rank 0 requeues under Slurm)

    checkpoint.save(args.ckpt_dir, model, opt, step=args.steps)
    if rank == 0:
        resumed = f" (resumed from step {start})" if state else ""     # nothing to say on a fresh run
        print(f"preemptible: {world} ranks, {args.steps} steps{resumed}, final loss {loss.item():.4f}", flush=True)
    del model, opt      # free DDP while the process group exists (see examples/torchrun_style.py)
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
