"""One process of tests/gpu: set up a process group, all_reduce once, tear it down, and print what
it saw as one line ``PROBE {json}`` on stdout.

    python tests/gpu/probe.py toolkit   # ddp_hpc.dist.setup_ddp() (backend auto, its ifname choice)
    python tests/gpu/probe.py plain     # torch's own init_process_group, no ddp_hpc: NCCL's choices

Rank facts come from the usual variables (none: a world of one; MASTER_ADDR/MASTER_PORT as set).
Run with NCCL_DEBUG=INFO to see which interfaces NCCL's bootstrap and network transport took.
"""
from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def _plain() -> tuple[str, torch.device, int, int]:
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        from ddp_hpc.env import free_port
        os.environ["MASTER_PORT"] = str(free_port())
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120), **({"device_id": device} if cuda else {}))
    return backend, device, rank, world


def main(mode: str) -> int:
    from ddp_hpc.dist import cleanup_ddp, setup_ddp
    if mode == "toolkit":
        ctx = setup_ddp(timeout=120)
        backend, device, rank, world = ctx.backend, ctx.device, ctx.env.rank, ctx.env.world_size
    elif mode == "plain":
        backend, device, rank, world = _plain()
    else:
        print(f"usage: {sys.argv[0]} toolkit|plain", file=sys.stderr)
        return 2
    t = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(t)
    total = float(t[0].item())
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    facts = {
        "mode": mode, "backend": backend, "device": str(device), "rank": rank, "world": world,
        "sum": total, "expected_sum": world * (world + 1) / 2, "device_count": count,
        "uuids": [str(torch.cuda.get_device_properties(i).uuid) for i in range(count)],
        "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if count else None,
        "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME",
                                                "GLOO_SOCKET_IFNAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                                "MASTER_ADDR")},
    }
    cleanup_ddp()
    facts["destroyed"] = not dist.is_initialized()
    print("PROBE " + json.dumps(facts), flush=True)
    return 0


def parse(stdout: str) -> dict:
    """The facts a probe printed (the last PROBE line)."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("PROBE ")]
    if not lines:
        raise AssertionError(f"the probe printed no PROBE line; its output ends:\n{stdout[-3000:]}")
    return json.loads(lines[-1][len("PROBE "):])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ""))
