"""The Backend seam: a fourth backend planted in the registry (``echo``: runs the job's command
once, here, as a real process) goes through the command line, the Python API, cancel, resume and
status's targets with no other module knowing its name. Whatever still compared names ("local",
"sbatch", "submitit") would send it the wrong way, and these assertions would fail."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_hpc import backends, records
from ddp_hpc.backends.base import Plan, Submitted, make_run_dirs, record
from ddp_hpc.backends.spec import SpecError
from ddp_hpc.judge.decide import Described
from ddp_hpc.status.collect import collect
from ddp_hpc.status.targets import StatusTarget
from ddp_hpc.submit import cancel
from ddp_hpc.submit import cli as submit_cli
from ddp_hpc.submit.api import submit_job

PY = sys.executable


class EchoBackend:
    """Runs the job's command once on this machine, waits for it, keeps its output as echo.out.
    Each lookup makes an instance (the registry keeps the class): what every instance was asked
    goes into the class's ``calls``."""

    name = "echo"
    describes_with = "echo"
    runs_here = True
    takes_functions = True
    takes_node_range = False
    takes_container = False
    restarts_in_allocation = False
    devices_here = False
    calls: list[str] = []

    def __init__(self, client=None, offline=None) -> None:
        self.client = client

    def check(self, spec, dry_run):
        self.calls.append("check")

    def plan(self, spec, task_cfgs):
        self.calls.append("plan")
        return Plan(spec, "echo would run: " + " ".join(spec.command) + "\n", dict(os.environ))

    def submit(self, plan, opts):
        self.calls.append("submit")
        make_run_dirs(plan.spec, plan.task_cfgs)
        rec = record(plan.spec, f"echo-{Path(plan.spec.log_dir).name}", self, socket.gethostname())
        out = subprocess.run(list(plan.spec.command), env=dict(plan.env), capture_output=True,
                             text=True, timeout=60)
        (Path(plan.spec.log_dir) / "echo.out").write_text(out.stdout)
        rec.pids, rec.pid_times = [], []
        records.update_record(rec)
        return Submitted(rec, out.returncode)

    def submit_function(self, spec, fn, args, kwargs):
        self.calls.append("submit_function")
        rec = record(spec, f"echo-{Path(spec.log_dir).name}", self, socket.gethostname())
        return Submitted(rec, handles={"submitit_job": None})

    def describe(self, jobs, history=False, only=None):
        self.calls.append("describe " + ",".join(j.id for j in jobs))
        return {j.id: Described(False, alive=False, output=str(Path(j.record.log_dir) / "echo.out"))
                for j in jobs}

    def active(self, rec):
        self.calls.append("active")
        return False, ""

    def cancel(self, rec, job_id, grace):
        self.calls.append(f"cancel {job_id}")
        return f"job {job_id}: echo has nothing to stop"

    def signal_ranks(self, rec, job_id, signum):
        self.calls.append(f"signal {job_id}")
        return f"echo signalled nothing for {job_id}"


@pytest.fixture
def echo(tmp_path, monkeypatch):
    backends.register(EchoBackend)
    EchoBackend.calls = []
    monkeypatch.setenv("DDP_HPC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PATH", os.path.dirname(PY))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hello.py").write_text("import sys\nprint('hello', *sys.argv[1:])\n")
    yield EchoBackend
    backends.unregister("echo")


def test_a_planted_backend_plans_and_submits_through_the_command_line(echo, tmp_path, capsys, monkeypatch):
    # cancel of a job that does not run here waits for Slurm to report its end (30 s): no Slurm here
    monkeypatch.setattr(cancel, "SLURM_SETTLE_S", 1.0)
    args = ["--backend", "echo", "-N", "2", "-G", "1", "--log-dir", str(tmp_path / "runs")]
    assert submit_cli.main([*args, "--dry-run", "hello.py", "a", "b"]) == 0
    out, err = capsys.readouterr()
    assert "backend echo: asked for with --backend" in err
    assert out.startswith("echo would run: ") and out.rstrip().endswith("hello.py a b")
    assert echo.calls == ["check", "plan"] and not (tmp_path / "runs").exists()

    assert submit_cli.main([*args, "hello.py", "world"]) == 0
    (rec,) = records.list_records()
    assert rec.backend == "echo" and rec.id.startswith("echo-") and rec.nodes == 2
    assert rec.time_limit is None          # it runs here: no time limit, as the backend says
    assert (Path(rec.log_dir) / "echo.out").read_text() == "hello world\n"
    assert echo.calls[-3:] == ["check", "plan", "submit"]

    (st,) = collect([StatusTarget(rec.id, rec, rec.log_dir)])   # status asks the backend, not the name
    assert echo.calls[-1] == f"describe {rec.id}"
    assert (st.state_name, st.source) == ("FAILED", "processes")   # gone, and no rank wrote an event
    assert st.reason == f"ended before its first event; see {Path(rec.log_dir) / 'echo.out'}"
    assert cancel.main([rec.id]) == 0                     # cancel goes through the backend too
    assert f"job {rec.id}: echo has nothing to stop" in capsys.readouterr().out
    assert "cancel " + rec.id in echo.calls


