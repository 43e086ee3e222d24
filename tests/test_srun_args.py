"""srun options (``--srun-arg KEY=VALUE``, YAML ``slurm.srun_args``) and ``--container IMAGE``:
checked like the sbatch options (names, values, options ddp_hpc sets itself), merged key by key
over the YAML, handed to submitit, and the container refused before submitting where it cannot run."""

from __future__ import annotations

import dataclasses

import pytest

from ddp_hpc.backends import check_options, get
from ddp_hpc.backends.slurmjob import submitit_parameters
from ddp_hpc.backends.spec import JobSpec, SpecError, TaskSpec
from ddp_hpc.config import ConfigError, SlurmOptions
from ddp_hpc.config import slurm_options as so


def _spec(**opts) -> JobSpec:
    options = SlurmOptions(job_name="demo", cpus_per_task=1, signal="USR2@90", **opts)
    return JobSpec(options=options, config="/w/c.yaml", tasks=(TaskSpec(None, (), "/w/runs/1"),),
                   log_dir="/w/runs/1", workdir="/w", python="/venv/bin/python")


def test_yaml_and_command_line_srun_args_merge_key_by_key():
    base = SlurmOptions(srun_args={"cpu-bind": "cores", "mpi": "pmix"})
    args = so.given({**{f: None for f in so.FIELDS}, "srun_args": ["cpu-bind=none", "--label="]})
    assert args["srun_args"] == {"cpu-bind": "none", "label": True}
    assert so.merged(base, args).srun_args == {"cpu-bind": "none", "mpi": "pmix", "label": True}


@pytest.mark.parametrize("srun_args, message", [
    ({"ntasks": "3"}, "srun option 'ntasks' is set by ddp_hpc itself"),
    ({"output": "x"}, "srun option 'output' is set by ddp_hpc itself"),
    ({"Cpu Bind": "x"}, "srun option name 'Cpu Bind' is not valid"),
    ({"cpu-bind": "$(id)"}, "contains characters that are not allowed"),
    ({"export": "ALL,X='a b'"}, "contains characters that are not allowed"),
    ({"hint": "a;b"}, "contains characters that are not allowed"),
])
def test_bad_srun_args_are_refused_with_the_key(srun_args, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("$", r"\$")):
        SlurmOptions(srun_args=srun_args)


def test_container_image_is_one_plain_word():
    assert SlurmOptions(container="docker://nvcr.io#nvidia/pytorch:24.01-py3").container
    with pytest.raises(ConfigError, match="slurm.container"):
        SlurmOptions(container="/img/a b.sif")


def test_submitit_gets_the_srun_args_after_its_own():
    params = submitit_parameters(_spec(srun_args={"cpu-bind": "none", "label": True}))
    assert params["srun_args"][-2:] == ["--cpu-bind=none", "--label"]
    assert params["srun_args"][0] == "--kill-on-bad-exit=1"


def test_container_needs_the_sbatch_backend_and_a_runtime_here(tmp_path):
    spec = _spec(container="/images/torch.sif")
    check_options(dataclasses.replace(spec, options=SlurmOptions()), get("submitit"))   # no container
    with pytest.raises(SpecError, match="runs through the sbatch backend, not submitit") as err:
        check_options(spec, get("submitit"))
    assert "--srun-arg container-image=/images/torch.sif" in str(err.value)
    with pytest.raises(SpecError, match="needs apptainer or singularity, and neither is on PATH here"):
        check_options(spec, get("sbatch"), path=str(tmp_path))
    rt = tmp_path / "singularity"
    rt.write_text("#!/bin/sh\n")
    rt.chmod(0o755)
    check_options(spec, get("sbatch"), path=str(tmp_path))
