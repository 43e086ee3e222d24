"""A plain DDP script (gloo, 2 x 2 ranks) whose rank 3 is frozen with SIGSTOP between its
optimizer step and the step's asynchronous metrics all-reduce (ddp_hpc's own loop starts one at
each logging step and reads it at the next). The other ranks start that all-reduce, then block in
DDP's all-reduce of the next step; the first times out after the collective timeout (argv[1]
seconds) and gloo fails the second with "Application timeout caused pair closure"."""
import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(sys.argv[1])))
rank = dist.get_rank()
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
pending = None
for step in range(1000):
    time.sleep(0.3)                                    # loading a batch
    loss = model(torch.randn(4, 8)).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if pending is not None:
        pending.wait()
    if rank == 3 and step == 6:
        os.kill(os.getpid(), signal.SIGSTOP)
    pending = dist.all_reduce(loss.detach(), async_op=True)
