"""The training core on CUDA: ``fit()`` and ``python -m ddp_hpc.run jobs/demo.yaml`` in fp32, bf16 and
fp16 (GradScaler), and the preemption path (SIGUSR2 -> checkpoint -> exit 75 -> the same command
resumes). One rank per GPU, up to 2 (a world of one on a one-GPU machine)."""
from __future__ import annotations

import math
import signal
import time

import pytest
import torch

from ddp_hpc.launch import launch_distributed, run_local, start_local
from ddp_hpc.train.checkpoint import find_latest_valid

from ._helpers import DEVICE, MARKS, PRECISIONS, REPO, WORLD, child_env, events, python, tail

pytestmark = MARKS + [pytest.mark.timeout(240)]

DEMO = str(REPO / "jobs" / "demo.yaml")


def _fit(rank: int, world: int, tmp: str, precision: str) -> dict:
    from ddp_hpc.examples.models import MLP
    from ddp_hpc.examples.synthetic import SyntheticClassification
    from ddp_hpc.train import fit
    torch.manual_seed(0)
    res = fit(MLP(in_dim=32, hidden=256, num_classes=10, depth=2),
              SyntheticClassification(size=2048, in_dim=32, num_classes=10, seed=0),
              overrides=[f"train.precision={precision}", "train.batch_size=64", "train.max_steps=12",
                         "optim.name=adamw", "optim.lr=0.003", "log.progress=off", "log.every_n_steps=4",
                         f"log.dir={tmp}/logs", f"checkpoint.dir={tmp}/ckpt"])
    params = list(res.model.parameters())
    return {"status": res.status, "step": res.step, "loss": res.loss, "checkpoint": res.checkpoint,
            "devices": sorted({str(p.device) for p in params}),
            "dtypes": sorted({str(p.dtype) for p in params}),
            "finite": all(bool(torch.isfinite(p).all()) for p in params)}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_fit_on_cuda(tmp_path, precision):
    res = launch_distributed(_fit, WORLD, args=(str(tmp_path), precision), timeout=200)
    r = res[0]
    assert [x["status"] for x in res] == ["completed"] * WORLD and r["step"] == 12
    assert r["devices"] == [DEVICE] and r["dtypes"] == ["torch.float32"]   # master weights stay fp32
    assert r["finite"] and math.isfinite(r["loss"])
    _, state = find_latest_valid(tmp_path / "ckpt", warn=pytest.fail)
    assert state["step"] == 12
    assert all(t.device.type == "cpu" for t in state["model"].values())     # map_location="cpu"
    if precision == "fp16":      # the scaler ran and its state is in the checkpoint
        assert state["scaler"] and state["scaler"]["scale"] > 0
    else:
        assert state["scaler"] is None
    start = next(e for e in events(tmp_path / "logs")[0] if e["event"] == "start")
    assert start["device"] == DEVICE


def _demo(tmp, *extra: str) -> list[str]:
    return [python(), "-m", "ddp_hpc.run", DEMO, f"log.dir={tmp}/logs", f"checkpoint.dir={tmp}/ckpt",
            "data.kwargs.size=1024", "log.every_n_steps=4", "log.progress=off", *extra]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_ddp_hpc_run_demo_on_cuda(tmp_path, precision):
    res = run_local(_demo(tmp_path, f"train.precision={precision}", "train.epochs=1"), nodes=1,
                    procs_per_node=WORLD, log_dir=tmp_path / "out", env=child_env())
    assert res.ok, tail(tmp_path / "out")
    ev = events(tmp_path / "logs")
    assert sorted(ev) == list(range(WORLD))
    start, end = ev[0][0], ev[0][-1]
    assert start["event"] == "start" and start["device"] == DEVICE
    assert end["event"] == "end" and end["status"] == "completed"
    evals = [e for e in ev[0] if e["event"] == "eval"]
    assert evals and evals[-1]["metrics"]["count"] == 102                     # 10% of 1024
    assert math.isfinite(evals[-1]["metrics"]["loss"])
    _, state = find_latest_valid(tmp_path / "ckpt", warn=pytest.fail)
    assert state["config"]["train"]["precision"] == precision


def _wait_for_step(root, procs, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ev = events(root) if root.exists() else {}
        if any(e["event"] == "step" and e["step"] >= step for e in ev.get(0, [])):
            return
        assert all(p.poll() is None for p in procs), "a rank ended before the signal"
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout} s")


def test_usr2_checkpoints_exits_75_and_the_same_command_resumes_on_cuda(tmp_path):
    argv = _demo(tmp_path, "train.epochs=200", "checkpoint.every_steps=0", "train.batch_size=16",
                 "train.precision=bf16")
    run = start_local(argv, nodes=1, procs_per_node=WORLD, log_dir=tmp_path / "out", env=child_env())
    try:
        _wait_for_step(tmp_path / "logs", run.procs, 8)
        run.send_signal(signal.SIGUSR2)
        codes = [p.wait(timeout=60) for p in run.procs]
    finally:
        run.kill(grace=1)
    assert codes == [75] * WORLD, tail(tmp_path / "out")
    ev = events(tmp_path / "logs")
    pre = [e for e in ev[0] if e["event"] == "preempt"]
    assert len(pre) == 1 and pre[0]["signal"] == "SIGUSR2" and pre[0]["reason"] == "preemption"
    assert ev[0][-1]["event"] == "end" and ev[0][-1]["status"] == "preempted"
    stop = pre[0]["step"]
    path, state = find_latest_valid(tmp_path / "ckpt", warn=pytest.fail)    # map_location="cpu"
    assert state["step"] == stop and all(t.device.type == "cpu" for t in state["model"].values())
    if torch.cuda.is_available():
        assert "cuda" in state["rng"][0]          # the CUDA generator's state was saved too

    # the same command again, stopping a few steps later: resumes from that checkpoint
    res = run_local(argv + [f"train.max_steps={stop + 6}"], nodes=1, procs_per_node=WORLD,
                    log_dir=tmp_path / "out2", env=child_env())
    assert res.ok, tail(tmp_path / "out2")
    text = "".join(p.read_text() for p in (tmp_path / "logs").rglob("rank0.log"))
    assert f"resumed from {path} at step {stop}" in text
    ends = [e for e in events(tmp_path / "logs")[0] if e["event"] == "end"]
    assert [e["status"] for e in ends] == ["preempted", "completed"] and ends[-1]["step"] == stop + 6
