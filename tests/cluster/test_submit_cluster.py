"""ddp_hpc.submit, slurm/train.sbatch and slurm/train_torchrun.sbatch on the real test cluster
(4 nodes, 4 fake GPUs each): jobs complete with logs in place, sweeps are one array, preemption
under torchrun checkpoints and requeues, hostile strings stay strings, bad requests fail before
anything is submitted. Jobs are the demo with a few steps (CPU is scarce), 2 nodes x 2 tasks where
the layout of two ranks a node is what a test checks (each path once), else 2 nodes x 1 task: each
rank process costs ~2 s of CPU to import torch."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from ddp_hpc import records
from ddp_hpc.judge.nodefiles import log_events, rank_events
from ddp_hpc.runlogs.schema import CONFIG_FILE

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "jobs" / "demo.yaml")
PY = sys.executable
SHORT = ["train.max_steps=3", "train.epochs=1", "data.kwargs.size=512", "data.eval_split=0.0",
         "checkpoint.every_epochs=0"]


@pytest.fixture
def where(slurm_cluster, tmp_path_factory):
    """A fresh working directory on the shared filesystem and a private DDP_HPC_HOME."""
    d = slurm_cluster.shared_dir / f"submit-{time.monotonic_ns()}"
    d.mkdir()
    env = {**slurm_cluster.env, "DDP_HPC_HOME": str(d / "home")}
    return d, env


def _submit(c, where, *args, extra_env=None, timeout=300):
    d, env = where
    return c.run([PY, "-m", "ddp_hpc.submit", *args], cwd=str(d), env={**env, **(extra_env or {})},
                 timeout=timeout)


def _records(where):
    return records.list_records({"DDP_HPC_HOME": str(where[0] / "home")})


def _events(log_dir: Path, rank: int) -> list[dict]:
    return rank_events(log_dir, rank).events


def _assert_2x2_completed(log_dir: Path, job_id: str | None = None, outs: bool = True, per_node: int = 2):
    """Every rank of a 2-node job (``per_node`` ranks a node) completed, rank-ordered by node."""
    starts = []
    for r in range(2 * per_node):
        ev = _events(log_dir, r)
        assert ev and ev[-1]["event"] == "end" and ev[-1]["status"] == "completed", (r, ev[-1:])
        starts.append(next(e for e in ev if e["event"] == "start"))
        assert not outs or (log_dir / f"rank{r}.out").exists()
    assert {s["world_size"] for s in starts} == {2 * per_node} and {s["num_nodes"] for s in starts} == {2}
    hosts = [s["host"] for s in sorted(starts, key=lambda s: s["rank"])]
    assert hosts == [hosts[0]] * per_node + [hosts[-1]] * per_node and hosts[0] != hosts[-1], hosts
    if job_id is not None:
        assert {s["job_id"] for s in starts} == {job_id}
    return starts


def _config_in_checkpoint(log_dir: Path) -> dict:
    import torch
    ckpts = sorted((Path(log_dir) / "checkpoints").glob("*.pt"))
    assert ckpts, f"no checkpoint in {log_dir}"
    return torch.load(ckpts[-1], weights_only=True)["config"]


def test_auto_submitit_2x1_completes_with_logs_and_record(slurm_cluster, where):
    """2 nodes x 1 task: the submitit backend's layout of 2 x 2 is checked by
    test_scripts_cluster.py's unmodified script (local and group ranks)."""
    c = slurm_cluster
    marker = where[0] / "pwned-submitit"
    p = _submit(c, where, "--nodes", "2", "--gpus", "1", "--time", "00:15:00", DEMO, "--wait",
                "--wait-timeout", "240", "--", *SHORT, "checkpoint.every_epochs=1",
                f"name=$(touch {marker})")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "backend submitit: `sbatch` is on PATH and the controller answers" in p.stderr
    (rec,) = _records(where)
    assert rec.backend == "submitit" and rec.cluster == c.cluster_name and rec.id == p.stdout.split()[-1]
    log_dir = Path(rec.log_dir)
    assert log_dir.parent == where[0] / "runs"
    _assert_2x2_completed(log_dir, rec.id, per_node=1)
    assert not marker.exists()
    assert _config_in_checkpoint(log_dir)["name"] == f"$(touch {marker})"
    # submitit's own files (pickles, its script and logs) stay in a subfolder
    assert not list(log_dir.glob("*.pkl")) and list((log_dir / "submitit").glob("*.pkl"))
    assert rec.script == str(log_dir / "submitit" / f"{rec.id}_submission.sh")
    assert "nodes: 2" in (log_dir / CONFIG_FILE).read_text()   # the resolved config, slurm: included
    # from any directory: the record names the log dir
    assert records.load_record(rec.id, cluster=c.cluster_name,
                                 environ={"DDP_HPC_HOME": str(where[0] / "home")}).log_dir == str(log_dir)


