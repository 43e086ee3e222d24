"""ddp_hpc.config: YAML + dotted overrides -> frozen JobConfig; bad input refused with clear errors,
also through `python -m ddp_hpc.run` (exit code 2, message names the value and the fix)."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ddp_hpc.config import ConfigError, SlurmOptions, config_from_dict, config_to_dict, load_config, resolve_factory
from ddp_hpc.errors import HintError

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "jobs" / "demo.yaml"


def test_demo_yaml_loads_and_every_key_is_commented():
    cfg = load_config(DEMO)
    assert cfg.model.name == "mlp" and cfg.data.dataset == "synthetic"
    assert cfg.train.batch_size == 64 and cfg.optim.betas == (0.9, 0.999)
    for line in DEMO.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#") and ":" in line:
            value = line.split(":", 1)[1].split("#")[0].strip()
            if value:                         # a leaf setting (section headers need none)
                assert "#" in line, f"demo.yaml setting without a comment: {line!r}"


def test_demo_yaml_documents_every_slurm_option_with_its_default():
    raw = yaml.safe_load(DEMO.read_text())["slurm"]
    assert list(raw) == [f.name for f in dataclasses.fields(SlurmOptions)]
    assert load_config(DEMO).slurm == SlurmOptions()


def test_errors_keep_the_one_format_and_their_builtin_base():
    assert issubclass(ConfigError, HintError) and issubclass(ConfigError, ValueError)
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, ["slurm.qos=a;b"])
    assert e.value.problem.startswith("slurm.qos 'a;b' contains characters") and str(DEMO) in e.value.problem
    assert e.value.hint == "use the qos name as Slurm lists it"


def test_overrides_are_typed_and_nested():
    cfg = load_config(DEMO, ["train.batch_size=16", "optim.lr=1e-3", "train.clip_grad_norm=1",
                             "data.kwargs.size=100", "log.progress=off", "slurm.nodes=2",
                             "train.max_steps=null"])
    assert cfg.train.batch_size == 16 and cfg.optim.lr == 1e-3
    assert cfg.train.clip_grad_norm == 1.0 and isinstance(cfg.train.clip_grad_norm, float)
    assert cfg.data.kwargs["size"] == 100 and cfg.data.kwargs["in_dim"] == 32
    assert cfg.log.progress == "off" and cfg.train.max_steps is None
    assert cfg.slurm.nodes == 2 and cfg.slurm == dataclasses.replace(SlurmOptions(), nodes=2)


def test_config_is_frozen_and_round_trips():
    cfg = load_config(DEMO)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.batch_size = 3  # type: ignore[misc]
    again = config_from_dict(yaml.safe_load(yaml.safe_dump(config_to_dict(cfg))))
    assert again == cfg


@pytest.mark.parametrize("overrides, expect", [
    (["train.bach_size=3"], ["unknown config key 'train.bach_size'", "batch_size", "grad_accum"]),
    (["trian.epochs=3"], ["unknown config key 'trian'", "train", "checkpoint"]),
    (["train.batch_size=abc"], ["'train.batch_size' has the wrong type", "'abc'", "must be int"]),
    (["train.epochs=2.5"], ["'train.epochs' has the wrong type", "2.5"]),
    (["train.precision=fp8"], ["'train.precision'", "'fp8'", "'bf16'"]),
    (["train.batch_size=-4"], ["'train.batch_size' = -4 is invalid", "positive integer"]),
    (["train.collective_timeout_s=0"], ["'train.collective_timeout_s' = 0", "> 0 seconds"]),
    (["checkpoint.keep_last=0"], ["'checkpoint.keep_last' = 0", ">= 1"]),
    (["checkpoint.memory_every_steps=-2"], ["'checkpoint.memory_every_steps' = -2", "0 (auto", "-1 (off)"]),
    (["preempt.signal=USR9"], ["'preempt.signal'", "USR9", "USR2"]),
    (["train.batch_size"], ["not of the form key=value"]),
])
def test_bad_values_name_the_key_the_value_and_the_fix(overrides, expect):
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, overrides)
    msg = str(e.value)
    for part in expect:
        assert part in msg, (part, msg)
    assert "HINT" in msg
    assert str(DEMO) in msg or msg.startswith("override ")   # where the bad value came from


def test_unknown_key_in_a_yaml_file_names_the_file(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("train:\n  batch_size: 8\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'train.learning_rate' \(.*job.yaml"):
        load_config(p)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_missing_model_import_is_a_clear_error():
    with pytest.raises(ConfigError,
                       match=r"cannot import module 'no_such_pkg.models' \(No module named 'no_such_pkg'\)\.\nHINT"):
        resolve_factory("no_such_pkg.models:Net", {}, "model.name")
    with pytest.raises(ConfigError, match=r"has no attribute 'Nett'"):
        resolve_factory("ddp_hpc.examples.models:Nett", {}, "model.name")
    with pytest.raises(ConfigError, match=r"neither a built-in nor an import path.\nHINT: use one of mlp"):
        resolve_factory("mpl", {"mlp": object}, "model.name")


def _run(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDP_HPC_"))}
    return subprocess.run([sys.executable, "-m", "ddp_hpc.run", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_run_cli_refuses_bad_input_with_exit_code_2(tmp_path):
    p = _run(str(DEMO), "model.name=no_such_pkg.models:Net", cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert "model.name = 'no_such_pkg.models:Net': cannot import module 'no_such_pkg.models'" in p.stderr
    p = _run(str(DEMO), "train.batch_size=-1", cwd=tmp_path)
    assert p.returncode == 2 and "train.batch_size" in p.stderr and "HINT" in p.stderr
    p = _run(str(DEMO), "data.dataset=synthetic", "data.kwargs.colour=red", cwd=tmp_path)
    assert p.returncode == 2 and "colour" in p.stderr
    assert not (tmp_path / "runs").exists()      # refused before anything was started or written
