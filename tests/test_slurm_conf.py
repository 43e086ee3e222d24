"""A Slurm configuration that cannot work fails at once: SLURM_CONF naming no file would make every
Slurm command retry it for 60 s (Slurm 22.05: "cannot stat file ..., retrying in 1sec up to
60sec"), so ``SlurmCLI`` refuses before starting one, naming the variable, the path and the fix."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_hpc.slurm.cli import SlurmCLI, SlurmError
from ddp_hpc.slurm.conf import config_problem

ROOT = Path(__file__).resolve().parents[1]


def _never(*_a, **_k):
    raise AssertionError("no Slurm command may start with this configuration")


def test_config_problem_names_the_variable_and_the_path(tmp_path):
    conf = tmp_path / "slurm.conf"
    assert config_problem({}) is None                      # Slurm's own default: fails fast itself
    assert (config_problem({"SLURM_CONF": str(conf)})
            == f"SLURM_CONF={conf} names no file (Slurm would retry it for 60 s)")
    assert "names a directory" in config_problem({"SLURM_CONF": str(tmp_path)})
    assert config_problem({"SLURM_CONF": ""}) == "SLURM_CONF is set but empty"
    conf.write_text("ClusterName=x\n")
    assert config_problem({"SLURM_CONF": str(conf)}) is None


@pytest.mark.parametrize("call", ["sinfo_partitions", "cluster_name"])
def test_no_command_starts_on_a_missing_slurm_conf(tmp_path, call):
    cli = SlurmCLI(runner=_never, env={"PATH": "/usr/bin", "SLURM_CONF": str(tmp_path / "gone.conf")})
    with pytest.raises(SlurmError) as err:
        getattr(cli, call)()
    text = str(err.value)
    assert f"not run: SLURM_CONF={tmp_path / 'gone.conf'} names no file" in text
    assert "HINT: set SLURM_CONF to the path of the cluster's slurm.conf" in text


def _submit(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddp_hpc.submit", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=20)   # Slurm alone would take 60 s


@pytest.mark.skipif(shutil.which("sinfo") is None or shutil.which("sbatch") is None,
                    reason="Slurm's client commands are not installed")
def test_submit_with_a_missing_slurm_conf_answers_at_once(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDP_HPC_"))}
    env.update(SLURM_CONF="/nonexistent/slurm.conf", DDP_HPC_HOME=str(tmp_path / "home"))
    dry = _submit("--backend", "sbatch", "--dry-run", "jobs/demo.yaml", env=env)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.startswith("#!/bin/bash")
    assert ("dry run without a reachable cluster: partition and GPU checks skipped (`sinfo "
            in dry.stderr and "not run: SLURM_CONF=/nonexistent/slurm.conf names no file" in dry.stderr)
    real = _submit("--backend", "sbatch", "jobs/demo.yaml", "--log-dir", str(tmp_path), env=env)
    assert real.returncode == 2
    assert "error: `sinfo" in real.stderr and "SLURM_CONF=/nonexistent/slurm.conf names no file" in real.stderr
    assert "HINT: set SLURM_CONF to the path of the cluster's slurm.conf" in real.stderr
