"""``ddp_hpc.checkpoint.save(..., blocking=False)`` for users' scripts, in real processes: the handle,
the one-in-flight rule and a failure raised on the next save, `preemption.requeue` and the exit
waiting for the write (a failure at exit is printed, never lost)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from ddp_hpc.judge.nodefiles import rank_events
from ddp_hpc.launch import launch_distributed

ROOT = Path(__file__).resolve().parents[1]
FAST = "forkserver"  # ranks fork from one server that imported torch (tests/conftest.py)


def _saver(rank: int, world: int, tmp: str) -> dict:
    os.environ["DDP_HPC_LOG_DIR"] = f"{tmp}/logs"
    from ddp_hpc import checkpoint
    from ddp_hpc.dist import cleanup_ddp, setup_ddp
    setup_ddp()
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(256, 256))
        opt = torch.optim.Adam(model.parameters())
        model(torch.randn(4, 256)).sum().backward()
        opt.step()
        first = checkpoint.save(f"{tmp}/ckpt", model, opt, step=1, blocking=False, note="a")
        with torch.no_grad():                         # training goes on while it is written
            model.module.weight.add_(1.0)
        second = checkpoint.save(f"{tmp}/ckpt", model, opt, step=2, blocking=False)
        out = {"first_done": first.done, "first": first.wait(), "second": second.wait(),
               "waited": checkpoint.wait()}
        blocked = Path(tmp) / "blocked"
        if rank == 0:
            blocked.write_text("a file where a directory should be\n")
        failing = checkpoint.save(blocked / "ckpt", model, opt, step=3, blocking=False)
        try:
            checkpoint.save(f"{tmp}/ckpt", model, opt, step=4, blocking=False)
            out["raised"] = None
        except checkpoint.CheckpointError as e:
            out["raised"] = str(e)
        out["failing_path"] = failing.path
        fresh = torch.nn.Linear(256, 256)
        out["loaded"] = checkpoint.load(f"{tmp}/ckpt/ckpt-000000001.pt", fresh)
        out["weight_1"] = fresh.weight.detach().clone()
        out["weight_live"] = model.module.weight.detach().clone()
        return out
    finally:
        cleanup_ddp()


def test_background_saves_in_a_two_rank_script(tmp_path):
    r0, r1 = launch_distributed(_saver, 2, args=(str(tmp_path),), start_method=FAST, timeout=120)
    assert r0["first_done"] is True                  # the second save waited for the first
    assert r0["first"] == tmp_path / "ckpt" / "ckpt-000000001.pt"
    assert r0["second"] == r0["waited"] == tmp_path / "ckpt" / "ckpt-000000002.pt"
    assert r1["first"] is None and r1["second"] is None and r1["failing_path"] is None
    assert r0["failing_path"] == tmp_path / "blocked" / "ckpt" / "ckpt-000000003.pt"
    assert str(r0["failing_path"]) in r0["raised"] and "NotADirectoryError" in r0["raised"]
    assert r1["raised"] is None                      # only rank 0 writes
    assert r0["loaded"] == {"note": "a", "step": 1}
    # the file holds the state of the moment of save, not what training did after it
    assert torch.equal(r0["weight_1"] + 1.0, r0["weight_live"])
    events = rank_events(tmp_path / "logs", 0).events
    saves = [e for e in events if e["event"] == "checkpoint"]
    assert [e["step"] for e in saves] == [1, 2]
    assert all(e["blocking_s"] >= 0 and e["write_s"] > 0 for e in saves)


SCRIPT = textwrap.dedent("""
    import sys, torch
    from ddp_hpc import checkpoint, preemption
    model = torch.nn.Linear(8, 8)
    model.ballast = torch.nn.Parameter(torch.arange(4_000_000, dtype=torch.float32), requires_grad=False)
    checkpoint.save(sys.argv[2], model, step=5, blocking=False)
    if sys.argv[1] == "requeue":
        preemption.requeue()
""")


def _script(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDP_HPC_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(PYTHONPATH=str(ROOT), DDP_HPC_LOG_DIR=str(tmp_path / "logs"))
    return subprocess.run([sys.executable, "-c", SCRIPT, *args], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


def test_requeue_and_the_exit_wait_for_the_write_and_a_failure_at_exit_is_printed(tmp_path):
    done = _script(tmp_path, "requeue", str(tmp_path / "ckpt"))
    assert done.returncode == 75, done.stderr
    state = torch.load(tmp_path / "ckpt" / "ckpt-000000005.pt", weights_only=True)
    assert torch.equal(state["model"]["ballast"], torch.arange(4_000_000, dtype=torch.float32))
    events = [e["event"] for e in rank_events(tmp_path / "logs", 0).events]
    assert events.index("checkpoint") < events.index("preempt")

    exit_ = _script(tmp_path, "exit", str(tmp_path / "ckpt2"))      # ends right after the save
    assert exit_.returncode == 0, exit_.stderr
    assert (tmp_path / "ckpt2" / "ckpt-000000005.pt").exists()

    (tmp_path / "blocked").write_text("x\n")
    failed = _script(tmp_path, "exit", str(tmp_path / "blocked" / "ckpt"))
    assert f"{tmp_path}/blocked/ckpt/ckpt-000000005.pt" in failed.stderr
    assert "ddp_hpc.checkpoint: the checkpoint of step 5 was not written" in failed.stderr
