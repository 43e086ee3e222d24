"""A plain torchrun-style DDP script with no ddp_hpc in it (unless --report): a tiny model, a
DataLoader, SGD, gloo. What the instrumentation tests run under ``ddp_hpc.exec``.

    --steps N          training steps (default 8)
    --step-sleep S     seconds of sleep inside each step (default 0)
    --gan              two optimizers stepped in each training step (a GAN's pattern)
    --report           call ddp_hpc.report(step=, total=, loss=) itself each step
    --stuck-rank R     rank R stops answering at step --stuck-at (sleeps forever in stuck_in_user_code)
    --segv-rank R      rank R dies of SIGSEGV at step --stuck-at (in native code, crash_in_c)
    --teardown-abort   after a clean end, abort in the interpreter's teardown (SIGABRT)
    --slow-rank R      rank R's forward does --slow-s seconds of extra work (a busy loop) each step
"""
import argparse
import ctypes
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=8)
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--gan", action="store_true")
p.add_argument("--report", action="store_true")
p.add_argument("--stuck-rank", type=int, default=-1)
p.add_argument("--segv-rank", type=int, default=-1)
p.add_argument("--stuck-at", type=int, default=3)
p.add_argument("--teardown-abort", action="store_true")
p.add_argument("--slow-rank", type=int, default=-1)
p.add_argument("--slow-s", type=float, default=0.04)
args = p.parse_args()


def stuck_in_user_code():
    while True:
        time.sleep(3600)


def crash_in_c():
    ctypes.string_at(0)


class Model(torch.nn.Module):
    """A linear layer whose forward first busies the CPU for ``extra_s`` seconds."""

    def __init__(self, extra_s):
        super().__init__()
        self.linear, self.extra_s = torch.nn.Linear(4, 1), extra_s

    def forward(self, x):
        end = time.perf_counter() + self.extra_s
        while time.perf_counter() < end:
            pass
        return self.linear(x)


class NativeTeardown:
    """Stands for a C++ object whose destructor calls std::terminate at interpreter exit."""

    def __del__(self):
        os.abort()


dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(Model(args.slow_s if rank == args.slow_rank else 0.0))
opts = [torch.optim.SGD(model.parameters(), lr=0.05)]
if args.gan:
    opts.append(torch.optim.SGD(model.parameters(), lr=0.01))
data = TensorDataset(torch.randn(16 * args.steps, 4), torch.randn(16 * args.steps, 1))
loader = DataLoader(data, batch_size=16)
for step, (x, y) in enumerate(loader, start=1):
    if rank == args.stuck_rank and step == args.stuck_at:
        stuck_in_user_code()
    if rank == args.segv_rank and step == args.stuck_at:
        crash_in_c()
    for opt in opts:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    time.sleep(args.step_sleep)
    if args.report:
        import ddp_hpc
        ddp_hpc.report(step=step, total=args.steps, loss=loss)
print(f"rank {rank}: done, loss {loss.item():.4f}", flush=True)
del model, opts
dist.destroy_process_group()
if args.teardown_abort:
    keep = NativeTeardown()
