"""Checkpoints written from CUDA tensors: a run stopped by SIGUSR2 resumes bitwise equal to an
uninterrupted one (fp32, bf16, fp16 with its GradScaler; dropout makes the CUDA RNG state matter),
the file loads with ``map_location="cpu"`` into a CPU model, and the public
``ddp_hpc.checkpoint.save/load`` round-trips a CUDA model and optimizer to CPU and back."""
from __future__ import annotations

import io
import math
import os
import signal

import pytest
import torch

from ddp_hpc.launch import launch_distributed
from ddp_hpc.train.checkpoint import list_checkpoints, load_checkpoint

from ._helpers import HAVE_CUDA, MARKS, PRECISIONS, WORLD, assert_bitwise_equal, cpu_state

pytestmark = MARKS + [pytest.mark.timeout(240)]


def _bytes(state: dict) -> bytes:
    buf = io.BytesIO()       # tensors as bytes: a tensor sent through a pipe shares memory
    torch.save(state, buf)   # with a process that is about to exit
    return buf.getvalue()


def _unbytes(raw: bytes) -> dict:
    return torch.load(io.BytesIO(raw), weights_only=True)


def _model():
    from ddp_hpc.examples.models import MLP
    return MLP(in_dim=16, hidden=64, num_classes=4, dropout=0.2)


def _one_fit(tmp: str, precision: str, rank: int, world: int, signal_at: int | None = None) -> dict:
    from ddp_hpc.examples.synthetic import SyntheticClassification
    from ddp_hpc.train import fit
    from ddp_hpc.train.build import seed_everything
    seed_everything(0)
    model = _model()

    def hook(step: int, epoch: int) -> None:   # a real signal, delivered to this process
        if signal_at is not None and rank == world - 1 and step == signal_at:
            os.kill(os.getpid(), signal.SIGUSR2)
    res = fit(model, SyntheticClassification(size=300, in_dim=16, num_classes=4, seed=1),
              overrides=[f"train.precision={precision}", "train.batch_size=16", "train.grad_accum=2",
                         "train.epochs=2", "optim.momentum=0.9", "schedule.warmup_steps=2",
                         "checkpoint.every_epochs=1", "log.progress=off", "log.every_n_steps=2",
                         "train.eval_every_epochs=0", "preempt.check_every_steps=1",
                         f"log.dir={tmp}/logs", f"checkpoint.dir={tmp}/ckpt"], on_step=hook)
    return {"status": res.status, "step": res.step, "resumed_from": res.resumed_from,
            "device": str(next(res.model.parameters()).device), "state": _bytes(cpu_state(res.model))}


def _full_cut_resume(rank: int, world: int, tmp: str, precision: str) -> dict:
    """Three fits in one process group: uninterrupted, stopped by SIGUSR2 at step 5, resumed."""
    from ddp_hpc.dist import cleanup_ddp, setup_ddp
    setup_ddp(timeout=120)
    try:
        return {"full": _one_fit(f"{tmp}/full", precision, rank, world),
                "cut": _one_fit(f"{tmp}/cut", precision, rank, world, signal_at=5),
                "again": _one_fit(f"{tmp}/cut", precision, rank, world)}
    finally:
        cleanup_ddp()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_resume_from_a_cuda_checkpoint_is_bitwise_equal_and_it_loads_on_cpu(tmp_path, precision):
    [r, *_] = launch_distributed(_full_cut_resume, WORLD, args=(str(tmp_path), precision), timeout=200)
    full, cut, again = r["full"], r["cut"], r["again"]
    steps = 2 * math.ceil(math.ceil(math.ceil(300 / WORLD) / 16) / 2)   # 2 epochs, accum 2
    stop = 5 if WORLD == 1 else 6        # with 2 ranks the flag's all_reduce lands one step later
    assert (full["status"], full["step"]) == ("completed", steps)
    assert (cut["status"], cut["step"]) == ("preempted", stop)
    assert (again["status"], again["step"]) == ("completed", steps)
    assert again["resumed_from"].endswith(f"ckpt-{cut['step']:09d}.pt")
    assert full["device"] == again["device"] == ("cuda:0" if HAVE_CUDA else "cpu")
    assert_bitwise_equal(_unbytes(again["state"]), _unbytes(full["state"]), f"{precision} resumed vs full")

    # the stop checkpoint, written from CUDA tensors, loaded on CPU: bitwise the stopped model
    [(step, path)] = [x for x in list_checkpoints(tmp_path / "cut" / "ckpt") if x[0] == cut["step"]]
    state = load_checkpoint(path, map_location="cpu")
    tensors = list(state["model"].values()) + [t for s in state["optimizer"]["state"].values()
                                               for t in s.values() if isinstance(t, torch.Tensor)]
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    assert_bitwise_equal(state["model"], _unbytes(cut["state"]), "checkpoint vs stopped model")
    plain = _model()
    plain.load_state_dict(state["model"])                          # a CPU model takes it as is
    assert ("cuda" in state["rng"][0]) == HAVE_CUDA                # the CUDA RNG state travels too
    assert bool(state.get("scaler")) == (precision == "fp16")


def _public_api(rank: int, world: int, tmp: str) -> dict:
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_hpc import checkpoint
    from ddp_hpc.dist import cleanup_ddp, setup_ddp
    ctx = setup_ddp(timeout=120)
    try:
        torch.manual_seed(0)
        model = _model().eval().to(ctx.device)
        net = DDP(model, device_ids=ctx.device_ids) if world > 1 else model
        x, y = torch.randn(32, 16, device=ctx.device), torch.randint(0, 4, (32,), device=ctx.device)

        def step(m, opt):
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
        opt = torch.optim.Adam(net.parameters(), lr=0.01)
        step(net, opt)
        checkpoint.save(tmp, net, opt, step=1, epoch=0, note="from cuda")
        on_cpu = _model().eval()                                    # loaded on CPU
        opt_cpu = torch.optim.Adam(on_cpu.parameters(), lr=0.01)
        extras = checkpoint.load(tmp, on_cpu, opt_cpu, map_location="cpu")
        cpu_tensors = [t for s in opt_cpu.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        back = _model().eval().to(ctx.device)                       # and resumed on the GPU
        opt_back = torch.optim.Adam(back.parameters(), lr=0.01)
        checkpoint.load(tmp, back, opt_back, map_location="cpu")
        step(net, opt)
        step(back, opt_back)
        return {"extras": extras, "cpu": _bytes(on_cpu.state_dict()),
                "cpu_opt_on_cpu": bool(cpu_tensors) and all(t.device.type == "cpu" for t in cpu_tensors),
                "after": _bytes(cpu_state(model)), "back_after": _bytes(cpu_state(back)),
                "back_device": str(next(back.parameters()).device)}
    finally:
        cleanup_ddp()


def test_public_checkpoint_api_round_trips_cuda_to_cpu_and_back(tmp_path):
    [r, *_] = launch_distributed(_public_api, WORLD, args=(str(tmp_path),), timeout=150)
    assert r["extras"] == {"epoch": 0, "note": "from cuda", "step": 1}
    assert r["cpu_opt_on_cpu"] and r["back_device"] == ("cuda:0" if HAVE_CUDA else "cpu")
    state = load_checkpoint(tmp_path / "ckpt-000000001.pt", map_location="cpu")
    assert not any(k.startswith("module.") for k in state["model"])
    assert_bitwise_equal(_unbytes(r["cpu"]), state["model"], "loaded on CPU vs file")
    assert_bitwise_equal(_unbytes(r["back_after"]), _unbytes(r["after"]), "one more step after resume")
