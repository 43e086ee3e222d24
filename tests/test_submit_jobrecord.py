"""Job records: written atomically, found from any directory, never overwritten when ids repeat."""

import json
import os

import pytest

from ddp_hpc import records
from ddp_hpc.errors import HintError
from ddp_hpc.records import JobRecord, JobRecordError
from ddp_hpc.records.register import record_from_slurm


def _rec(job_id="123", cluster="c1", t=100.0, **kw):
    base = dict(id=job_id, cluster=cluster, name="demo", backend="sbatch", nodes=2, gpus_per_node=2,
                time_limit="00:10:00", log_dir="/tmp/logs/123", config="/x/jobs/demo.yaml",
                overrides=["lr=0.1"], submitted_at=t, cwd="/x")
    base.update(kw)
    return JobRecord(**base)


@pytest.fixture
def env(tmp_path):
    return {"DDP_HPC_HOME": str(tmp_path / "home")}


def test_records_dir_default_and_env(env, tmp_path):
    assert records.records_dir(env) == tmp_path / "home" / "jobs"
    assert str(records.records_dir({})).endswith(os.path.join(".ddp_hpc", "jobs"))


def test_roundtrip_and_load_from_other_cwd(env, tmp_path, monkeypatch):
    path = records.write_record(_rec(array=[{"task_id": 0, "overrides": ["seed=0"], "log_dir": "/l/0"}]), env)
    assert path == tmp_path / "home" / "jobs" / "123.json"
    data = json.loads(path.read_text())
    assert data["id"] == "123" and data["nodes"] == 2 and data["array"][0]["overrides"] == ["seed=0"]
    monkeypatch.chdir(tmp_path)
    r = records.load_record("123", environ=env)
    assert r.to_dict() == _rec(array=[{"task_id": 0, "overrides": ["seed=0"], "log_dir": "/l/0"}]).to_dict()
    assert r.path == str(path)
    # an array task id finds its parent record
    assert records.load_record("123_0", environ=env).id == "123"


def test_repeated_id_keeps_both_and_newest_wins(env):
    p1 = records.write_record(_rec(cluster="c1", t=100.0), env)
    p2 = records.write_record(_rec(cluster="c1", t=200.0, name="second"), env)
    assert p1 != p2 and p1.exists() and p2.exists()
    assert json.loads(p1.read_text())["submitted_at"] == 100.0
    assert records.load_record("123", environ=env).name == "second"
    assert records.load_record("123", cluster="c1", environ=env).name == "second"
    records.write_record(_rec(cluster="c2", t=50.0, name="other"), env)
    assert records.load_record("123", cluster="c2", environ=env).name == "other"
    assert [r.submitted_at for r in records.list_records(env)] == [50.0, 100.0, 200.0]
    # "12" must not match "123"
    with pytest.raises(JobRecordError, match="'12'"):
        records.load_record("12", environ=env)


def test_update_unknown_keys_and_damaged_files(env):
    rec = _rec(job_id="local-abc", backend="local", extra={"future_key": 1})
    path = records.write_record(rec, env)
    rec.pids = [11, 12]
    records.update_record(rec, env)
    data = json.loads(path.read_text())
    assert data["pids"] == [11, 12] and data["future_key"] == 1
    (path.parent / "999.json").write_text("{not json")
    (path.parent / "998.json").write_text(json.dumps({"id": "998"}))
    assert [r.id for r in records.list_records(env)] == ["local-abc"]
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_bad_id_refused(env):
    with pytest.raises(JobRecordError, match=r"'\.\./x'"):
        records.write_record(_rec(job_id="../x"), env)
    with pytest.raises(JobRecordError, match="no job record with id '77'") as e:
        records.load_record("77", environ=env)
    assert isinstance(e.value, HintError) and isinstance(e.value, LookupError)
    assert "DDP_HPC_HOME" in e.value.hint and "\nHINT: recent ids there: none" in str(e.value)


def test_register_from_a_slurm_batch_script(env, tmp_path):
    import subprocess
    import sys

    slurm = {"SLURM_JOB_ID": "77", "SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "7",
             "SLURM_CLUSTER_NAME": "c9", "SLURM_JOB_NAME": "demo", "SLURM_JOB_NUM_NODES": "2",
             "SLURM_GPUS_PER_NODE": "gpu:4", "SLURM_SUBMIT_DIR": str(tmp_path)}
    argv = [sys.executable, "-m", "ddp_hpc.records", "register", "--log-dir", str(tmp_path / "runs" / "x"),
            "--", "jobs/demo.yaml", "train.epochs=2"]
    full = {**os.environ, **env, **slurm}
    for _ in range(2):   # a requeued job runs the script again: still one record
        p = subprocess.run(argv, env=full, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
    rec = records.load_record("70_7", environ=env)
    assert (rec.cluster, rec.name, rec.backend, rec.nodes, rec.gpus_per_node) == ("c9", "demo", "sbatch-script", 2, 4)
    assert rec.log_dir == str(tmp_path / "runs" / "x") and rec.overrides == ["train.epochs=2"]
    assert len(records.list_records(env)) == 1
    outside = {k: v for k, v in full.items() if not k.startswith("SLURM_")}
    p = subprocess.run(argv, env=outside, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p.stderr
    assert p.stderr.startswith("python -m ddp_hpc.records: error: no SLURM_JOB_ID") and "\nHINT: call it" in p.stderr


def test_record_from_slurm_reads_the_job_facts(tmp_path):
    rec = record_from_slurm("runs/x", None, [], environ={
        "SLURM_JOB_ID": "81", "SLURM_NNODES": "3", "SLURM_NTASKS_PER_NODE": "2", "SLURM_SUBMIT_DIR": "/sub"})
    assert (rec.id, rec.cluster, rec.name, rec.nodes, rec.gpus_per_node, rec.cwd) == ("81", "", "ddp_hpc", 3, 2, "/sub")
    assert rec.log_dir == os.path.abspath("runs/x") and rec.config is None and rec.submitted_at > 0
