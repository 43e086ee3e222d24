"""Submitting the same config job again resumes its stopped run: the same run directory and its
checkpoints, one line that says so; a completed run is not resumed (a new run), `--fresh` starts
over, a run still in the queue is not submitted twice."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_hpc import records
from ddp_hpc.backends import get, render
from ddp_hpc.backends.slurmjob import submitit_parameters
from ddp_hpc.backends.spec import SpecError, build_spec
from ddp_hpc.config import config_to_dict, load_config
from ddp_hpc.config.slurm_options import merged
from ddp_hpc.judge.nodefiles import rank_events
from ddp_hpc.runlogs.schema import CONFIG_FILE
from ddp_hpc.slurm.cli import SlurmCLI
from ddp_hpc.submit.resume import next_restart, resume_or_new

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "jobs" / "demo.yaml")


def _env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDP_HPC_"))}
    return {**env, "PYTHONPATH": str(ROOT), "DDP_HPC_HOME": str(tmp_path / "home")}


def _steps(run_dir: Path) -> int:
    return sum(e["event"] == "step" for e in rank_events(run_dir, 0).events)


def test_the_same_local_submit_resumes_its_interrupted_run(tmp_path):
    """The only real local job interrupted (Ctrl-C) and submitted again: one rank, as nothing here
    is about ranks (a resumed 2-rank job: the next test); 8 steps of 0.64 s as with 2 ranks."""
    argv = [sys.executable, "-m", "ddp_hpc.submit", "-N", "1", "-G", "1", "--backend", "local",
            DEMO, "--wait", "--", f"log.dir={tmp_path / 'runs'}", "train.epochs=1",
            "data.kwargs.size=512", "data.eval_split=0.0", "log.progress=lines", "log.every_n_steps=1",
            "checkpoint.every_steps=0", "data.dataset=tests.cluster.status_helpers:slow_synthetic",
            "data.kwargs.delay=0.01"]
    env = _env(tmp_path)
    first = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:          # a few steps, then Ctrl-C (the whole group)
        found = list((tmp_path / "runs").glob("*/node0.events.jsonl"))
        if found and _steps(found[0].parent) >= 3:
            break
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGINT)
    out, _ = first.communicate(timeout=60)
    assert first.returncode != 0 and "end: interrupted at step" in out, out[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    stopped = int(re.search(r"end: interrupted at step (\d+)", out).group(1))

    fresh = subprocess.run([*argv[:-12], "--fresh", "--dry-run", *argv[-12:]], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
    assert fresh.returncode == 0, fresh.stderr
    assert f"starting a new run (--fresh); the earlier run {run_dir.name} stays in {run_dir}" in fresh.stderr
    assert str(run_dir) not in fresh.stdout and "DDP_HPC_LOG_DIR=" in fresh.stdout

    again = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert (f"resuming run {run_dir.name} from its checkpoint at step {stopped}; --fresh starts over"
            in again.stderr), again.stderr
    assert f"resumed from {run_dir}/checkpoints/ckpt-{stopped:09d}.pt" in again.stdout
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [run_dir.name]

    done = subprocess.run([*argv[:-12], "--dry-run", *argv[-12:]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert re.search(rf"the earlier run {run_dir.name} of this config completed \(step \d+, "
                     rf"{re.escape(str(run_dir))}\); starting a new run", done.stderr), done.stderr
    assert str(run_dir) not in done.stdout


def test_a_failed_local_run_resumed_to_completion_reads_completed_with_both_runs(tmp_path):
    """The resumed run's events carry restart 1 after the failed run's 0: status judges the
    newest run (COMPLETED) and lists both. Two ranks: the run's cause is its failing rank's,
    rank 0's, exception."""
    argv = [sys.executable, "-m", "ddp_hpc.submit", "-N", "1", "-G", "2", "--backend", "local",
            DEMO, "--wait", "--", f"log.dir={tmp_path / 'runs'}", "train.epochs=1",
            "data.kwargs.size=1024", "data.eval_split=0.0", "log.progress=lines", "log.every_n_steps=1",
            "checkpoint.every_steps=2", "data.dataset=tests.resume_helpers:fail_once",
            f"data.kwargs.marker={tmp_path / 'failed-once'}"]
    env = _env(tmp_path)
    first = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode != 0 and "FailedOnce" in first.stdout + first.stderr, first.stderr[-2000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    w = argv.index("--wait")
    dry = subprocess.run([*argv[:w], "--dry-run", *argv[w:]], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert f"DDP_HPC_RESTART_BASE=1 DDP_HPC_LOG_DIR={run_dir} " in dry.stdout, dry.stdout + dry.stderr
    again = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert f"resuming run {run_dir.name} from its checkpoint" in again.stderr
    job_id = f"local-{run_dir.name}"
    st = subprocess.run([sys.executable, "-m", "ddp_hpc.status", "--json", job_id], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=120)
    assert st.returncode == 0, st.stderr
    job = json.loads(st.stdout)
    assert job["state"] == "COMPLETED" and job["restarts"] == 1, job
    assert [(r["restart"], r["end_status"]) for r in job["runs"]] == [(0, "failed"), (1, "completed")]
    assert "FailedOnce" in job["runs"][0]["cause"]


class _Queue:
    """squeue's answer for the earlier job, on cluster ``cluster`` (the records' "c")."""

    def __init__(self, state: str | None, cluster: str = "c"):
        self.state, self.cluster = state, cluster

    def squeue(self, job_ids):
        return [{"JobID": str(job_ids[0]), "State": self.state}] if self.state else []

    def cluster_name(self):
        return self.cluster


def _earlier(tmp_path, backend: str, *, status: str | None, ckpt: bool, final: bool = True):
    """A Slurm submission of the demo that stopped: its record, config copy and rank 0's events."""
    cfg = load_config(DEMO, [f"log.dir={tmp_path / 'runs'}"])
    spec = build_spec(merged(cfg.slurm, {"backend": backend}), config_path=DEMO, cfg=cfg,
                      overrides=[f"log.dir={tmp_path / 'runs'}"], workdir=str(tmp_path))
    run_dir = Path(spec.log_dir)
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / CONFIG_FILE).write_text(json.dumps(config_to_dict(cfg)))   # JSON is YAML
    path = run_dir / "checkpoints" / "ckpt-000000040.pt"
    if ckpt:
        path.write_bytes(b"x")
    events = [{"event": "start"}, {"event": "step", "step": 40},
              {"event": "checkpoint", "step": 40, "path": str(path)}]
    events += [{"event": "end", "status": status, "step": 40}] if status else []
    (run_dir / "rank0.events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    rec = records.JobRecord(id="4242", cluster="c", name=spec.name, backend=backend, nodes=1,
                            gpus_per_node=1, time_limit="01:00:00", log_dir=spec.log_dir,
                            config=spec.config, overrides=list(spec.overrides), submitted_at=time.time(),
                            cwd=str(tmp_path), final={"state": "CANCELLED"} if final else None)
    records.write_record(rec)
    new = build_spec(merged(cfg.slurm, {"backend": backend}), config_path=DEMO, cfg=cfg,
                     overrides=[f"log.dir={tmp_path / 'runs'}"], workdir=str(tmp_path))
    return new, cfg, run_dir


@pytest.mark.parametrize("backend", ["sbatch", "submitit"])
def test_a_slurm_submission_resumes_into_the_run_dir_its_record_names(tmp_path, monkeypatch, backend):
    monkeypatch.setenv("DDP_HPC_HOME", str(tmp_path / "home"))
    new, cfg, run_dir = _earlier(tmp_path, backend, status=None, ckpt=True)   # killed: no end event
    said: list[str] = []
    spec = resume_or_new(new, get(backend, client=_Queue(None)), [cfg], fresh=False, say=said.append)
    assert spec.log_dir == str(run_dir) and spec.tasks[0].log_dir == str(run_dir)
    assert said == [f"resuming run {run_dir.name} from its checkpoint at step 40; --fresh starts over"]
    assert spec.restart_base == 1 and new.restart_base == 0     # restarts after the earlier run's 0
    if backend == "sbatch":
        assert f"LOG_DIR={run_dir}\n" in render.render(spec)
        assert "\nexport DDP_HPC_RESTART_BASE=1\n" in render.render(spec)
        assert "DDP_HPC_RESTART_BASE" not in render.render(new)
    else:
        assert "export DDP_HPC_RESTART_BASE=1" in submitit_parameters(spec)["setup"]
        assert not any("RESTART_BASE" in line for line in submitit_parameters(new)["setup"])
    other = resume_or_new(new, get("sbatch" if backend == "submitit" else "submitit", client=_Queue(None)), [cfg],
                          fresh=False,
                          say=said.append)
    assert other.log_dir == new.log_dir != str(run_dir)          # another backend: another run
    changed = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, epochs=9))
    assert resume_or_new(new, get(backend, client=_Queue(None)), [changed], fresh=False,
                         say=said.append).log_dir == new.log_dir
    assert said[-1] == f"the config file changed since the earlier run {run_dir.name}; starting a new run"


