"""The local backend end to end: with no `sbatch` on PATH, `python -m ddp_hpc.submit` runs the
job as N pretend nodes x G real processes (gloo on CPU), leaves per-rank logs and a job record,
and sweeps run task by task in their own log directories."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

from ddp_hpc import records
from ddp_hpc.config import load_config
from ddp_hpc.judge import kept
from ddp_hpc.judge.nodefiles import rank_events
from ddp_hpc.runlogs.schema import CONFIG_FILE

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
SHORT = ["train.max_steps=3", "train.epochs=1", "data.kwargs.size=512", "data.eval_split=0.0",
         "checkpoint.every_epochs=0"]


def _env(tmp_path):
    # PATH holds the venv only: no sbatch, so `auto` must choose local
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=os.path.dirname(PY), DDP_HPC_HOME=str(tmp_path / "home"))
    return env


def _submit(tmp_path, *args, timeout=240):
    return subprocess.run([PY, "-m", "ddp_hpc.submit", *args], cwd=tmp_path, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=timeout)


def _events(log_dir: Path, rank: int) -> list[dict]:
    return rank_events(log_dir, rank).events


def test_main_command_runs_four_local_processes(tmp_path):
    p = _submit(tmp_path, "--nodes", "2", "--gpus", "2", str(ROOT / "jobs/demo.yaml"), "--wait",
                "--", *SHORT, "log.dir=" + str(tmp_path / "runs"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "backend local: no `sbatch` on PATH" in p.stderr
    assert "end: completed" in p.stdout            # rank 0's output followed on the terminal
    assert re.search(r"epoch 0 done: step \d+/\d+", p.stdout)   # ... its progress included
    assert "4 processes (2 pretend nodes x 2)" in p.stderr
    (rec,) = records.list_records({"DDP_HPC_HOME": str(tmp_path / "home")})
    assert rec.backend == "local" and rec.id.startswith("local-") and (rec.nodes, rec.gpus_per_node) == (2, 2)
    log_dir = Path(rec.log_dir)
    assert log_dir.parent == tmp_path / "runs"
    starts = [next(e for e in _events(log_dir, r) if e["event"] == "start") for r in range(4)]
    assert sorted(e["rank"] for e in starts) == [0, 1, 2, 3]
    assert {e["world_size"] for e in starts} == {4} and {e["num_nodes"] for e in starts} == {2}
    assert [e["local_rank"] for e in sorted(starts, key=lambda e: e["rank"])] == [0, 1, 0, 1]
    assert len({e["pid"] for e in starts}) == 4 and {e["job_id"] for e in starts} == {rec.id}
    for r in range(4):
        assert _events(log_dir, r)[-1]["event"] == "end" and _events(log_dir, r)[-1]["status"] == "completed"
        assert (log_dir / f"rank{r}.out").exists()
    resolved = yaml.safe_load((log_dir / CONFIG_FILE).read_text())   # the config it trained with
    assert resolved["train"]["max_steps"] == 3 and resolved["log"]["dir"] == str(tmp_path / "runs")
    assert (resolved["slurm"]["nodes"], resolved["slurm"]["gpus_per_node"]) == (2, 2)
    assert load_config(log_dir / CONFIG_FILE).train.max_steps == 3


def test_background_run_records_driver_and_finishes(tmp_path):
    p = _submit(tmp_path, "--nodes", "1", "--gpus", "2", str(ROOT / "jobs/demo.yaml"),
                "--", *SHORT)
    assert p.returncode == 0, p.stderr
    assert "2 processes (1 pretend node x 2)" in p.stderr
    job_id = p.stdout.strip().splitlines()[-1]
    rec = records.load_record(job_id, environ={"DDP_HPC_HOME": str(tmp_path / "home")})
    assert rec.pids and rec.pids[0] > 0
    from ddp_hpc.backends.wait import run_verdict
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        rec = records.load_record(job_id, environ={"DDP_HPC_HOME": str(tmp_path / "home")})
        if rec.pids == []:          # the driver clears them when the last run ended
            break
        time.sleep(0.5)
    ok, why = run_verdict(rec.log_dir, 2)
    assert ok, why
    # the driver clears its pids, then writes its last line: give it that moment
    out = Path(rec.log_dir) / "local-driver.out"
    while "exit status 0" not in out.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "exit status 0" in out.read_text()


def test_local_sweep_runs_each_task_with_its_overrides(tmp_path):
    """The only real local sweep: each task a 1 x 2 run of its own overrides, in its own log
    directory, with the final state the job table keeps."""
    p = _submit(tmp_path, "--nodes", "1", "--gpus", "2", str(ROOT / "jobs/demo.yaml"), "--wait",
                "--sweep", "train.max_steps=2,3", "--", *SHORT[1:])
    assert p.returncode == 0, p.stdout + p.stderr
    (rec,) = records.list_records({"DDP_HPC_HOME": str(tmp_path / "home")})
    assert [a["overrides"] for a in rec.array] == [["train.max_steps=2"], ["train.max_steps=3"]]
    for task, steps in zip(rec.array, (2, 3)):
        d = Path(task["log_dir"])
        assert d.parent == Path(rec.log_dir) and d.name == f"task{task['task_id']}"
        start = next(e for e in _events(d, 0) if e["event"] == "start")
        assert start["total_steps"] == steps and start["job_id"] == f"{rec.id}_{task['task_id']}"
        assert _events(d, 1)[-1]["status"] == "completed"
        # the driver kept what the job table shows of the task's logs when it ended: the table
        # takes the row from the record (ddp_hpc.judge.kept), the logs unchanged since
        final = records.final_of(rec, task["task_id"])
        assert final["state"] == "COMPLETED" and final["logs"]["progress"]["step"] == steps
        assert kept.kept_logs(final["logs"], d) is not None


def test_a_model_that_cannot_be_imported_fails_before_any_rank_starts(tmp_path):
    p = _submit(tmp_path, "--nodes", "1", "--gpus", "2", str(ROOT / "jobs/demo.yaml"), "--wait",
                "--", *SHORT, "model.name=no_such_pkg.mod:factory")
    assert p.returncode == 2, p.stderr
    assert "cannot import module 'no_such_pkg.mod' (model.name=no_such_pkg.mod:factory)" in p.stderr
    assert "HINT:" in p.stderr and "FAILED: rank" not in p.stderr
    assert not list(tmp_path.glob("**/rank0.out"))  # nothing ran


def test_local_torchrun_launcher(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDP_HPC_"))}
    env.update(NPROC="2", PYTHON=PY, DDP_HPC_LOG_DIR=str(tmp_path / "logs"))
    p = subprocess.run(["bash", str(ROOT / "launchers" / "local_torchrun.sh"),
                        str(ROOT / "jobs/demo.yaml"), *SHORT], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    for r in (0, 1):
        ev = _events(tmp_path / "logs", r)
        assert ev[0]["launcher"] == "torchrun" and ev[0]["world_size"] == 2
        assert ev[-1]["status"] == "completed"
