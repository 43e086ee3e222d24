"""setup_ddp on CUDA: backend auto -> nccl on cuda:0, an all_reduce, DDP with device_ids, cleanup;
two ranks (one GPU each, or sharing one where nccl allows it, or over gloo); device binding for
CUDA_VISIBLE_DEVICES unset, ``0`` and one device per task."""
from __future__ import annotations

import math
import os
import subprocess

import pytest
import torch

from ddp_hpc.dist import device_index, select_device
from ddp_hpc.env import DistEnv
from ddp_hpc.launch import RankFailedError, launch_distributed

from ._helpers import BACKEND, DEVICE, GPU_COUNT, HAVE_CUDA, MARKS, REPO, child_env, python, real_gpu
from .probe import parse

pytestmark = MARKS + [pytest.mark.timeout(180)]


def _ddp_step(ctx) -> float:
    """One DDP forward/backward with the context's device_ids; the gradient norm (all-reduced)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(ctx.device)
    ddp = DDP(model, device_ids=ctx.device_ids)
    torch.manual_seed(100 + ctx.env.rank)                  # each rank its own batch
    ddp(torch.randn(16, 8, device=ctx.device)).square().mean().backward()
    return float(model.weight.grad.norm())


def _setup_reduce(rank: int, world: int, backend: str = "auto") -> dict:
    import os

    import torch.distributed as dist

    from ddp_hpc.dist import cleanup_ddp, setup_ddp
    ctx = setup_ddp(backend=backend, timeout=120)
    try:
        t = torch.full((1024,), float(rank + 1), device=ctx.device)
        dist.all_reduce(t)
        out = {"backend": ctx.backend, "device": str(ctx.device), "device_ids": ctx.device_ids,
               "current": torch.cuda.current_device() if ctx.device.type == "cuda" else None,
               "sum": float(t[0]), "tensor_device": str(t.device), "grad_norm": _ddp_step(ctx),
               "async_errors": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"),
               "ifname": ctx.socket_ifname}
    finally:
        cleanup_ddp()
    out["destroyed"] = not dist.is_initialized()
    return out


def test_single_rank_auto_is_nccl_on_cuda0_with_all_reduce_ddp_and_cleanup():
    [r] = launch_distributed(_setup_reduce, 1, timeout=150)
    assert (r["backend"], r["device"], r["tensor_device"]) == (BACKEND, DEVICE, DEVICE)
    assert r["sum"] == 1.0 and r["destroyed"] and r["grad_norm"] > 0
    if HAVE_CUDA:
        assert r["device_ids"] == [0] and r["current"] == 0
        assert r["async_errors"] == "1"               # set before the nccl init (NCCL_DEFAULTS)


def test_two_ranks_nccl_one_gpu_each_or_sharing_one_where_nccl_allows():
    try:
        res = launch_distributed(_setup_reduce, 2, timeout=150)
    except RankFailedError as e:
        if GPU_COUNT == 1 and ("Duplicate GPU" in str(e) or "invalid usage" in str(e).lower()):
            pytest.skip("needs 2 GPUs: nccl refuses two ranks on one GPU (both local ranks bind "
                        f"cuda:0 when one GPU is visible): {e.message.splitlines()[0][:200]}")
        raise
    assert [r["backend"] for r in res] == [BACKEND] * 2
    assert [r["sum"] for r in res] == [3.0, 3.0] and all(r["destroyed"] for r in res)
    assert res[0]["grad_norm"] == res[1]["grad_norm"]          # DDP averaged the two ranks' gradients
    if GPU_COUNT >= 2:
        assert [r["device"] for r in res] == ["cuda:0", "cuda:1"]
        assert [r["device_ids"] for r in res] == [[0], [1]]


def _gloo_fit(rank: int, world: int, tmp: str) -> dict:
    """backend='gloo' with CUDA tensors, then fit() in that group: DDP(device_ids) over gloo."""
    import torch.distributed as dist

    from ddp_hpc.dist import cleanup_ddp, setup_ddp
    from ddp_hpc.examples.models import MLP
    from ddp_hpc.examples.synthetic import SyntheticClassification
    from ddp_hpc.train import fit
    ctx = setup_ddp(backend="gloo", timeout=120)
    try:
        t = torch.full((8,), float(rank + 1), device=ctx.device)
        dist.all_reduce(t)
        torch.manual_seed(0)
        res = fit(MLP(in_dim=16, hidden=32, num_classes=4),
                  SyntheticClassification(size=256, in_dim=16, num_classes=4, seed=0),
                  overrides=["train.batch_size=16", "train.max_steps=6", "log.progress=off",
                             f"log.dir={tmp}/logs", f"checkpoint.dir={tmp}/ckpt"])
        p = next(res.model.parameters())
        return {"device": str(ctx.device), "sum": float(t[0]), "status": res.status,
                "param_device": str(p.device), "loss": res.loss,
                "weights": {k: v.cpu().tolist() for k, v in res.model.state_dict().items()}}
    finally:
        cleanup_ddp()


def test_two_ranks_over_gloo_with_cuda_tensors_train_with_ddp_device_ids(tmp_path):
    res = launch_distributed(_gloo_fit, 2, args=(str(tmp_path),), timeout=150)
    assert [r["sum"] for r in res] == [3.0, 3.0]
    assert [r["status"] for r in res] == ["completed"] * 2
    want = ["cuda:0", "cuda:1"] if GPU_COUNT >= 2 else [DEVICE, DEVICE]
    assert [r["device"] for r in res] == [r["param_device"] for r in res] == want
    assert res[0]["weights"] == res[1]["weights"]               # DDP kept the replicas equal
    assert res[0]["loss"] is not None and math.isfinite(res[0]["loss"])


# ----------------------------------------------------------------------------- device binding
def _env(local_rank: int, local_world: int) -> DistEnv:
    return DistEnv(rank=local_rank, local_rank=local_rank, world_size=local_world,
                   local_world_size=local_world, node_rank=0, num_nodes=1, master_addr="127.0.0.1",
                   master_port=29500, hostnames=("h",), job_id=None, restart_count=0, launcher="torchrun")


def _probe(unset: bool = False, **env: str) -> dict:
    """``probe.py toolkit`` in a child with ``env`` added (``unset``: no CUDA_VISIBLE_DEVICES)."""
    environ = child_env(**env)
    if unset:
        environ.pop("CUDA_VISIBLE_DEVICES", None)
    p = subprocess.run([python(), str(REPO / "tests" / "gpu" / "probe.py"), "toolkit"], cwd=REPO,
                       env=environ, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return parse(p.stdout)


@real_gpu
def test_binding_with_cuda_visible_devices_unset_is_the_local_rank():
    last = GPU_COUNT - 1
    assert device_index(_env(0, 1), {}) == 0
    assert device_index(_env(last, GPU_COUNT), {}) == last      # --gpus-per-node / torchrun style
    dev = select_device(_env(last, GPU_COUNT), {})
    assert dev == torch.device("cuda", last)
    assert torch.ones(2, device=dev).sum().item() == 2.0
    seen = _probe(unset=True)                                   # a real setup_ddp, nothing set
    assert (seen["backend"], seen["device"]) == ("nccl", "cuda:0")
    assert seen["device_count"] >= GPU_COUNT and seen["env"]["CUDA_VISIBLE_DEVICES"] is None


@real_gpu
def test_binding_with_cuda_visible_devices_0():
    assert device_index(_env(0, 1), {"CUDA_VISIBLE_DEVICES": "0"}) == 0
    seen = _probe(CUDA_VISIBLE_DEVICES="0")
    assert (seen["backend"], seen["device"], seen["device_count"]) == ("nccl", "cuda:0", 1)
    assert seen["sum"] == seen["expected_sum"] == 1.0


@real_gpu
def test_binding_with_one_device_per_task_takes_cuda0_and_the_right_physical_gpu():
    last = GPU_COUNT - 1
    # --gpus-per-task=1 / --gpu-bind: local rank 1 of 2 sees only its own GPU -> cuda:0
    per_task = {"CUDA_VISIBLE_DEVICES": str(last), "SLURM_GPUS_ON_NODE": "2"}
    assert device_index(_env(1, 2), per_task) == 0
    assert select_device(_env(1, 2), {"CUDA_VISIBLE_DEVICES": str(last)}) == torch.device("cuda", 0)
    everything = _probe()                  # numbered as in this process (its CUDA_VISIBLE_DEVICES, if any)
    ours = os.environ.get("CUDA_VISIBLE_DEVICES")
    mine = _probe(CUDA_VISIBLE_DEVICES=ours.split(",")[last].strip() if ours else str(last))
    assert (mine["device"], mine["device_count"]) == ("cuda:0", 1)
    assert mine["uuids"] == [everything["uuids"][last]]        # cuda:0 there is physical GPU `last`