def test_restart_numbers_of_a_resumed_run_start_after_the_highest_in_every_task_dir(tmp_path):
    for name, restarts in (("task0", [0, 1]), ("task1", [0, 1, 2]), ("task2", [])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "rank0.events.jsonl").write_text(
            "".join(json.dumps({"event": "start", "restart": r}) + "\n" for r in restarts))
    assert next_restart([str(tmp_path / "task0"), str(tmp_path / "task1")]) == 3
    assert next_restart([str(tmp_path / "task2"), str(tmp_path / "none")]) == 0
    with pytest.raises(SpecError):
        dataclasses.replace(build_spec(merged(load_config(DEMO).slurm, {"backend": "sbatch"}),
                                       config_path=DEMO, cfg=load_config(DEMO), overrides=[]),
                            restart_base=-1)


def test_a_completed_or_checkpointless_or_queued_earlier_run_is_not_resumed(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_HPC_HOME", str(tmp_path / "home"))
    new, cfg, run_dir = _earlier(tmp_path, "sbatch", status="completed", ckpt=True)
    said: list[str] = []
    assert resume_or_new(new, get("sbatch", client=_Queue(None)), [cfg], fresh=False,
                         say=said.append).log_dir == new.log_dir
    assert said == [f"the earlier run {run_dir.name} of this config completed (step 40, {run_dir}); "
                    f"starting a new run"]
    (run_dir / "checkpoints" / "ckpt-000000040.pt").unlink()
    (run_dir / "rank0.events.jsonl").write_text('{"event": "start"}\n{"event": "end", "status": "failed"}\n')
    assert resume_or_new(new, get("sbatch", client=_Queue(None)), [cfg], fresh=False,
                         say=said.append).log_dir == new.log_dir
    assert said[-1] == f"the earlier run {run_dir.name} stopped before its first checkpoint; starting a new run"


def test_an_earlier_run_still_in_the_queue_is_not_submitted_twice(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_HPC_HOME", str(tmp_path / "home"))
    new, cfg, _ = _earlier(tmp_path, "sbatch", status="preempted", ckpt=True, final=False)
    with pytest.raises(SpecError) as exc:
        resume_or_new(new, get("sbatch", client=_Queue("PENDING")), [cfg], fresh=False, say=print)
    assert "job 4242" in exc.value.problem and "still queued or running" in exc.value.problem
    assert "--fresh" in exc.value.hint
    spec = resume_or_new(new, get("sbatch", client=_Queue("PENDING")), [cfg], fresh=True, say=print)
    assert spec.log_dir == new.log_dir


def test_a_stale_kept_final_state_does_not_hide_a_job_squeue_still_runs(tmp_path, monkeypatch):
    """The record keeps CANCELLED (say status kept a PREEMPTED before a requeue), but squeue lists
    the job running again: refused, not resumed into its run directory."""
    monkeypatch.setenv("DDP_HPC_HOME", str(tmp_path / "home"))
    new, cfg, _ = _earlier(tmp_path, "sbatch", status="preempted", ckpt=True, final=True)
    with pytest.raises(SpecError) as exc:
        resume_or_new(new, get("sbatch", client=_Queue("RUNNING")), [cfg], fresh=False, say=print)
    assert "job 4242" in exc.value.problem and "still queued or running" in exc.value.problem


def test_an_unanswered_squeue_refuses_to_resume_with_a_hint(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_HPC_HOME", str(tmp_path / "home"))
    new, cfg, run_dir = _earlier(tmp_path, "sbatch", status="preempted", ckpt=True, final=False)
    no_slurm = SlurmCLI(env={"PATH": str(tmp_path / "nowhere")})   # squeue cannot start
    with pytest.raises(SpecError) as exc:
        resume_or_new(new, get("sbatch", client=no_slurm), [cfg], fresh=False, say=print)
    assert exc.value.problem == (f"cannot tell whether the earlier run of this config, job 4242 "
                                 f"({run_dir}), still runs (squeue did not answer), so it is not resumed")
    assert "--fresh" in exc.value.hint and "ddp-hpc cancel 4242" in exc.value.hint
    assert resume_or_new(new, get("sbatch", client=no_slurm), [cfg], fresh=True, say=print).log_dir == new.log_dir


def test_a_slurm_job_submitted_on_another_cluster_is_not_resumed_into(tmp_path, monkeypatch):
    """Job ids repeat across clusters: this cluster's squeue, which does not list job 4242 (or
    lists another job of that id), cannot tell whether the run on cluster "c" still goes on."""
    monkeypatch.setenv("DDP_HPC_HOME", str(tmp_path / "home"))
    new, cfg, run_dir = _earlier(tmp_path, "sbatch", status="preempted", ckpt=True, final=False)
    with pytest.raises(SpecError) as exc:
        resume_or_new(new, get("sbatch", client=_Queue(None, cluster="d")), [cfg], fresh=False, say=print)
    assert exc.value.problem == (f"cannot tell whether the earlier run of this config, job 4242 ({run_dir}), "
                                 "still runs (it was submitted on cluster c, not on this one (d)), so it is "
                                 "not resumed")
    assert "--fresh" in exc.value.hint
    said: list[str] = []                     # on its own cluster, squeue's word that it ended holds
    assert resume_or_new(new, get("sbatch", client=_Queue(None)), [cfg], fresh=False,
                         say=said.append).log_dir == str(run_dir)


def test_a_local_run_recorded_on_another_host_is_not_resumed_into(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_HPC_HOME", str(tmp_path / "home"))
    new, cfg, run_dir = _earlier(tmp_path, "local", status=None, ckpt=True, final=False)
    rec = records.list_records()[-1]
    rec.cluster, rec.pids, rec.pid_times = "another-host", [os.getpid()], [time.time()]
    records.update_record(rec)
    with pytest.raises(SpecError) as exc:
        resume_or_new(new, get("local"), [cfg], fresh=False, say=print)
    assert "its processes were recorded on another-host, not here" in exc.value.problem
    assert "--fresh" in exc.value.hint
    rec.cluster, rec.pids = socket.gethostname(), []         # here, and the driver said it ended
    records.update_record(rec)
    said: list[str] = []
    assert resume_or_new(new, get("local"), [cfg], fresh=False, say=said.append).log_dir == str(run_dir)
    assert said[-1].startswith(f"resuming run {run_dir.name}")
