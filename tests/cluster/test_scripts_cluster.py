"""Your own script on the real test cluster: an unmodified torchrun-style script through
``submit`` on the sbatch, submitit and local backends (2 nodes x 2 tasks: local ranks and group
ranks); a rank that raises, named by status; hostile script arguments kept verbatim; the
preemption API (USR2 -> checkpoint -> requeue -> resume); the Python API with a function; a
request for more CPUs than a node has. Where two ranks on one node prove nothing more, a job is
2 nodes x 1 task: each rank process costs ~2 s of CPU to import torch."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from ddp_hpc import records
from ddp_hpc.judge.nodefiles import rank_events

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
PLAIN = str(ROOT / "tests" / "cluster" / "plain_torchrun.py")
PREEMPTIBLE = str(ROOT / "examples" / "preemptible.py")
PY = sys.executable


@pytest.fixture
def where(slurm_cluster):
    d = slurm_cluster.shared_dir / f"scripts-{time.monotonic_ns()}"
    d.mkdir()
    env = {**slurm_cluster.env, "DDP_HPC_HOME": str(d / "home"), "PYTHONPATH": str(ROOT)}
    return d, env


def _submit(c, where, *args, timeout=300):
    d, env = where
    return c.run([PY, "-m", "ddp_hpc.submit", *args], cwd=str(d), env=env, timeout=timeout)


def _status(c, where, *args) -> str:
    d, env = where
    p = c.run([PY, "-m", "ddp_hpc.status", *args], cwd="/", env=env, timeout=120)
    return p.stdout + p.stderr


def _seen(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.parametrize("backend", ["sbatch", "submitit"])   # local: tests/test_readme.py
def test_unmodified_torchrun_script_runs_2x2_with_its_arguments_verbatim(slurm_cluster, where, backend):
    c, (d, _) = slurm_cluster, where
    out, marker = d / "seen", d / "pwned"
    hostile = ["a b", "it's", '"quoted"', f"$(touch {marker})", "`id`", "; rm -rf /", "*", "--"]
    started = time.monotonic()
    p = _submit(c, where, "--backend", backend, "-N", "2", "-G", "2", "-t", "10", "--wait",
                "--wait-timeout", "240", PLAIN, str(out), "--echo", *hostile)
    print(f"{backend}: {time.monotonic() - started:.1f} s", p.stderr[-600:])
    assert p.returncode == 0, p.stdout + p.stderr
    seen = _seen(out)
    assert {s["WORLD_SIZE"] for s in seen} == {"4"} and {s["sum"] for s in seen} == {10.0}
    assert len({s["MASTER_ADDR"] for s in seen}) == 1 and len({s["MASTER_PORT"] for s in seen}) == 1
    assert [s["RANK"] for s in seen] == ["0", "1", "2", "3"]
    assert [s["LOCAL_RANK"] for s in seen] == ["0", "1", "0", "1"]
    assert [s["GROUP_RANK"] for s in seen] == ["0", "0", "1", "1"]
    assert seen[0]["host"] == seen[1]["host"] != seen[2]["host"] == seen[3]["host"]
    # every argument after the script reaches it unchanged, and nothing in them ran
    assert all(s["argv"] == [str(out), "--echo", *hostile] for s in seen)
    assert not marker.exists()
    (rec,) = records.list_records({"DDP_HPC_HOME": str(d / "home")})
    assert rec.config is None and rec.command[-len(hostile) - 3:] == [PLAIN, str(out), "--echo", *hostile]
    assert rec.backend == backend
    for r in range(4):
        evs = rank_events(rec.log_dir, r).events
        assert evs[0]["event"] == "start" and evs[-1]["event"] == "end", evs
        assert evs[-1]["status"] == "completed" and evs[-1]["exit_code"] == 0
    assert "COMPLETED" in _status(c, where, rec.id)


@pytest.mark.parametrize("backend", ["sbatch", "submitit"])
def test_script_rank1_raises_status_names_it(slurm_cluster, where, backend):
    """Only test of a plain script's raising rank named by status, on each real backend."""
    c, (d, _) = slurm_cluster, where
    started = time.monotonic()
    p = _submit(c, where, "--backend", backend, "-N", "2", "-G", "1", "-t", "10", "--wait",
                "--wait-timeout", "240", PLAIN, str(d / "seen"), "--fail-rank", "1")
    took = time.monotonic() - started
    job_id = p.stdout.split()[-1]
    detail = _status(c, where, job_id)
    print(f"ended after {took:.1f} s\n{p.stderr}\n{detail}")
    assert p.returncode != 0
    assert "FAILED" in detail
    assert "First failure: rank 1" in detail and "RuntimeError: rank 1 was told to fail" in detail
    # --wait ends with the same first failure status shows, the culprit's error line included
    assert "First failure: rank 1" in p.stderr and "RuntimeError: rank 1 was told to fail" in p.stderr


