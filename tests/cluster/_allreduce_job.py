"""One rank of a real multi-node gloo job (run by srun from tests/cluster/test_cluster_env.py).

Every rank joins through ``setup_ddp()`` (ddp_hpc.env.detect from srun's variables), all-reduces
rank+1 over the world and over its node group, and prints one JSON line.
"""

import json
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from ddp_hpc.dist import cleanup_ddp, node_group, setup_ddp

ctx = setup_ddp(timeout=timedelta(seconds=90))
env = ctx.env
world = torch.tensor([float(env.rank + 1)])
dist.all_reduce(world)
local = torch.tensor([float(env.rank + 1)])
dist.all_reduce(local, group=node_group(env))
print(json.dumps({"rank": env.rank, "node_rank": env.node_rank, "world_size": env.world_size,
                  "host": socket.gethostname(), "backend": ctx.backend, "device": str(ctx.device),
                  "ifname": ctx.socket_ifname, "world_sum": world.item(), "node_sum": local.item()}),
      flush=True)
cleanup_ddp()
