"""A plain DDP script for the fast hang detection's cluster test (test_hang_cluster.py): no
ddp_hpc import, so its steps reach the supervisor only through the instrumentation of
``ddp_hpc.exec``. In its first run (``DDP_HPC_ALLOC_RESTARTS`` 0 or unset) rank ``$HANG_RANK``
sleeps in step ``$HANG_STEP`` outside any collective, while the others wait for it in DDP's
all-reduce; gloo's collective timeout is PyTorch's default (30 min), so only the supervisor's hang
limit ends the hang. A later run trains its ``$STEPS`` steps and ends."""
import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
first = os.environ.get("DDP_HPC_ALLOC_RESTARTS", "0") == "0"
for step in range(1, int(os.environ.get("STEPS", "30")) + 1):
    if first and rank == int(os.environ.get("HANG_RANK", "-1")) and step == int(os.environ.get("HANG_STEP", "0")):
        time.sleep(600)
    loss = model(torch.randn(32, 16)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.2)
dist.destroy_process_group()
