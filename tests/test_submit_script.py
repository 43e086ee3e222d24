"""``submit`` with a script or a module instead of a config: how the command line is split (every
word after the script is the script's), what each backend would run (--dry-run), and the Python
API with a function on the local backend (real processes, real gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from loadscale import scaled

from ddp_hpc.backends.spec import SpecError
from ddp_hpc.submit import cli as submit

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
SCRIPT = str(ROOT / "examples" / "torchrun_style.py")


def _env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDP_HPC_"))}
    env["DDP_HPC_HOME"] = str(tmp_path / "home")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not (Path(p) / "sbatch").exists())
    return env


def _cli(args, tmp_path, timeout=120):
    return subprocess.run([PY, "-m", "ddp_hpc.submit", *args], cwd=tmp_path, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("argv, kind, what, rest, nodes", [
    (["-N", "2", "train.py", "--nodes", "9", "-N", "3", "--", "x"], "script", "train.py",
     ("--nodes", "9", "-N", "3", "--", "x"), 2),
    (["--nodes=2", "-G4", "train.py"], "script", "train.py", (), 2),
    (["--time", "10", "-m", "pkg.train", "--lr", "0.1"], "module", "pkg.train", ("--lr", "0.1"), 1),
    (["-N", "2", "--", "train.py", "a b"], "script", "train.py", ("a b",), 2),
    (["-N", "2", "jobs/demo.yaml", "train.epochs=1"], "config", "jobs/demo.yaml",
     ("train.epochs=1",), 2),
])
def test_the_target_and_everything_after_it(argv, kind, what, rest, nodes):
    args, target = submit.parse(argv)
    assert (target.kind, target.what, target.rest) == (kind, what, rest)
    assert args.nodes == nodes or (args.nodes is None and nodes == 1)


def test_an_executable_file_is_a_script_and_yaml_is_a_config(tmp_path):
    exe = tmp_path / "run.sh"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert submit.parse([str(exe), "-x"])[1].kind == "script"
    assert submit.parse([str(ROOT / "jobs" / "demo.yaml")])[1].kind == "config"


def test_minus_m_without_a_module_says_how():
    with pytest.raises(SpecError, match="-m needs a module name"):
        submit.parse(["-N", "2", "-m"])


def test_dry_run_local_shows_the_wrapper_and_verbatim_arguments(tmp_path):
    p = _cli(["-N", "2", "-G", "2", "--dry-run", SCRIPT, "a b", "$(touch x)", "--nodes", "7"], tmp_path)
    assert p.returncode == 0, p.stderr
    line = p.stdout.strip().splitlines()[-1]
    assert "DDP_HPC_PREEMPT_SIGNAL=USR2 " in line
    assert "--nodes 2 --procs-per-node 2" in line
    assert f"-m ddp_hpc.exec -- {PY} {SCRIPT} 'a b' '$(touch x)' --nodes 7" in line
    assert not (tmp_path / "x").exists() and not (tmp_path / "runs").exists()


def test_dry_run_sbatch_renders_the_script_job(tmp_path):
    p = _cli(["--backend", "sbatch", "-N", "2", "-G", "2", "-c", "3", "--signal", "USR1@60",
              "--dry-run", "--sweep", "lr=0.1,0.01", SCRIPT, "it's"], tmp_path)
    assert p.returncode == 0, p.stderr
    text = p.stdout
    assert "#SBATCH --job-name=torchrun_style" in text and "#SBATCH --array=0-1" in text
    assert "#SBATCH --cpus-per-task=3" in text and "#SBATCH --signal=USR1@60" in text
    assert "export DDP_HPC_PREEMPT_SIGNAL=USR1" in text
    assert f"ARGS=({PY} -m ddp_hpc.exec -- {PY} {SCRIPT} 'it'\"'\"'s')" in text
    assert "0) LOG_DIR=" in text and "ARGS+=(--lr=0.1)" in text and "ARGS+=(--lr=0.01)" in text


def test_a_missing_absolute_script_is_not_said_to_be_relative(tmp_path):
    missing = tmp_path / "nowhere" / "train.py"
    p = _cli(["--dry-run", str(missing)], tmp_path)
    assert p.returncode == 2 and f"script {str(missing)!r} does not exist\nHINT:" in p.stderr, p.stderr
    assert "relative to" not in p.stderr
    p = _cli(["--dry-run", "train.py"], tmp_path)
    assert f"script 'train.py' does not exist (relative to {tmp_path})" in p.stderr


def test_a_typo_in_a_flag_gets_the_nearest_flag(tmp_path):
    p = _cli(["--dry-run", "--wiat", SCRIPT], tmp_path)
    assert p.returncode == 2
    assert "error: unrecognized arguments: --wiat (did you mean `--wait`?)" in p.stderr, p.stderr
    p = _cli(["--dry-run", "--wiat", "--frsh", "--zzzzzz", SCRIPT], tmp_path)
    assert "(did you mean `--wait` for --wiat, `--fresh` for --frsh?)" in p.stderr, p.stderr


def test_dry_run_submitit_calls_the_command_task(tmp_path):
    p = _cli(["--backend", "submitit", "--dry-run", "-m", "json.tool", "--sort-keys"], tmp_path)
    assert p.returncode == 0, p.stderr
    (call,) = json.loads(p.stdout)["calls"]
    assert call["function"] == "ddp_hpc.backends.slurmjob.run_command_task"
    assert call["args"][0] == [PY, "-m", "json.tool", "--sort-keys"] and call["args"][2] == "USR2"
    assert json.loads(p.stdout)["parameters"]["cpus_per_task"] == 1


@pytest.mark.parametrize("args, needle", [
    (["missing.py"], "script 'missing.py' does not exist"),
    (["-m", "no_such_module_xyz"], "module 'no_such_module_xyz' cannot be found"),
    (["-m", "bad-name"], "is not a dotted Python name"),
    (["--sweep", "lr", SCRIPT], "is not of the form NAME=V1,V2"),
    (["--log-dir", "/tmp/a b", SCRIPT], "log directory (--log-dir)"),
])
def test_bad_script_requests_fail_with_a_hint(tmp_path, args, needle):
    p = _cli(["--dry-run", *args], tmp_path)
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr and "HINT:" in p.stderr and "Traceback" not in p.stderr


def test_python_api_runs_a_function_locally_and_names_a_failing_rank(tmp_path):
    """ddp_hpc.submit_job(fn, ...) on the local backend: rank 0's value back (2 pretend nodes of one
    rank: nothing here is about ranks sharing a node); a raising rank named."""
    (tmp_path / "fns.py").write_text(
        (ROOT / "tests" / "cluster" / "script_helpers.py").read_text())
    wait = scaled(120)   # 15 s on an idle machine; over 120 s beside the other tests and a third of the CPU taken
    code = ("import json, ddp_hpc\n"
            "from fns import allsum, fail_on\n"
            "from ddp_hpc.launch import RankFailedError\n"
            "if __name__ == '__main__':\n"
            "    job = ddp_hpc.submit_job(allsum, args=(0.5,), nodes=2, gpus=1)\n"
            "    print('CHOSE', job.backend, job.backend_reason)\n"
            f"    print(job.backend, json.dumps(job.result(timeout={wait:.0f})), job.state())\n"
            "    bad = ddp_hpc.submit_job(fail_on, args=(1,), nodes=1, gpus=2)\n"
            "    try:\n"
            f"        bad.result(timeout={wait:.0f})\n"
            "    except RankFailedError as e:\n"
            "        print('ERROR', e.rank, e.exc_type, e.message)\n")
    p = subprocess.run([PY, "-c", code], cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                       text=True, timeout=3 * wait)
    assert p.returncode == 0, p.stderr[-3000:]
    first, second = p.stdout.strip().splitlines()[-2:]
    backend, rest = first.split(" ", 1)
    value, state = rest.rsplit(" ", 1)
    assert backend == "local" and state == "COMPLETED"
    said = "ddp_hpc submit: backend local: no `sbatch` on PATH"   # once per submission
    assert p.stderr.count(said) == 2, p.stderr[-3000:]
    assert "CHOSE local no `sbatch` on PATH, so this machine is not a Slurm login node" in p.stdout
    assert json.loads(value)["sum"] == 0 + 1 + 2 * 0.5 and json.loads(value)["world"] == 2
    assert second == "ERROR 1 ValueError rank 1 refuses"
    # the jobs have records and events, so status lists them
    st = subprocess.run([PY, "-m", "ddp_hpc.status", "--json"], cwd=tmp_path, env=_env(tmp_path),
                        capture_output=True, text=True, timeout=120)
    jobs = json.loads(st.stdout)
    assert sorted(j["state_name"] for j in jobs) == ["COMPLETED", "FAILED"], st.stdout


@pytest.mark.parametrize("kw, needle", [({"stage": 5}, "ddp_hpc.submit_job(stage=...) must be a list"),
                                        ({"time": 5.5}, "ddp_hpc.submit_job(time=...) '5.5' is not a Slurm time"),
                                        ({"gpus": 0}, "ddp_hpc.submit_job(gpus=...) 0 is too few")])
def test_the_python_api_names_its_own_keyword_in_an_error(kw, needle):
    import ddp_hpc
    with pytest.raises(ValueError) as e:  # ddp_hpc.config.ConfigError
        ddp_hpc.submit_job(["true"], backend="local", **kw)
    assert needle in str(e.value) and "--" not in str(e.value).splitlines()[0]
