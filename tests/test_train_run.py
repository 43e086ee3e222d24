"""`python -m ddp_hpc.run` in 2 local processes: run-log contract, and preemption outside Slurm
(USR2 -> checkpoint -> exit code 75 on every rank -> the same command resumes and completes)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ddp_hpc.judge.nodefiles import log_events
from ddp_hpc.launch import run_local, start_local

REPO = Path(__file__).resolve().parents[1]
DEMO = str(REPO / "jobs" / "demo.yaml")
COMMON = {"time", "event", "rank", "job_id", "restart", "host"}
EXTRA = {  # docs/architecture.md, "Run logs"
    "start": {"world_size", "num_nodes", "local_rank", "pid", "total_steps", "epochs", "launcher"},
    "step": {"epoch", "step", "total_steps", "loss", "lr", "samples_per_s", "rss_mb", "cpu_percent", "compute_s"},
    "epoch": {"epoch", "step", "loss", "samples_per_s"},
    "eval": {"epoch", "step", "metrics"},
    "checkpoint": {"step", "path"},
    "preempt": {"signal", "reason", "step"},
    "end": {"status", "step"},
}


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDP_HPC_"))}


def _events(root: Path) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for d in {f.parent for f in root.rglob("*.events.jsonl")}:
        for r, s in log_events(d).items():
            out.setdefault(r, []).extend(s.events)
    return {r: sorted(v, key=lambda e: e["time"]) for r, v in out.items()}


def _argv(tmp: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ddp_hpc.run", DEMO, f"log.dir={tmp}/logs",
            f"checkpoint.dir={tmp}/ckpt", "data.kwargs.size=1024", "train.epochs=2",
            "log.every_n_steps=4", *extra]


def test_demo_in_two_processes_writes_the_run_log_contract(tmp_path):
    res = run_local(_argv(tmp_path), nodes=1, procs_per_node=2, log_dir=tmp_path / "out",
                    env=_env())
    assert res.ok, [(tmp_path / "out" / f"rank{r}.out").read_text()[-2000:] for r in (0, 1)]
    ev = _events(tmp_path / "logs")
    assert sorted(ev) == [0, 1]
    [saved] = list((tmp_path / "logs").rglob("config.yaml"))     # the resolved config, by rank 0
    resolved = yaml.safe_load(saved.read_text())
    assert resolved["train"]["epochs"] == 2 and resolved["data"]["kwargs"]["size"] == 1024
    for rank, events in ev.items():
        names = [e["event"] for e in events]
        assert names[0] == "start" and names[-1] == "end" and events[-1]["status"] == "completed"
        assert {"step", "epoch", "eval"} <= set(names)
        for e in events:
            assert COMMON <= e.keys() and e["rank"] == rank and e["restart"] == 0
            assert EXTRA.get(e["event"], set()) <= e.keys(), e
        steps = [e for e in events if e["event"] == "step"]
        assert steps[-1]["step"] == steps[-1]["total_steps"] == events[0]["total_steps"]
        assert all(e["compute_s"] > 0 for e in steps), steps     # the rank's own forward time
    # loss reduced across ranks: both ranks log the same numbers
    assert [e["loss"] for e in ev[0] if e["event"] == "step"] == \
           [e["loss"] for e in ev[1] if e["event"] == "step"]
    assert [e["event"] for e in ev[0]].count("checkpoint") >= 1
    assert "checkpoint" not in [e["event"] for e in ev[1]]          # only rank 0 writes
    assert ev[0][-2]["event"] == "eval" and ev[0][-2]["metrics"]["count"] == 102  # 10% of 1024
    text = next((tmp_path / "logs").rglob("rank0.log")).read_text()
    assert "epoch 1 done" in text and "end: completed" in text


def test_usr2_outside_slurm_checkpoints_exits_75_and_the_same_command_resumes(tmp_path):
    argv = _argv(tmp_path, "train.epochs=50", "checkpoint.every_steps=0", "train.batch_size=16")
    run = start_local(argv, nodes=1, procs_per_node=2, log_dir=tmp_path / "out", env=_env())
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:           # wait until training is under way
            ev = _events(tmp_path / "logs") if (tmp_path / "logs").exists() else {}
            if any(e["event"] == "step" and e["step"] >= 8 for e in ev.get(0, [])):
                break
            assert all(p.poll() is None for p in run.procs), "a rank ended before the signal"
            time.sleep(0.1)
        run.send_signal(signal.SIGUSR2)
        codes = [p.wait(timeout=60) for p in run.procs]
    finally:
        run.kill(grace=1)
    assert codes == [75, 75]
    ev = _events(tmp_path / "logs")
    for rank in (0, 1):
        pre = [e for e in ev[rank] if e["event"] == "preempt"]
        assert len(pre) == 1 and pre[0]["signal"] == "SIGUSR2" and pre[0]["reason"] == "preemption"
        assert ev[rank][-1]["event"] == "end" and ev[rank][-1]["status"] == "preempted"
    stop_step = pre[0]["step"]
    ckpts = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert ckpts[-1] == f"ckpt-{stop_step:09d}.pt"

    # the same command again (shorter run): resumes from that checkpoint and completes
    res = run_local(argv[:-3] + ["train.epochs=3", "train.batch_size=16"], nodes=1,
                    procs_per_node=2, log_dir=tmp_path / "out2", env=_env())
    assert res.ok
    text = "".join(p.read_text() for p in (tmp_path / "logs").rglob("rank0.log"))
    assert f"resumed from {tmp_path}/ckpt/ckpt-{stop_step:09d}.pt at step {stop_step}" in text


def test_run_usage_says_config_is_required_and_overrides_optional():
    run = [sys.executable, "-m", "ddp_hpc.run"]
    p = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "usage: python -m ddp_hpc.run [-h] CONFIG [key=value ...]" in p.stderr
    assert p.stderr.rstrip().endswith("error: the following arguments are required: CONFIG")
    p = subprocess.run([*run, DEMO, "train.nonsense=1"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.startswith("python -m ddp_hpc.run: error: bad configuration: unknown config key "
                               "'train.nonsense'")


def test_a_missing_eval_folder_names_the_key_that_pointed_at_it(tmp_path):
    """jobs/images.yaml with train images but no eval folder: exit 2 before any rank starts,
    naming data.eval_kwargs (not data.kwargs) and the folder, with a HINT."""
    from ddp_hpc.examples.images import make_images

    # what `ddp-hpc data make-images data/images/train --count 20` writes, without a process of its own
    make_images(tmp_path / "data" / "images" / "train", count=20, progress=False)
    p = subprocess.run([sys.executable, "-m", "ddp_hpc.run", str(REPO / "jobs" / "images.yaml"),
                        f"log.dir={tmp_path}/logs"], cwd=tmp_path, env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    first = p.stderr.strip().splitlines()[-2]
    assert "data.eval_kwargs={'root': 'data/images/eval'} for data.eval_dataset=" in first, p.stderr
    assert f"{tmp_path}/data/images/eval" in first and p.stderr.strip().splitlines()[-1].startswith("HINT: ")
    assert "Traceback" not in p.stderr


@pytest.fixture(scope="module")
def completed(tmp_path_factory):
    """One completed 2-step run of `ddp_hpc.run`'s main() in a process of its own, which then gets a
    preemption notice; its argv (`python -m ddp_hpc.run ...`, the same run) and that process. The two
    tests below only read it (the rerun starts a process of its own)."""
    tmp = tmp_path_factory.mktemp("completed")
    argv = _argv(tmp, "train.max_steps=2", "train.epochs=1")
    code = ("import os, signal, sys\nfrom ddp_hpc.run import main\n"
            f"rc = main({argv[3:]!r})\n"
            "os.kill(os.getpid(), signal.SIGUSR2)\nprint('alive after the notice, exit', rc)\n")
    p = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=300)
    return tmp, argv, p


def test_rerunning_a_completed_run_says_it_is_complete_and_trains_nothing(completed):
    tmp_path, argv, first = completed
    assert first.returncode == 0, first.stderr[-2000:]
    [events] = list((tmp_path / "logs").rglob("node0.events.jsonl"))
    before = events.read_text()
    again = subprocess.run(argv, capture_output=True, text=True, env=_env(), timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "already complete (step 2; logs in " in again.stderr, again.stderr
    assert str(events.parent) in again.stderr and "log.dir=" in again.stderr
    assert "resumed from" not in again.stderr and events.read_text() == before   # nothing trained


def test_a_preemption_notice_after_the_run_completed_does_not_kill_the_rank(completed):
    """The loop gives its USR2 handler back when it ends; a notice after that (the rank's teardown:
    seen on the test cluster as `scancel --signal=USR2` reached a loaded run that had just
    finished) killed the rank by the signal's default action, and srun called the job failed."""
    p = completed[2]
    assert p.returncode == 0 and "alive after the notice, exit 0" in p.stdout, (p.returncode, p.stderr[-2000:])
