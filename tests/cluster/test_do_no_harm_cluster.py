"""Do no harm, on the real test cluster (issue 38): ordinary workloads that every automatic action
must leave alone complete untouched under the defaults: no restart, no exclusion, nothing deleted,
and status says nothing alarming.

- a plain script whose ranks work 8 s before their first step, whose rank 0 then saves for 10 s
  and later evaluates for 10 s while the other waits in ``dist.barrier()``: both twice the
  hang limit (``--hang-timeout 5`` here, so the test is short: the rule does not depend on the
  floor), so the supervisor asks the ranks' stacks, sees rank 0 working outside a collective and
  stands back; status says so in one line;
- 4 DataLoader workers per rank (8 busy processes) on 2 cores (saturated CPUs) and then a killed
  rank: healed, and
  blamed on the killed rank;
- a state whose memory snapshots do not fit the job's memory (``--mem``): the snapshots step back
  with one status line, the file checkpoints go on, the job completes;
- a job requeued by ``scontrol requeue`` (and held, so it stays requeued while the test looks):
  its memory snapshots survive the sweep that another job's snapshots start on the same nodes,
  while an ended job's are freed.

Every job is 2 nodes x 1 task: each rank process costs ~2 s of CPU to import torch, and none of
these rules looks at two ranks on one node (the snapshots' fit is per node, whatever its ranks).

Elsewhere: nodes whose scratch is a 1 MB tmpfs (test_health_cluster.py), a frozen rank and a
still one still caught (test_hang_cluster.py, test_restart_cluster.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from ddp_hpc.data.stagedir import private_root
from ddp_hpc.judge.nodefiles import rank_events
from ddp_hpc.judge.restarts import read_health, read_holds, read_restarts, read_stops
from ddp_hpc.train.memsnap import user_prefix
from ddp_hpc.train.memsweep import JOB_FILE, job_file_text

from .script_helpers import wait_for
from .test_restart_cluster import FAST, _stepping

pytestmark = [pytest.mark.cluster]

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
#: words status must not say about a job that did nothing wrong
ALARMS = ("First failure", "stalled", "Restarts inside the allocation", "excluded", "hung")


def _submit(c, d: Path, *args: str, **more_env: str) -> tuple[str, dict]:
    env = dict(c.env, DDP_HPC_HOME=str(d / "home"), PYTHONPATH=str(REPO), **more_env)
    p = c.run([PY, "-m", "ddp_hpc.submit", "--backend", "sbatch", "-t", "10", *args], cwd=str(d), env=env)
    assert p.returncode == 0, p.stderr
    return p.stdout.split()[-1], env


def test_a_scripts_slow_first_step_rank0_save_and_eval_behind_a_barrier_complete_untouched(slurm_cluster):
    """Only test that the hang limit, on real ranks, asks the stacks of long work outside a
    collective and stands back."""
    c = slurm_cluster
    d = c.shared_dir / f"harmless-{time.monotonic_ns()}"
    d.mkdir()
    job, env = _submit(c, d, "-G", "1", "-N", "2", "--hang-timeout", "5", "-J", "harmless",
                       str(REPO / "tests" / "cluster" / "ordinary_train.py"),
                       FIRST_S="8", SAVE_AT="30", SAVE_S="10", EVAL_AT="45", EVAL_S="10", STEPS="60",
                       CKPT_DIR=str(d))
    log_dir = wait_for("the log directory", lambda: next((d / "runs").glob("harmless-*"), None), 60)
    state = c.wait(job, timeout=300)
    status = c.run([PY, "-m", "ddp_hpc.status", job], cwd="/", env=env, timeout=120).stdout
    holds = read_holds(log_dir)
    print(f"{json.dumps(holds, indent=1)}\n{status}")
    assert state == "COMPLETED", status
    assert read_restarts(log_dir) == [] and read_stops(log_dir) == [] and read_health(log_dir) == []
    asked = [e for e in rank_events(log_dir, 0).events
             if e.get("event") == "stack" and e.get("reason") == "on request"]
    assert asked, "the hang limit never asked the stacks: the test did not reach the rule"
    assert holds and all(h["ranks"] == [0] for h in holds), holds
    assert not [w for w in ALARMS if w in status], status
    assert "Hang limit stood back" in status and "rank(s) 0 worked outside a collective" in status, status


def test_saturated_cpus_then_a_killed_rank_is_healed_and_blamed_on_it(slurm_cluster):
    """Only test of a killed rank blamed right while DataLoader workers saturate the CPUs (srun's
    stop ends the workers too, and they must not be blamed)."""
    c = slurm_cluster
    d = c.shared_dir / f"saturated-{time.monotonic_ns()}"
    d.mkdir()
    # 128 steps whose batches sleep until the kill is done (a loaded machine once ran all of 32
    # steps between the test's look at step 4 and its kill), then run at full speed
    go = d / "go"
    job, env = _submit(c, d, "-G", "1", "-N", "2", "-c", "1", "-J", "saturated", str(REPO / "jobs" / "demo.yaml"), "--",
                       f"log.dir={d / 'runs'}", *FAST, "data.num_workers=4", "data.kwargs.size=16384",
                       f"data.kwargs.until={go}")
    log_dir = wait_for("the log directory", lambda: next((d / "runs").glob("saturated-*"), None), 60)
    starts0 = wait_for("steps of the first run", lambda: _stepping(log_dir, 0, 2, 4), 240)
    os.kill(int(starts0[1]["pid"]), signal.SIGKILL)
    go.touch()
    state = c.wait(job, timeout=400)
    status = c.run([PY, "-m", "ddp_hpc.status", job], cwd="/", env=env, timeout=120).stdout
    rows = read_restarts(log_dir)
    print(f"{json.dumps(rows, indent=1)}\n{status}")
    assert state == "COMPLETED", status
    [row] = rows
    assert (row["rank"], row["kind"], row["excluded"]) == (1, "killed", []), row
    assert read_holds(log_dir) == [] and read_health(log_dir) == [], status
    assert "Restarts inside the allocation: 1" in status, status
    # the run history names rank 1 too, not a rank whose DataLoader workers srun's stop ended
    [run0] = [ln for ln in status.splitlines() if ln.strip().startswith("restart 0: ranks")]
    assert "first failure: rank 1 on " in run0 and "killed by signal 9" in run0, run0


def test_memory_snapshots_that_do_not_fit_the_jobs_memory_step_back_with_one_line(slurm_cluster):
    """Only test of the snapshots' fit against a real ``--mem``."""
    sys.path.insert(0, str(REPO / "bench"))
    from bigstate import overrides

    c = slurm_cluster
    d = c.shared_dir / f"bigstate-{time.monotonic_ns()}"
    d.mkdir()
    # about 60 MB of state: 3 x 60 MB and the margin do not fit 400 MB
    job, env = _submit(c, d, "-G", "1", "-N", "2", "--mem", "400M", "-J", "bigstate",
                       str(REPO / "jobs" / "demo.yaml"), "--", f"log.dir={d / 'runs'}", *overrides(60),
                       "train.max_steps=6", "log.every_n_steps=1", "checkpoint.memory_every_steps=1",
                       "data.kwargs.size=2048")
    log_dir = wait_for("the log directory", lambda: next((d / "runs").glob("bigstate-*"), None), 60)
    state = c.wait(job, timeout=300)
    status = c.run([PY, "-m", "ddp_hpc.status", job], cwd="/", env=env, timeout=120).stdout
    print(status)
    assert state == "COMPLETED", status
    assert read_restarts(log_dir) == [], status
    # what the snapshot writers said about their own snapshots (the sweep of an ended job's
    # folders, status "swept", is another matter: it says so whenever an earlier test left some)
    off = [e for r in range(2) for e in rank_events(log_dir, r).events
           if e.get("event") == "memsnap" and e.get("status") != "swept"]
    assert off and all(e["status"] == "off" for e in off), off
    notes = [ln for ln in status.splitlines() if "memory snapshots off" in ln]
    assert len(notes) == 1 and "does not fit the job's memory" in notes[0] and "--mem" in notes[0], status
    assert list((log_dir.parent.parent / "runs").glob("*/checkpoints/ckpt-*.pt")) or list(
        log_dir.glob("checkpoints/ckpt-*.pt")), "no file checkpoint: the files must go on"