def test_a_planted_backend_through_the_python_api(echo, tmp_path, capsys):
    job = submit_job([PY, str(tmp_path / "hello.py"), "api"], backend="echo", nodes=1,
                     log_dir=str(tmp_path / "runs"))
    assert isinstance(job.backend, echo) and job.backend.name == "echo"
    assert job.backend_reason == "asked for with --backend"
    assert (Path(job.log_dir) / "echo.out").read_text() == "hello api\n"
    assert job.record.backend == "echo" and capsys.readouterr().out == ""   # quiet: no job id printed
    fjob = submit_job(len, args=([1],), backend="echo", log_dir=str(tmp_path / "runs"))
    assert echo.calls[-1] == "submit_function" and isinstance(fjob.backend, echo)
    job.cancel()
    assert echo.calls[-1] == f"cancel {job.job_id}"


def test_unknown_backend_names_are_refused_with_the_registered_ones(echo):
    with pytest.raises(SpecError) as err:
        backends.get("k8s", where="slurm.backend")
    assert err.value.problem == "slurm.backend 'k8s' names no backend"
    assert "echo" in err.value.hint and "sbatch" in err.value.hint
    assert type(backends.get("sbatch-script")) is type(backends.get("sbatch"))   # records register's name


def test_the_command_line_refuses_an_unknown_backend_naming_the_known_ones(tmp_path):
    """--backend takes any plain name (a registered backend is one too); the registry refuses one
    it does not know before anything is written, with exit 2."""
    env = {**os.environ, "DDP_HPC_HOME": str(tmp_path / "home")}
    p = subprocess.run([PY, "-m", "ddp_hpc.submit", "--backend", "k8s", "--dry-run", "-N", "1", "-G", "1",
                        str(Path(__file__).resolve().parents[1] / "jobs" / "demo.yaml")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "--backend 'k8s' names no backend" in p.stderr and "local, sbatch, submitit" in p.stderr, p.stderr
    assert not (tmp_path / "home").exists() or not any((tmp_path / "home").rglob("*.json"))


@pytest.mark.parametrize("old, new", [
    ("ddp_hpc.submit.slurm.run_command_task", "ddp_hpc.backends.slurmjob.run_command_task"),
    ("ddp_hpc.submit.slurm.run_task", "ddp_hpc.backends.slurmjob.run_task"),
    ("ddp_hpc.submit.functions.rank_entry", "ddp_hpc.backends.functions.rank_entry"),
])
def test_a_job_queued_before_the_backends_moved_still_finds_its_task_function(old, new):
    """submitit unpickles a job's function when the job starts and at every requeue, perhaps days
    after it was submitted: the pickles of jobs queued by an earlier version name the old module
    paths, and must still load (in a fresh interpreter, as a task would), to the same function."""
    module, _, name = old.rpartition(".")
    # a pickle as an earlier version wrote it: a global reference by module and name (protocol 0)
    data = f"c{module}\n{name}\np0\n.".encode()
    code = ("import pickle, sys\nfn = pickle.loads(sys.stdin.buffer.read())\n"
            "print(fn.__module__ + '.' + fn.__qualname__)\n")
    p = subprocess.run([PY, "-c", code], input=data, capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr.decode()
    assert p.stdout.decode().strip() == new


def test_a_backend_whose_describe_fails_leaves_its_jobs_to_their_logs_and_the_others_show(echo, tmp_path,
                                                                                         monkeypatch):
    """A planted backend's scheduler client that raises must not take `ddp-hpc status` down for
    every job: its own jobs are read from their records and logs, with a note naming the error."""
    assert submit_cli.main(["--backend", "echo", "-N", "1", "-G", "1", "--log-dir", str(tmp_path / "runs"),
                            "hello.py", "x"]) == 0
    (rec,) = records.list_records()

    def broken(self, jobs, history=False, only=None):
        raise ConnectionError("the queue's server does not answer")
    monkeypatch.setattr(echo, "describe", broken)
    local = StatusTarget("local-x-1", None, str(tmp_path / "nowhere"))
    st, other = collect([StatusTarget(rec.id, rec, rec.log_dir), local])
    assert st.tried[0] == ("echo: could not describe its jobs (ConnectionError: the queue's server does not "
                           "answer); state from the record and the logs")
    assert st.source == "logs" and other.id == "local-x-1"