def test_sbatch_backend_2x2_with_enclosing_job_vars_and_hostile_override(slurm_cluster, where):
    """Only test of the sbatch backend's 2 x 2 layout, submitted from inside another job's
    variables (they must not leak) with a hostile override."""
    c = slurm_cluster
    marker = where[0] / "pwned-sbatch"
    fake_enclosing = {"SLURM_JOB_ID": "999999", "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1",
                      "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "n4", "SLURM_CPUS_PER_TASK": "3",
                      "SRUN_CPUS_PER_TASK": "3", "SLURM_MEM_PER_NODE": "1"}
    p = _submit(c, where, "--backend", "sbatch", "--nodes", "2", "--gpus", "2", "--time", "10",
                DEMO, "--wait", "--wait-timeout", "240", "--", *SHORT, "checkpoint.every_epochs=1",
                f"name=$(touch {marker})", extra_env=fake_enclosing)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "removed 8 SLURM_* variables of an enclosing job" in p.stderr
    (rec,) = _records(where)
    log_dir = Path(rec.log_dir)
    assert rec.backend == "sbatch" and rec.script == str(log_dir / "job.sbatch")
    assert c.wait(rec.id) == "COMPLETED"
    _assert_2x2_completed(log_dir, rec.id)
    assert f"ddp_hpc: job {rec.id} restart 0" in (log_dir / f"slurm-{rec.id}.out").read_text()
    assert not marker.exists()
    assert _config_in_checkpoint(log_dir)["name"] == f"$(touch {marker})"


def test_train_sbatch_as_is_with_variables_and_arguments(slurm_cluster, where):
    """Only test of slurm/train.sbatch submitted by plain sbatch: overrides by variables and by
    arguments, and the job record the script writes."""
    c = slurm_cluster
    d, env = where
    script = str(ROOT / "slurm" / "train.sbatch")
    # overrides through variables, and sbatch's own flags over the script's layout (2 x 1) ...
    p = c.run(["sbatch", "--parsable", "--time=10", "--ntasks-per-node=1", "--gpus-per-node=1", script], cwd=str(d),
              env={**env, "CONFIG": DEMO,
                   "OVERRIDES": " ".join([*SHORT, "data.kwargs.size=4096", "train.max_steps=2"])})
    assert p.returncode == 0, p.stderr
    by_vars = p.stdout.strip().split(";")[0]
    # ... and as arguments after the script (which win), in the script's own layout (2 x 2)
    p = c.run(["sbatch", "--parsable", "--time=10", "--job-name=args", script, DEMO, *SHORT,
               "data.kwargs.size=4096", "train.max_steps=4"], cwd=str(d), env=env)
    assert p.returncode == 0, p.stderr
    by_args = p.stdout.strip().split(";")[0]
    for job_id, name, steps, per_node in ((by_vars, "ddp_hpc", 2, 1), (by_args, "args", 4, 2)):
        assert c.wait(job_id, timeout=240) == "COMPLETED", (d / f"slurm-{name}-{job_id}.out").read_text()
        starts = _assert_2x2_completed(d / "runs" / f"{name}-{job_id}", job_id, per_node=per_node)
        assert {s["total_steps"] for s in starts} == {steps}
        # the script recorded the job, so status finds it and its logs from any directory
        rec = records.load_record(job_id, environ=env)
        assert (rec.name, rec.backend, rec.nodes, rec.gpus_per_node) == (name, "sbatch-script", 2, per_node)
        assert rec.log_dir == str(d / "runs" / f"{name}-{job_id}") and rec.config == DEMO


