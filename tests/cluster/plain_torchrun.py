"""An unmodified torchrun-style script (no ddp_hpc import): env:// init, one all_reduce, and one
JSON file per rank with what the rank saw. ``--fail-rank R`` makes rank R raise before the
collective (the others then block in it until the launcher ends them)."""

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--fail-rank", type=int, default=-1)
p.add_argument("--echo", nargs="*", default=[])
args, _extra = p.parse_known_args()   # the verbatim test passes "--" and such

dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == args.fail_rank:
    raise RuntimeError(f"rank {rank} was told to fail")
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
seen = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                       "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")}
seen.update(host=socket.gethostname(), sum=total.item(), argv=sys.argv[1:], echo=args.echo)
Path(args.out).mkdir(parents=True, exist_ok=True)
(Path(args.out) / f"rank{rank}.json").write_text(json.dumps(seen))
dist.barrier()
dist.destroy_process_group()
