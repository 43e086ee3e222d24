"""Ctrl-C is a clean stop, and a plain `python -m ddp_hpc.run` resumes when run again: SIGINT
stops at the next step with a checkpoint, exit 75, one line that says how to resume; the same
command (same config and overrides) finds the same run directory and resumes from it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ddp_hpc.judge.nodefiles import rank_events

ROOT = Path(__file__).resolve().parents[1]


def _env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDP_HPC_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    return {**env, "PYTHONPATH": str(ROOT), "DDP_HPC_HOME": str(tmp_path / "home")}


def test_sigint_checkpoints_and_the_same_command_resumes(tmp_path):
    """The only Ctrl-C of a plain `python -m ddp_hpc.run` (no launcher) and its resume by the very
    same command."""
    # 16 steps of 0.64 s (64 samples of 0.01 s): Ctrl-C after the third leaves 8 s of run to stop
    args = [sys.executable, "-m", "ddp_hpc.run", str(ROOT / "jobs" / "demo.yaml"),
            f"log.dir={tmp_path / 'runs'}", "train.epochs=1", "data.kwargs.size=1024",
            "data.eval_split=0.0", "log.progress=lines", "log.every_n_steps=1",
            "data.dataset=tests.cluster.status_helpers:slow_synthetic", "data.kwargs.delay=0.01"]
    proc = subprocess.Popen(args, cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:      # until a few steps are done
        runs = list((tmp_path / "runs").glob("*/"))
        if runs and sum(e["event"] == "step" for e in rank_events(runs[0], 0).events) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 75, out
    assert "KeyboardInterrupt" not in out and "Traceback" not in out
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("demo-")
    assert "to resume: run the same command again" in out and f"checkpoint.dir={run_dir}/checkpoints" in out
    ends = [e for e in rank_events(run_dir, 0).events if e["event"] == "end"]
    assert ends[-1]["status"] == "interrupted"
    stopped = ends[-1]["step"]
    again = subprocess.run(args, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"at step {stopped} " in again.stderr and "resumed from" in again.stderr
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [run_dir.name]