def test_sweep_is_one_array_of_four_tasks_with_their_overrides(slurm_cluster, where):
    c = slurm_cluster
    p = _submit(c, where, "--nodes", "1", "--gpus", "1", "--time", "10", DEMO,
                "--sweep", "train.max_steps=2,3", "--sweep", "train.seed=0,1",
                "--", *SHORT[1:], "checkpoint.every_epochs=1")
    assert p.returncode == 0, p.stdout + p.stderr
    (rec,) = _records(where)
    job_id = rec.id
    from ddp_hpc.slurm.cli import SlurmCLI
    rows = SlurmCLI(env=c.env).squeue([job_id])
    assert sorted(r["JobArrayID"] for r in rows) == [f"{job_id}_{i}" for i in range(4)] or \
        {r["ArrayJobID"] for r in rows} == {job_id}
    for i in range(4):
        assert c.wait(f"{job_id}_{i}", timeout=300) == "COMPLETED"
    expect = [(2, 0), (2, 1), (3, 0), (3, 1)]
    assert [a["overrides"] for a in rec.array] == [[f"train.max_steps={s}", f"train.seed={e}"] for s, e in expect]
    for task, (steps, seed) in zip(rec.array, expect):
        d = Path(task["log_dir"])
        assert d == Path(rec.log_dir) / f"task{task['task_id']}"
        ev = _events(d, 0)
        start = next(e for e in ev if e["event"] == "start")
        assert start["total_steps"] == steps and start["job_id"] == f"{job_id}_{task['task_id']}"
        assert ev[-1]["status"] == "completed"
        assert _config_in_checkpoint(d)["train"]["seed"] == seed
        assert (d / "rank0.out").exists()


