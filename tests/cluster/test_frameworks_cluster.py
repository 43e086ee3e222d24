"""A plain Lightning script and a plain Hugging Face Trainer script on the real test cluster
(2 nodes x 1 task, sbatch backend), side by side, unchanged: ``ddp-hpc status`` shows their
progress (total and loss), and rank 0's TensorBoard files are read back. One task a node: each
rank process imports torch and a framework (seconds of CPU) before it does anything."""

from __future__ import annotations

import importlib.util
import re
import sys
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ddp_hpc import records
from ddp_hpc.judge.nodefiles import rank_events

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
#: the exec wrapper's bootstrap calls ddp_hpc.integrations.register; a stand-in until it exists
BOOTSTRAP = ROOT / "tests" / "bootstrap_site"


def _last_step(log_dir: str) -> dict:
    events = rank_events(log_dir, 0).events
    return [e for e in events if e["event"] == "step"][-1]


def test_lightning_and_hf_scripts_on_two_nodes_show_progress_and_tensorboard(slurm_cluster):
    """Only test of the Lightning and Hugging Face integrations on real Slurm ranks."""
    c = slurm_cluster
    d = c.shared_dir / f"frameworks-{time.monotonic_ns()}"
    d.mkdir()
    path = str(ROOT) if importlib.util.find_spec("ddp_hpc.instrument") else f"{BOOTSTRAP}:{ROOT}"
    env = {**c.env, "DDP_HPC_HOME": str(d / "home"), "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}
    scripts = {"lightning_trainer": ["--devices", "1", "--num-nodes", "2", "--epochs", "2", "--samples", "128"],
               "hf_trainer": ["--max-steps", "6", "--output-dir", str(d / "hf-out")]}
    jobs = {}
    for name, args in scripts.items():
        p = c.run([PY, "-m", "ddp_hpc.submit", "--backend", "sbatch", "-N", "2", "-G", "1", "-t", "10",
                   str(ROOT / "examples" / f"{name}.py"), *args], cwd=str(d), env=env, timeout=120)
        assert p.returncode == 0, p.stderr
        jobs[name] = p.stdout.split()[-1]
    states = {name: c.wait(job, timeout=300) for name, job in jobs.items()}
    recs = {r.name: r for r in records.list_records({"DDP_HPC_HOME": str(d / "home")})}
    detail = {name: c.run([PY, "-m", "ddp_hpc.status", job], cwd="/", env=env, timeout=120).stdout
              for name, job in jobs.items()}
    print(states, detail)
    assert states == {"lightning_trainer": "COMPLETED", "hf_trainer": "COMPLETED"}
    # Lightning: 128 samples / (16 x 2 ranks) = 4 steps an epoch, 2 epochs
    assert re.search(r"Progress:   e1 s8/8 100%, loss [\d.]+, [\d.]+ samples/s", detail["lightning_trainer"])
    assert re.search(r"Progress:   e0 s6/6 100%, loss [\d.]+", detail["hf_trainer"])
    for name, rec in recs.items():
        assert f"TensorBoard: tensorboard --logdir {rec.log_dir}" in detail[name]
        acc = EventAccumulator(rec.log_dir)
        acc.Reload()
        assert acc.Scalars("train/loss")[-1].step == _last_step(rec.log_dir)["step"]
