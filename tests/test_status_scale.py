"""Status over many jobs: one squeue and one sacct call per refresh however many jobs and array
tasks, and the job table's cache of ended jobs' rows (`ddp_hpc.status.rowcache`).

The scheduler is `ddp_hpc.slurm.cli.SlurmCLI` with a runner that answers like Slurm 22.05 and
counts its calls; the real scheduler is in tests/cluster/test_array_status_cluster.py.
"""
from __future__ import annotations

import json
import subprocess
import time

import pytest

from ddp_hpc import records
from ddp_hpc.judge import reader
from ddp_hpc.slurm.cli import SACCT_FIELDS, SEP, SQUEUE_FIELDS, SlurmCLI
from ddp_hpc.status import assemble as resolve_mod
from ddp_hpc.status import rowcache
from ddp_hpc.status.collect import collect
from ddp_hpc.status.targets import recent_targets


class CountingSlurm:
    """squeue lists the RUNNING jobs asked for, sacct the others; every call is kept."""

    def __init__(self, jobs: dict[str, str]):
        self.jobs, self.calls = jobs, []

    def __call__(self, argv, *, input=None, cwd=None, env=None, timeout=None):
        self.calls.append(list(argv))
        if argv[0] == "scontrol":
            return subprocess.CompletedProcess(argv, 0, "ClusterName=c1\n", "")
        asked = set(next(a for a in argv if a.startswith("--jobs=")).split("=", 1)[1].split(","))
        mine = [(j, s) for j, s in self.jobs.items() if j in asked or j.split("_")[0] in asked]
        if argv[0] == "squeue":
            rows = ["".join(f"{v}{SEP}" for v in self._squeue(j).values()) for j, s in mine if s == "RUNNING"]
        else:
            rows = [SEP.join(self._sacct(j, s).values()) for j, s in mine if s != "RUNNING"]
        return subprocess.CompletedProcess(argv, 0, "".join(r + "\n" for r in rows), "")

    def count(self, name: str) -> int:
        return sum(1 for c in self.calls if c[0] == name)

    @staticmethod
    def _squeue(j):
        job, _, task = j.partition("_")
        row = dict(JobArrayID=j, JobID=job, ArrayJobID=job, ArrayTaskID=task or "N/A", State="RUNNING",
                   Reason="None", TimeUsed="5:00", TimeLimit="1:00:00", NumNodes="1", RestartCnt="0",
                   NodeList="n1", Partition="p", UserName="u", SubmitTime="N/A", StartTime="N/A",
                   EndTime="N/A", Name="train")
        return {f: row[f] for f in SQUEUE_FIELDS}

    @staticmethod
    def _sacct(j, state):
        row = dict(JobID=j, JobIDRaw=j, State=state, ExitCode="0:0", Elapsed="00:05:00", Timelimit="01:00:00",
                   NNodes="1", NodeList="n1", Partition="p", Submit="N/A", Start="N/A", End="N/A", JobName="train")
        return {f: row[f] for f in SACCT_FIELDS}


def record(home, job_id, log_dir, array=None):
    rec = records.JobRecord(id=job_id, cluster="c1", name="train", backend="sbatch", nodes=1, gpus_per_node=1,
                            time_limit="01:00:00", log_dir=str(log_dir), config=None, overrides=[],
                            submitted_at=time.time(), cwd=str(home), array=array, command=["python", "t.py"])
    (home / "jobs").mkdir(parents=True, exist_ok=True)
    (home / "jobs" / f"{job_id}.json").write_text(json.dumps(rec.to_dict()))


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_HPC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_a_thousand_array_tasks_and_many_jobs_cost_one_squeue_and_one_sacct(home, tmp_path):
    tasks = [{"task_id": i, "overrides": [f"lr={i}"], "log_dir": str(tmp_path / f"t{i}")} for i in range(1000)]
    record(home, "500", tmp_path / "arr", array=tasks)
    for i in range(200):
        record(home, str(600 + i), tmp_path / f"j{i}")
    jobs = {f"500_{i}": "RUNNING" if i % 3 == 0 else "COMPLETED" for i in range(1000)}
    jobs.update({str(600 + i): "FAILED" if i % 2 else "RUNNING" for i in range(200)})
    sched = CountingSlurm(jobs)
    sts = collect(recent_targets(0), SlurmCLI(runner=sched), brief=True)
    assert (sched.count("squeue"), sched.count("sacct")) == (1, 1), [c[0] for c in sched.calls]
    assert len(sts) == 1200 and {s.id: s.state for s in sts} == jobs
    assert {s.id: s.source for s in sts}["500_3"] == "squeue" and {s.id: s.source for s in sts}["500_4"] == "sacct"
    # the array is named once by its id, not task by task: a short command line
    squeue_jobs = next(a for a in sched.calls[-2] + sched.calls[-1] if a.startswith("--jobs="))
    assert len(squeue_jobs) < 2000 and "500_" not in squeue_jobs
    sched.calls.clear()   # a refresh (cached rows of the ended jobs): the same two calls
    again = collect(recent_targets(0), SlurmCLI(runner=sched), brief=True)
    assert (sched.count("squeue"), sched.count("sacct")) == (1, 1)
    assert {s.id: s.state for s in again} == jobs


