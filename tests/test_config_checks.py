"""Single input values checked before they reach an #SBATCH line, a file name or a command line:
a value with a trailing newline is refused like any other stray character (``re.match`` with
``$`` would let ``"name\\n"`` through, and the sbatch script would get a stray line)."""
from __future__ import annotations

import pytest

from ddp_hpc.config import ConfigError, SlurmOptions
from ddp_hpc.data.errors import StageError
from ddp_hpc.data.scriptstage import parse_stage_sources
from ddp_hpc.records import JobRecordError, load_record


@pytest.mark.parametrize("key, value", [
    ("job_name", "train\n"), ("partition", "gpu\n"), ("account", "proj\n"), ("qos", "high\n"),
    ("mem", "16G\n"), ("constraint", "a100\n"), ("dependency", "afterok:12\n"),
    ("container", "/images/torch.sif\n"), ("time", "30\n"), ("signal", "USR2@90\n"),
    ("job_name", "train\n#SBATCH --uid=0"),
])
def test_a_slurm_value_with_a_trailing_newline_is_refused(key, value):
    with pytest.raises(ConfigError) as e:
        SlurmOptions(**{key: value})
    assert repr(value) in str(e.value) and f"slurm.{key}" in str(e.value) and "HINT" in str(e.value)


@pytest.mark.parametrize("field", ["sbatch_args", "srun_args"])
def test_an_extra_option_with_a_trailing_newline_is_refused(field):
    with pytest.raises(ConfigError, match="contains characters that are not allowed"):
        SlurmOptions(**{field: {"mpi": "pmix\n"}})
    with pytest.raises(ConfigError, match="option name 'mpi\\\\n' is not valid"):
        SlurmOptions(**{field: {"mpi\n": "pmix"}})


def test_a_stage_name_with_a_trailing_newline_is_refused(tmp_path):
    (tmp_path / "data").mkdir()
    with pytest.raises(StageError, match="NAME 'TRAIN\\\\n' is not letters"):
        parse_stage_sources([("--stage", [f"{tmp_path / 'data'}=TRAIN\n"])], workdir=str(tmp_path))


def test_a_record_id_with_a_trailing_newline_is_refused(tmp_path):
    with pytest.raises(JobRecordError, match="'123\\\\n' is not a valid id"):
        load_record("123\n", environ={"DDP_HPC_HOME": str(tmp_path)})


@pytest.mark.parametrize("override, problem, hint", [
    ("optim.name=sgdd", "config key 'optim.name' = 'sgdd' is not one of its values",
     "optim.name is one of 'sgd', 'adam', 'adamw' (did you mean 'sgd'?)"),
    ("schedule.name=3", "config key 'schedule.name' = 3 is not one of its values",
     "schedule.name is one of 'constant', 'cosine', 'step'"),
])
def test_a_value_outside_a_keys_fixed_set_is_a_wrong_value_naming_the_valid_ones(override, problem, hint):
    from pathlib import Path

    from ddp_hpc.config import load_config
    demo = Path(__file__).resolve().parents[1] / "jobs" / "demo.yaml"
    with pytest.raises(ConfigError) as e:
        load_config(demo, [override])
    assert e.value.problem.startswith(problem) and "wrong type" not in e.value.problem, e.value.problem
    assert f"from {demo}" in e.value.problem and e.value.hint == hint, e.value


def test_ids_names_and_keys_with_a_trailing_newline_are_refused_everywhere(tmp_path):
    """The other $-anchored checks match the whole value too: a job id for status or Slurm's
    commands, a module for -m, a checkpoint's file name."""
    from ddp_hpc.backends.spec import SpecError
    from ddp_hpc.slurm.values import SlurmArgumentError, validate_job_id
    from ddp_hpc.status.targets import is_slurm_id
    from ddp_hpc.submit.target import module_command
    from ddp_hpc.train.checkpoint import list_checkpoints

    assert validate_job_id("123\n") == "123"   # stripped: what reaches argv is the clean id
    with pytest.raises(SlurmArgumentError):
        validate_job_id("123\n--all")
    assert is_slurm_id("123_4") and not is_slurm_id("123\n")
    with pytest.raises(SpecError, match="not a dotted Python name"):
        module_command("json\n", [], workdir=str(tmp_path))
    (tmp_path / "ckpt-000000007.pt").write_bytes(b"")
    (tmp_path / "ckpt-000000009.pt\n").write_bytes(b"")
    assert [s for s, _ in list_checkpoints(tmp_path)] == [7]


def test_every_slurm_default_passes_its_own_check():
    """SlurmOptions checks only the values that differ from their defaults (so a copy with one
    value changed checks that one again): each default must be a value its check keeps as is."""
    import dataclasses
    for f in dataclasses.fields(SlurmOptions):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        assert f.metadata["parse"](default, f"slurm.{f.name}") == default, f.name


@pytest.mark.parametrize("key, value", [("nodes", True), ("gpus_per_node", True), ("exclusive", 0),
                                        ("max_restarts", 2.0), ("stage", [])])
def test_a_value_equal_to_a_default_but_of_another_type_is_still_checked(key, value):
    """True == 1 and 0 == False: only the default itself, of its type, goes unchecked."""
    if key == "stage":   # a list is a stage list: checked, and kept as a tuple
        assert SlurmOptions(stage=value).stage == ()
        return
    with pytest.raises(ConfigError, match=f"slurm.{key}"):
        SlurmOptions(**{key: value})