def test_a_requeued_jobs_snapshots_survive_another_jobs_sweep(slurm_cluster):
    c = slurm_cluster
    d = c.shared_dir / f"requeued-{time.monotonic_ns()}"
    d.mkdir()
    held = c.sbatch("#!/bin/bash\nsleep 600\n", "-N1", "-J", "requeued")
    wait_for("the job to run", lambda: c.run(["squeue", "-h", "-j", held, "-o", "%T"]).stdout.strip() == "RUNNING",
             60)
    p = c.run(["scontrol", "requeuehold", held])
    assert p.returncode == 0, p.stderr
    kept, ended = _snapshots_of(held, "rq", c.cluster_name), _snapshots_of("1", "ended", c.cluster_name)
    try:
        job, env = _submit(c, d, "-G", "1", "-N", "2", "-J", "sweeper", str(REPO / "jobs" / "demo.yaml"), "--",
                           f"log.dir={d / 'runs'}", "train.max_steps=6", "checkpoint.memory_every_steps=1",
                           "data.kwargs.size=2048")
        state = c.wait(job, timeout=300)
        shown = c.run(["squeue", "-h", "-j", held, "-o", "%T %r"]).stdout.strip()
        print(f"requeued job {held}: {shown}")
        assert state == "COMPLETED"
        assert not ended.exists(), "the sweep did not run: the test did not reach the rule"
        assert kept.exists(), f"the requeued job's snapshots were freed ({shown})"
    finally:
        c.run(["scancel", held])
        shutil.rmtree(kept, ignore_errors=True)
        shutil.rmtree(ended, ignore_errors=True)


def _snapshots_of(job: str, tag: str, cluster: str) -> Path:
    """A job folder of memory snapshots in /dev/shm as job ``job`` of ``cluster`` leaves it."""
    folder = Path(private_root("/dev/shm")) / f"{user_prefix()}{job}-{tag}"
    (folder / "n1").mkdir(parents=True)
    (folder / "n1" / "ckpt-000000001.pt").write_bytes(b"0" * 1024)
    (folder / JOB_FILE).write_text(job_file_text(job, cluster))
    return folder