def write_events(d, *events):
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "rank0.events.jsonl", "a") as f:
        for name, extra in events:
            f.write(json.dumps({"time": time.time(), "event": name, "rank": 0, "job_id": "x", "restart": 0,
                                "host": "h", **extra}) + "\n")


def test_the_table_reads_an_ended_jobs_logs_once_while_nothing_changed(home, tmp_path, monkeypatch):
    done, running = tmp_path / "done", tmp_path / "running"
    write_events(done, ("start", {"world_size": 1, "total_steps": 10}), ("step", {"step": 10, "loss": 0.5}),
                 ("end", {"status": "completed", "step": 10}))
    write_events(running, ("start", {"world_size": 1, "total_steps": 10}), ("step", {"step": 2, "loss": 0.9}))
    record(home, "701", done)
    record(home, "702", running)
    read = []
    real = reader.RunLogs
    monkeypatch.setattr(resolve_mod, "RunLogs", lambda d, **kw: read.append(str(d)) or real(d, **kw))
    sched = CountingSlurm({"701": "COMPLETED", "702": "RUNNING"})
    first = {s.id: s for s in collect(recent_targets(0), SlurmCLI(runner=sched), brief=True)}
    assert sorted(read) == sorted([str(done), str(running)])
    assert records.load_record("701").final["logs"]["outcome"] == "completed"   # kept with its final state
    read.clear()
    second = {s.id: s for s in collect(recent_targets(0), SlurmCLI(runner=sched), brief=True)}
    assert read == [str(running)]          # the running job is read again, the ended one is not
    assert second["701"].to_dict() == first["701"].to_dict()
    assert second["701"].progress.loss == 0.5 and second["701"].state == "COMPLETED"
    write_events(done, ("eval", {"step": 10, "metrics": {"acc": 0.9}}))   # its logs changed
    read.clear()
    third = {s.id: s for s in collect(recent_targets(0), SlurmCLI(runner=sched), brief=True)}
    assert sorted(read) == sorted([str(done), str(running)]) and third["701"].eval_metrics == {"acc": 0.9}
    sched.jobs["701"] = "FAILED"            # the scheduler says otherwise: a new row, its logs'
    read.clear()                            # facts from the record (judge/kept.py), unchanged
    fourth = {s.id: s for s in collect(recent_targets(0), SlurmCLI(runner=sched), brief=True)}
    assert str(done) not in read and fourth["701"].state == "FAILED"
    assert fourth["701"].eval_metrics == {"acc": 0.9} and fourth["701"].progress.loss == 0.5


def test_a_damaged_cache_is_ignored_and_rewritten(home, tmp_path):
    d = tmp_path / "done"
    write_events(d, ("start", {"world_size": 1}), ("end", {"status": "completed"}))
    record(home, "801", d)
    rowcache.cache_path().parent.mkdir(parents=True)
    rowcache.cache_path().write_text("{not json")
    sched = CountingSlurm({})   # the scheduler forgot it: the state from its logs, the row cached
    assert [s.state for s in collect(recent_targets(0), SlurmCLI(runner=sched), brief=True)] == ["COMPLETED"]
    assert "801" in json.loads(rowcache.cache_path().read_text())["rows"]
