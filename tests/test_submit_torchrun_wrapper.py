"""slurm/train_torchrun.sbatch's per-node wrapper, run here without Slurm: the preemption signal
sent to the wrapper's process group (what Slurm does to a step's task) must not kill torchrun
and must reach torchrun's workers, which live in their own sessions and so never see it
otherwise. The workers then checkpoint and stop (outside Slurm: exit code preempt.exit_code)."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_hpc.judge.nodefiles import rank_events

ROOT = Path(__file__).resolve().parents[1]


def _wrapper() -> str:
    text = (ROOT / "slurm" / "train_torchrun.sbatch").read_text()
    m = re.search(r"bash -c '(.*?)' ddp_hpc_node", text, re.S)
    assert m, "wrapper not found in slurm/train_torchrun.sbatch"
    return m.group(1)


def _events(d: Path, r: int):
    return rank_events(d, r).events


def test_usr2_to_wrapper_group_reaches_torchrun_workers(tmp_path):
    from ddp_hpc.env import free_port
    log_dir = tmp_path / "logs"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDP_HPC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(SLURM_NODEID="0", SLURM_NNODES="1", SLURM_JOB_ID=str(os.getpid()),
               NPROC_PER_NODE="2", RDZV_ENDPOINT=f"127.0.0.1:{free_port()}", PYTHON=sys.executable,
               PREEMPT_SIGNAL="USR2", DDP_HPC_LOG_DIR=str(log_dir))
    # SLURM_JOB_ID is only the rendezvous id here; without the other SLURM_* this is no Slurm job
    del env["SLURM_JOB_ID"]
    env["SLURM_JOB_ID"] = "1"
    args = [str(ROOT / "jobs" / "demo.yaml"), "train.epochs=1", "train.max_steps=2000",
            "data.kwargs.size=262144", "data.eval_split=0.0", "log.every_n_steps=1",
            "checkpoint.every_epochs=0", "preempt.requeue=false"]
    out = open(tmp_path / "node0.out", "wb")
    proc = subprocess.Popen(["bash", "-c", _wrapper(), "ddp_hpc_node", *args], env=env,
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if all(any(e["event"] == "step" for e in _events(log_dir, r)) for r in (0, 1)):
                break
            assert proc.poll() is None, (tmp_path / "node0.out").read_text()[-3000:]
            time.sleep(0.3)
        else:
            pytest.fail("training did not start: " + (tmp_path / "node0.out").read_text()[-3000:])
        os.killpg(proc.pid, signal.SIGUSR2)      # bash and torchrun, not the workers
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = (tmp_path / "node0.out").read_text()
    assert "forwards SIGUSR2 to the workers of torchrun" in text, text[-3000:]
    for r in (0, 1):
        ev = _events(log_dir, r)
        kinds = [e["event"] for e in ev]
        assert "preempt" in kinds and kinds[-1] == "end", (r, kinds[-5:], text[-2000:])
        assert ev[-1]["status"] == "preempted"
    assert any(e["event"] == "checkpoint" for e in _events(log_dir, 0))
    assert list((log_dir / "checkpoints").glob("*.pt"))
    assert rc != 0 and rc != -signal.SIGUSR2 and rc != 128 + signal.SIGUSR2   # torchrun was not killed by it
