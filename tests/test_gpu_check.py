"""The GPU checks on a machine without a GPU (CI, laptops): scripts/gpu-check.sh refuses at once with
a clear message and runs nothing, and tests/gpu collects and skips with its reason instead of
erroring. On a machine with a GPU these two tests skip: there, run scripts/gpu-check.sh itself."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
HAS_GPU = torch.cuda.is_available() or shutil.which("nvidia-smi") is not None \
    or any(Path("/dev").glob("nvidia[0-9]*"))
pytestmark = pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU: run scripts/gpu-check.sh")


def test_gpu_check_fails_fast_and_clearly_without_a_gpu(tmp_path):
    t0 = time.monotonic()
    p = subprocess.run(["bash", str(REPO / "scripts" / "gpu-check.sh"), "--out", str(tmp_path / "out")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == 3, p.stderr
    assert took < 30, f"took {took:.1f} s"
    assert "gpu-check: no GPU here: nvidia-smi not found and no /dev/nvidia* device" in p.stderr
    assert "nothing was run" in p.stderr and "docs/gpu.md" in p.stderr
    assert p.stdout == "" and not (tmp_path / "out").exists()          # no report, no logs


def test_gpu_suite_collects_and_skips_with_its_reason(tmp_path):
    p = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "-rs", "-q", "-p", "no:cacheprovider"],
                       cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items() if k != "DDP_HPC_GPU_TESTS_ON_CPU"})
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    summary = out.strip().splitlines()[-1]
    assert " skipped" in summary and "passed" not in summary and "error" not in summary, summary
    assert int(summary.split()[0]) >= 20, summary                     # every module was collected
    assert "no CUDA device (torch.cuda.is_available() is False)" in out
