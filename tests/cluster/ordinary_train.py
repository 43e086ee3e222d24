"""A plain DDP script for the do-no-harm cluster tests (test_do_no_harm_cluster.py): no ddp_hpc
import, so the supervisor sees its steps only through the instrumentation of ``ddp_hpc.exec``. It
does what ordinary scripts do and what must never be called a hang:

- ``FIRST_S``: every rank works (CPU) this long before its first step (a compilation, a cache
  warming);
- ``SAVE_AT`` / ``SAVE_S``: at that step rank 0 saves (``torch.save`` again and again) this long,
  while the others wait in ``dist.barrier()``;
- ``EVAL_AT`` / ``EVAL_S``: at that step rank 0 evaluates (CPU) this long while the others wait in
  ``dist.barrier()``;
- ``STEPS`` steps of about 0.1 s in all."""
import os
import time

import torch
import torch.distributed as dist


def busy(seconds: float, save_to: str | None = None) -> None:
    end = time.time() + seconds
    state = {"w": torch.randn(1_000_000)}
    while time.time() < end:
        if save_to:
            torch.save(state, save_to)
        else:
            torch.randn(200, 200) @ torch.randn(200, 200)


def num(name: str, default: float = 0.0) -> float:
    return float(os.environ.get(name, default))


dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
busy(num("FIRST_S"))
for step in range(1, int(num("STEPS", 60)) + 1):
    loss = model(torch.randn(32, 16)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.1)
    if step == int(num("SAVE_AT", -1)):
        if rank == 0:
            busy(num("SAVE_S"), os.path.join(os.environ.get("CKPT_DIR", "."), "model.pt"))
        dist.barrier()
    if step == int(num("EVAL_AT", -1)):
        if rank == 0:
            busy(num("EVAL_S"))
        dist.barrier()
dist.destroy_process_group()
print(f"rank {rank}: done", flush=True)