def test_too_many_cpus_per_task_fails_before_submitting(slurm_cluster, where):
    c, (d, _) = slurm_cluster, where
    p = _submit(c, where, "--backend", "sbatch", "-N", "2", "-G", "2", "-c", "5", PLAIN, str(d))
    print(p.stderr)
    assert p.returncode == 2
    assert "5 CPUs per task x 2 tasks per node = 10 CPUs" in p.stderr and "HINT:" in p.stderr
    assert "--cpus-per-task 4" in p.stderr
    assert not records.list_records({"DDP_HPC_HOME": str(d / "home")})


def test_python_api_function_result_and_failure(slurm_cluster, where):
    """Both jobs are submitted at once and run side by side; then each is waited for. Only test of
    ``submit_job`` with a function on real Slurm (its result, and a failing rank's error)."""
    c, (_, env) = slurm_cluster, where
    code = ("import ddp_hpc, json\n"
            "from tests.cluster.script_helpers import allsum, fail_on\n"
            "if __name__ == '__main__':\n"
            "    job = ddp_hpc.submit_job(allsum, args=(0.5,), nodes=2, gpus=1, time='10')\n"
            "    bad = ddp_hpc.submit_job(fail_on, args=(1,), nodes=2, gpus=1, time='10')\n"
            "    print('JOB', job.job_id, job.backend, flush=True)\n"
            "    print('RESULT', json.dumps(job.result(timeout=240)), job.state(), flush=True)\n"
            "    try:\n"
            "        bad.result(timeout=240)\n"
            "    except Exception as e:\n"
            "        print('ERROR', type(e).__name__, e.rank, e.exc_type, e.message, flush=True)\n")
    started = time.monotonic()
    p = c.run([PY, "-c", code], cwd=str(ROOT), env=env, timeout=600)
    print(f"{time.monotonic() - started:.1f} s\n{p.stdout}\n{p.stderr[-1500:]}")
    assert p.returncode == 0, p.stderr
    lines = {ln.split()[0]: ln.split(maxsplit=1)[1] for ln in p.stdout.splitlines() if ln.strip()}
    assert lines["JOB"].split()[1] == "submitit"
    result = json.loads(lines["RESULT"].rsplit(" ", 1)[0])
    assert result["sum"] == 0 + 1 + 2 * 0.5 and result["world"] == 2 and result["rank"] == 0
    assert lines["RESULT"].endswith("COMPLETED")
    assert lines["ERROR"] == "RankFailedError 1 ValueError rank 1 refuses"


def _events(log_dir: Path, rank: int) -> list[dict]:
    return rank_events(log_dir, rank).events


def test_preemption_api_usr2_checkpoints_requeues_and_resumes(slurm_cluster, where):
    """Only test of a plain script's preemption API (ddp_hpc.preemption) through a real USR2 and
    requeue; 2 nodes x 1 task."""
    c, (d, _) = slurm_cluster, where
    p = _submit(c, where, "--backend", "sbatch", "-N", "2", "-G", "1", "-t", "15", PREEMPTIBLE,
                "--steps", "300", "--sleep", "0.05", "--ckpt-dir", str(d / "ckpt"))
    assert p.returncode == 0, p.stderr
    job_id = p.stdout.split()[-1]
    (rec,) = records.list_records({"DDP_HPC_HOME": str(d / "home")})
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:         # wait until the script reports progress
        if any(e["event"] == "step" and (e.get("step") or 0) >= 10 for e in _events(rec.log_dir, 0)):
            break
        time.sleep(0.5)
    else:
        pytest.fail(_status(c, where, job_id))
    started = time.monotonic()
    assert c.run(["scancel", "--signal=USR2", job_id], timeout=30).returncode == 0
    state = c.wait(job_id, timeout=400)
    detail = _status(c, where, job_id)
    print(f"ended {time.monotonic() - started:.1f} s after USR2\n{detail}")
    ev = _events(rec.log_dir, 0)
    kinds = [(e["event"], e["restart"]) for e in ev]
    assert state == "COMPLETED", (kinds, detail)
    for want in [("preempt", 0), ("checkpoint", 0), ("requeue", 0), ("end", 0), ("start", 1)]:
        assert want in kinds, (want, kinds)
    first_end = next(e for e in ev if e["event"] == "end")
    assert first_end["status"] == "preempted" and first_end["exit_code"] == 75
    stopped = next(e for e in ev if e["event"] == "checkpoint")["step"]
    resumed = [e["step"] for e in ev if e["event"] == "step" and e["restart"] == 1]
    assert resumed and min(resumed) > stopped - 1 and max(resumed) == 300
    assert "resumed from step" in (Path(rec.log_dir) / "rank0.out").read_text()
    assert "restarts: 1" in detail and "COMPLETED" in detail