def test_torchrun_variant_completes_and_usr2_checkpoints_and_requeues(slurm_cluster, where):
    """Only test of slurm/train_torchrun.sbatch: torchrun forwarding USR2, a requeue, a resume.
    One GPU a node (sbatch's flag over the script's 2): one rank under each node's torchrun."""
    c = slurm_cluster
    d, env = where
    script = str(ROOT / "slurm" / "train_torchrun.sbatch")
    # The demo's samples, each fetch sleeping until the test saw the preemption (the file `go`):
    # without it the 256 steps took about a second, and the signal once came as the run ended
    go = d / "go"
    long_run = ["train.epochs=1", "train.max_steps=256", "data.kwargs.size=65536",
                "data.eval_split=0.0", "log.every_n_steps=1", "checkpoint.every_epochs=0",
                "data.dataset=tests.cluster.status_helpers:slow_synthetic", "data.kwargs.delay=0.002",
                f"data.kwargs.until={go}"]
    p = c.run(["sbatch", "--parsable", "--time=15", "--gpus-per-node=1", script, DEMO, *long_run],
              cwd=str(d), env={**env, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    job_id = p.stdout.strip().split(";")[0]
    log_dir = d / "runs" / f"ddp_hpc_torchrun-{job_id}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:        # wait until training is under way
        if any(e["event"] == "step" and e["step"] >= 5 for e in _events(log_dir, 0)):
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"no step events in {log_dir}: {(d / f'slurm-ddp_hpc_torchrun-{job_id}.out').read_text()}")
    s = c.run(["scancel", "--signal=USR2", job_id], timeout=30)
    assert s.returncode == 0, s.stderr
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not any(e["event"] == "preempt" for e in _events(log_dir, 0)):
        time.sleep(0.5)
    go.touch()                                # preempted (or not, and the assertions say so): run on
    state = c.wait(job_id, timeout=400)
    ev = _events(log_dir, 0)
    assert state == "COMPLETED", (
        [(e["event"], e["restart"], e.get("step")) for e in ev if e["event"] != "step"],
        [ln for ln in (log_dir / "node0.out").read_text().splitlines() if "step" not in ln][-60:])
    kinds = [(e["event"], e["restart"]) for e in ev]
    said = ([(e["event"], e["restart"], e.get("step")) for e in ev if e["event"] != "step"],
            [ln for ln in (log_dir / "node0.out").read_text().splitlines() if "step" not in ln][-60:],
            (d / f"slurm-ddp_hpc_torchrun-{job_id}.out").read_text()[-3000:])
    assert ("preempt", 0) in kinds and ("checkpoint", 0) in kinds and ("requeue", 0) in kinds, said
    assert ("start", 1) in kinds and ev[-1]["event"] == "end" and ev[-1]["status"] == "completed", said
    preempt = next(e for e in ev if e["event"] == "preempt")
    assert preempt["reason"] == "preemption" and preempt["signal"] in ("USR2", "SIGUSR2")
    second = [e for e in ev if e["restart"] == 1 and e["event"] == "step"]
    assert second and second[0]["step"] > preempt["step"] - 1      # resumed, not restarted at 0
    assert 2 not in log_events(log_dir)       # one rank a node
    for r in range(2):
        assert _events(log_dir, r)[-1]["status"] == "completed"
    assert "forwards SIGUSR2" in (log_dir / "node0.out").read_text()


# Compares the whole queue before and after: under xdist no other test may submit meanwhile.
@pytest.mark.cluster_exclusive
@pytest.mark.xdist_group("exclusive")
def test_bad_requests_fail_before_submitting(slurm_cluster, where):
    c = slurm_cluster
    from ddp_hpc.slurm.cli import SlurmCLI
    # finished jobs of earlier tests may leave squeue meanwhile (MinJobAge): compare ids, not counts
    before = {j["JobID"] for j in SlurmCLI(env=c.env).squeue()}
    marker = Path("/tmp/pwned")
    existed = marker.exists()
    for args, needle in [
        (["--nodes", "0", DEMO], "--nodes 0 is too few: at least 1 is needed"),
        (["--gpus", str(c.gpus_per_node + 1), DEMO], f"at most {c.gpus_per_node}"),
        (["--partition", "nosuchpart", DEMO], "'nosuchpart' does not exist"),
        (["--nodes", "2", DEMO, "--", "train.epoch=1"], "unknown config key 'train.epoch'"),
        (["--job-name", "x'; touch /tmp/pwned #", DEMO], "--job-name \"x'; touch /tmp/pwned #\""),
        (["--backend", "sbatch", "-J", "x'; touch /tmp/pwned #", DEMO], "--job-name \"x'; touch"),
        ([DEMO, "train.epoch=1"], "unknown config key 'train.epoch'"),   # override without --
    ]:
        p = _submit(c, where, *args)
        assert p.returncode == 2, (args, p.stdout, p.stderr)
        assert needle in p.stderr and "\nHINT: " in p.stderr, (args, p.stderr)
    assert {j["JobID"] for j in SlurmCLI(env=c.env).squeue()} <= before  # nothing was queued
    assert _records(where) == []
    assert marker.exists() == existed


def test_launchers_srun_and_submitit_example(slurm_cluster, where):
    """launchers/srun.sh in 2 x 2 (its local ranks); launchers/submitit_example.py in 2 x 1."""
    c = slurm_cluster
    d, env = where
    # launchers/srun.sh inside an allocation of 2 nodes x 2 tasks
    job = c.sbatch(f"#!/bin/bash\nexec {ROOT / 'launchers' / 'srun.sh'} {DEMO} {' '.join(SHORT)}\n",
                   "-N2", "--ntasks-per-node=2", "--gpus-per-node=2", "--time=10", cwd=d)
    # launchers/submitit_example.py: submitit's own executor + ddp_hpc.env, waits for the results
    p = c.run([PY, str(ROOT / "launchers" / "submitit_example.py"), "--nodes", "2", "--gpus", "1",
               "--time", "10", "--config", DEMO, "--folder", str(d / "ex"), *SHORT],
              cwd=str(d), env=env, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "results:" in p.stdout and "'rank': 1" in p.stdout and "'rank': 2" not in p.stdout
    _assert_2x2_completed(d / "ex" / "logs", outs=False, per_node=1)   # submitit keeps its own *_log.out
    assert c.wait(job, timeout=240) == "COMPLETED", c.output(job, cwd=d)
    _assert_2x2_completed(d / "runs" / f"srun-{job}", job)
