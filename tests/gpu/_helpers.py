"""What every module of tests/gpu shares: the skip rule, what to expect, the children's environment
and reading run logs.

Without CUDA every test skips with the reason ``NO_CUDA`` (``pytest tests/gpu -rs`` shows it).
``DDP_HPC_GPU_TESTS_ON_CPU=1`` runs the tests that make sense on CPU anyway, expecting gloo and
``cpu`` instead of nccl and ``cuda:0`` (fp16 and the GPU-only checks still skip): a dry run of the
suite's own plumbing, so that GPU time is not spent finding a typo (docs/gpu.md).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from ddp_hpc.judge.nodefiles import log_events

REPO = Path(__file__).resolve().parents[2]
NO_CUDA = "no CUDA device (torch.cuda.is_available() is False)"
HAVE_CUDA = torch.cuda.is_available()
ON_CPU = not HAVE_CUDA and os.environ.get("DDP_HPC_GPU_TESTS_ON_CPU") == "1"
GPU_COUNT = torch.cuda.device_count() if HAVE_CUDA else 0
DEVICE = "cuda:0" if HAVE_CUDA else "cpu"         # what rank 0 must bind
BACKEND = "nccl" if HAVE_CUDA else "gloo"         # what backend="auto" must pick
#: ranks for the multi-rank checks: one per GPU, up to 2 (one GPU: a world of one)
WORLD = 2 if GPU_COUNT >= 2 else 1

#: every test module: ``pytestmark = MARKS``
MARKS = [pytest.mark.gpu, pytest.mark.skipif(not (HAVE_CUDA or ON_CPU), reason=NO_CUDA)]
#: tests that mean nothing on CPU, even in the dry run
real_gpu = pytest.mark.skipif(not HAVE_CUDA, reason=NO_CUDA + "; no CPU dry run of this check")
PRECISIONS = ["fp32", "bf16", pytest.param("fp16", marks=real_gpu)]   # fp16 (GradScaler) is CUDA only

_DROP = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "DDP_HPC_", "TORCHELASTIC_", "SUBMITIT_")
_DROP_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
              "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NCCL_SOCKET_IFNAME",
              "GLOO_SOCKET_IFNAME"}


def child_env(**extra: str) -> dict[str, str]:
    """This environment for a child process: no launcher or Slurm variables of whoever started
    pytest, no socket interface choices, this checkout first on PYTHONPATH (scripts/gpu-check.sh
    installs no ddp_hpc on the GPU node), unbuffered output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DROP) and k not in _DROP_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def python() -> str:
    return sys.executable


def events(root: Path) -> dict[int, list[dict]]:
    """Every rank's run-log events under ``root``, in time order."""
    out: dict[int, list[dict]] = {}
    for log_dir in sorted({p.parent for p in Path(root).rglob("*.events.jsonl")}):
        for r, s in log_events(log_dir).items():
            out.setdefault(r, []).extend(s.events)
    return {r: sorted(v, key=lambda e: e["time"]) for r, v in out.items()}


def tail(log_dir: Path, rank: int = 0, chars: int = 3000) -> str:
    """The end of a local launch's ``rank<R>.out`` (for assertion messages)."""
    path = Path(log_dir) / f"rank{rank}.out"
    return path.read_text(errors="replace")[-chars:] if path.exists() else f"(no {path})"


def report_dir(fallback: Path) -> Path:
    """Where a test leaves files for scripts/gpu-check.sh's report: $GPU_REPORT_DIR (the script's
    results folder), else ``fallback`` (a tmp dir)."""
    if os.environ.get("GPU_REPORT_DIR") and Path(os.environ["GPU_REPORT_DIR"]).is_dir():
        return Path(os.environ["GPU_REPORT_DIR"])
    return fallback


def cpu_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


def assert_bitwise_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{what}: {differ} differ (max |d| " \
        f"{max(float((a[k].double() - b[k].double()).abs().max()) for k in differ):.3g})"
