"""Issue 34 on a real GPU: the compute timer reads CUDA events (a forward that does more GPU work
measures longer), and NVML samples this GPU (ddp_hpc/runlogs/gpu.py; needs ``pynvml``, the
``ddp_hpc[gpu]`` extra). The figures go to the report directory (gpu_observe.json)."""
from __future__ import annotations

import json

import pytest
import torch

from ddp_hpc.instrument.compute import ComputeTimer
from ddp_hpc.runlogs import gpu

from ._helpers import MARKS, real_gpu, report_dir

pytestmark = MARKS + [real_gpu, pytest.mark.timeout(120)]


def _forward_s(timer: ComputeTimer, size: int, steps: int = 20) -> float:
    w = torch.randn(size, size, device="cuda", requires_grad=True)
    x = torch.randn(size, size, device="cuda")
    for _ in range(steps):
        timer.ready()
        loss = (x @ w @ w).square().mean()
        timer.backward(loss)
        loss.backward()
    torch.cuda.synchronize()
    return timer.take(steps)


def test_the_compute_timer_reads_cuda_events_on_a_gpu(tmp_path):
    timer = ComputeTimer()
    _forward_s(timer, 256, steps=2)          # the first backward on CUDA switches to events
    assert timer.cuda is torch.cuda and timer.device.type == "cuda"
    small, large = _forward_s(timer, 256), _forward_s(timer, 4096)
    assert 0 < small < large, (small, large)
    (report_dir(tmp_path) / "gpu_observe_compute.json").write_text(
        json.dumps({"forward_s_256": small, "forward_s_4096": large}))


def test_nvml_samples_this_gpu(tmp_path):
    pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed (pip install ddp_hpc[gpu])")

    class Log:
        events: list = []

        def event(self, name, **fields):
            self.events.append((name, fields))

    device = torch.device("cuda", torch.cuda.current_device())
    name = gpu.nvml_id(device)
    assert name is not None
    s = gpu.GpuSampler(Log(), lambda: name, nvml=gpu.load_nvml())
    got = s.once()
    assert got is not None and got["gpu"] == str(name), got
    assert 0 <= got["util_percent"] <= 100 and got["mem_total_mb"] > 0 and 0 < got["mem_used_mb"] <= got["mem_total_mb"]
    assert Log.events == [("gpu", got)]
    (report_dir(tmp_path) / "gpu_observe_nvml.json").write_text(json.dumps(got))
