"""Functions the Python API test submits (``ddp_hpc.submit_job(fn, ...)``): importable on every node
of the test cluster through PYTHONPATH, as a user's own module would be. Also ``wait_for``, the
cluster tests' one polling loop."""

import os
import socket
import time

import torch
import torch.distributed as dist


def allsum(offset: float) -> dict:
    """Every rank joins with env:// and all-reduces rank + offset; returns what rank 0 saw."""
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank()) + offset])
    dist.all_reduce(t)
    out = {"sum": t.item(), "world": dist.get_world_size(), "rank": int(os.environ["RANK"]),
           "host": socket.gethostname()}
    dist.destroy_process_group()
    return out


def fail_on(rank: int) -> None:
    """Rank ``rank`` raises; the others wait in a collective until the job ends them."""
    dist.init_process_group("gloo")
    if dist.get_rank() == rank:
        raise ValueError(f"rank {rank} refuses")
    dist.barrier()


def wait_for(what: str, cond, timeout: float, every: float = 0.5):
    """Poll ``cond()`` every ``every`` seconds until it returns something true, and return that;
    fail the test naming ``what`` after ``timeout`` seconds."""
    import pytest  # here, not at the top: the job scripts import this module on the nodes

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := cond():
            return got
        time.sleep(every)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
