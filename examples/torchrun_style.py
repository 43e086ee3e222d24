"""A plain torchrun-style DDP script: env:// initialisation, LOCAL_RANK device binding, a few SGD
steps of a linear model on each rank's own data, and a check that every replica ended equal.

    torchrun --nproc-per-node 2 examples/torchrun_style.py             # torchrun, one machine
    ddp-hpc launch --nodes 2 --procs-per-node 2 -- python examples/torchrun_style.py
    srun -N2 --ntasks-per-node=2 python examples/torchrun_style.py      # Slurm: see the export line

The only ddp_hpc line is ``detect().export()``: under srun it derives RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT from Slurm's variables (refusing a setup that would hang, with a HINT);
under torchrun or ``ddp-hpc launch`` those are already set and it changes nothing.
"""

import gc
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_hpc.env import detect

detect().export()
backend = "nccl" if torch.cuda.is_available() else "gloo"
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cpu")
if backend == "nccl":
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)

torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1).to(device), device_ids=[device.index] if device.type == "cuda" else None)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(rank)          # each rank its own data
w_true = torch.arange(8.0) / 8
for _step in range(20):
    x = torch.randn(64, 8, generator=gen).to(device)
    loss = torch.nn.functional.mse_loss(model(x).squeeze(1), x @ w_true.to(device))
    opt.zero_grad()
    loss.backward()
    opt.step()

flat = torch.cat([p.detach().flatten() for p in model.parameters()])
copies = [torch.empty_like(flat) for _ in range(world)]
dist.all_gather(copies, flat)
assert all(torch.equal(c, flat) for c in copies), "replicas diverged"
if rank == 0:
    print(f"torchrun_style: {world} ranks, final loss {loss.item():.4f}, replicas equal")
# Free the DDP wrapper (it sits in a reference cycle) while the group still exists: freed at
# interpreter exit, after destroy_process_group, its reducer now and then aborts the process
# ("terminate called without an active exception"). ddp_hpc.dist.cleanup_ddp() does the same.
del model, opt
gc.collect()
dist.destroy_process_group()
