"""ddp_hpc.config.validate.validate_job: what a job would fail on at its start, refused before it
queues, on jobs/demo.yaml with overrides."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ddp_hpc import backends
from ddp_hpc.config import ConfigError, load_config
from ddp_hpc.config import validate as validate_mod
from ddp_hpc.config.validate import validate_job

DEMO = Path(__file__).resolve().parents[1] / "jobs" / "demo.yaml"


def _validate(tmp_path, *overrides, backend="submitit", create=True):
    validate_job(load_config(DEMO, list(overrides)), backend=backends.get(backend), workdir=str(tmp_path),
                 create_log_dir=create)


def _refused(tmp_path, *overrides, backend="submitit", create=True) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        _validate(tmp_path, *overrides, backend=backend, create=create)
    return e.value


@pytest.fixture
def user_module(tmp_path):
    """A module of the job's working directory (not on this process's sys.path)."""
    (tmp_path / "vjob_factories.py").write_text(
        "import torch\n"
        "def make_model(**kw):\n    return torch.nn.Linear(2, 2)\n"
        "class Data:\n    pass\n"
        "class Nested:\n    build = staticmethod(make_model)\n"
        "CONSTANT = 3\n")
    (tmp_path / "vjob_broken.py").write_text("raise ValueError('no GPU here')\n")
    yield tmp_path
    for name in ("vjob_factories", "vjob_broken"):
        sys.modules.pop(name, None)


def test_the_demo_job_passes_and_creates_log_dir(tmp_path):
    _validate(tmp_path)
    assert (tmp_path / "runs").is_dir()
    assert str(tmp_path) not in sys.path


def test_factories_from_the_working_directory(user_module):
    _validate(user_module, "model.name=vjob_factories:make_model", "data.dataset=vjob_factories:Data",
              "data.eval_dataset=vjob_factories:Nested.build", "train.loss=vjob_factories:make_model")
    assert str(user_module) not in sys.path


def test_model_module_that_does_not_import(tmp_path):
    e = _refused(tmp_path, "model.name=foo.bar:baz")
    assert e.problem.startswith("cannot import module 'foo.bar' (model.name=foo.bar:baz): "
                                "No module named 'foo'")
    assert e.hint == (f"check the spelling, and that the module is installed or importable from "
                      f"the job's working directory {tmp_path} (or PYTHONPATH)")


def test_module_that_raises_while_importing(user_module):
    e = _refused(user_module, "data.dataset=vjob_broken:make")
    assert e.problem == ("importing module 'vjob_broken' (data.dataset=vjob_broken:make) raised "
                         "ValueError: no GPU here")
    assert e.hint == "fix the error in vjob_broken"


def test_missing_attribute_and_not_callable(user_module):
    e = _refused(user_module, "data.eval_dataset=vjob_factories:make_data")
    assert e.problem == ("module 'vjob_factories' has no attribute 'make_data' "
                         "(data.eval_dataset=vjob_factories:make_data)")
    assert e.hint == "name a class or function defined in vjob_factories"
    e = _refused(user_module, "model.name=vjob_factories:CONSTANT")
    assert e.problem == "model.name=vjob_factories:CONSTANT is not callable: it is 3 (int)"
    assert e.hint == "name a class or a function that returns the object"


def test_unknown_builtin_names(tmp_path):
    e = _refused(tmp_path, "model.name=mlpp")
    assert e.problem == "model.name=mlpp is neither a built-in nor an import path"
    assert e.hint == "use one of linear, mlp, small_cnn or 'pkg.module:factory'"
    e = _refused(tmp_path, "data.dataset=cifar")
    assert e.problem == "data.dataset=cifar is neither a built-in nor an import path"


def test_io_lmdb_needs_lmdb_path(tmp_path):
    e = _refused(tmp_path, "data.io=lmdb")
    assert e.problem == "data.io=lmdb needs data.lmdb_path, which is not set"
    assert e.hint == ("pack the dataset once (python -m ddp_hpc.data pack SRC OUT.lmdb) and set "
                      "data.lmdb_path=OUT.lmdb")
    _validate(tmp_path, "data.io=stage")           # stage and broadcast can use the dataset
    _validate(tmp_path, "data.io=broadcast")


@pytest.mark.parametrize("io", ["lmdb", "stage", "broadcast"])
def test_lmdb_path_that_does_not_exist(tmp_path, io):
    e = _refused(tmp_path, f"data.io={io}", "data.lmdb_path=/x")
    assert e.problem == f"data.lmdb_path=/x does not exist; data.io={io} reads it"
    assert e.hint.startswith("fix the path (relative paths start in the job's working "
                             "directory), or pack the dataset once")
    assert "not an LMDB" not in str(e)


def test_relative_lmdb_path_is_from_the_working_directory(tmp_path):
    e = _refused(tmp_path, "data.io=lmdb", "data.lmdb_path=data/train.lmdb")
    assert e.problem == (f"data.lmdb_path=data/train.lmdb does not exist (from {tmp_path}: "
                         f"{tmp_path}/data/train.lmdb); data.io=lmdb reads it")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.lmdb").write_bytes(b"")   # existence only: not opened here
    _validate(tmp_path, "data.io=lmdb", "data.lmdb_path=data/train.lmdb")
    _validate(tmp_path, "data.io=direct", "data.lmdb_path=/x")   # not read by io=direct


def test_fp16_on_the_local_backend_without_cuda(tmp_path, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    e = _refused(tmp_path, "train.precision=fp16", backend="local")
    assert e.problem == ("train.precision=fp16 needs CUDA (GradScaler), but the local backend "
                         "would run the job on CPU (torch.cuda.is_available() is False here)")
    assert e.hint == "use train.precision=fp32, or train.precision=bf16 (it works on CPU)"
    _validate(tmp_path, "train.precision=bf16", backend="local")
    _validate(tmp_path, "train.precision=fp16", backend="submitit")   # the nodes have GPUs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _validate(tmp_path, "train.precision=fp16", backend="local")


def test_log_dir_that_cannot_be_created(tmp_path):
    e = _refused(tmp_path, "log.dir=/proc/x")
    assert e.problem == "log.dir=/proc/x cannot be created (/proc/x): No such file or directory"
    assert e.hint == ("set log.dir to a directory you can write that every node sees, e.g. "
                      "-- log.dir=/scratch/$USER/runs")
    (tmp_path / "afile").write_text("")
    e = _refused(tmp_path, "log.dir=afile/runs")
    assert e.problem.startswith(f"log.dir=afile/runs cannot be created ({tmp_path}/afile/runs): ")


def test_log_dir_that_is_not_writable(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    monkeypatch.setattr(validate_mod.os, "access", lambda p, mode: Path(p) != ro)  # root writes anywhere
    e = _refused(tmp_path, "log.dir=ro")
    assert e.problem == f"log.dir=ro is not writable ({ro})"
    e = _refused(tmp_path, "log.dir=ro/a/b", create=False)
    assert e.problem == f"log.dir=ro/a/b cannot be created: {ro} is not writable ({ro}/a/b)"
    assert not (ro / "a").exists()


def test_dry_run_checks_log_dir_without_creating_it(tmp_path):
    _validate(tmp_path, "log.dir=a/b/c", create=False)
    assert not (tmp_path / "a").exists()
    (tmp_path / "afile").write_text("")
    e = _refused(tmp_path, "log.dir=afile/runs", create=False)
    assert e.problem == (f"log.dir=afile/runs cannot be created ({tmp_path}/afile/runs): "
                         f"{tmp_path}/afile is not a directory")
    assert e.hint.startswith("set log.dir to a directory you can write")


def _nodes(tmp_path, slurm: dict, *overrides, backend="sbatch"):
    from ddp_hpc.config import SlurmOptions
    cfg = load_config(DEMO, list(overrides))
    validate_job(cfg, backend=backends.get(backend), workdir=str(tmp_path), create_log_dir=False,
                 slurm=SlurmOptions(**{"gpus_per_node": 2, "max_restarts": 2, **slurm}))


def test_every_node_count_of_min_nodes_must_keep_the_global_batch(tmp_path):
    """3 nodes x 2 ranks x batch 16 = global batch 96; on 2 nodes 96 / (4 x 16) is no integer, so
    the supervisor's shrink would fail at the resume: refused before the job queues."""
    with pytest.raises(ConfigError) as e:
        _nodes(tmp_path, {"nodes": 3, "min_nodes": 2}, "train.batch_size=16")
    text = str(e.value)
    assert text.startswith("--nodes 3 --min-nodes 2 (slurm.nodes, slurm.min_nodes): ") and "HINT: " in text
    assert ("2 nodes after starting on 3 (global batch 96 is not a multiple of per-rank batch 16 x 4 ranks)"
            in text), text
    assert "set train.allow_batch_size_change=true" in text and "train.allow_global_batch_change=true" in text
    assert text.endswith("allow only the node counts that keep it (3)")
    with pytest.raises(ConfigError) as e:
        _nodes(tmp_path, {"nodes": 3, "min_nodes": 1}, "train.batch_size=16")
    assert "1 nodes" not in str(e.value)                # 96 / (2 x 16) = 3 keeps it: not named
    assert "2 nodes after starting on 3" in str(e.value) and "keep it (1, 3)" in str(e.value)
    # each setting it names lets the job through; so does a batch that every count keeps
    _nodes(tmp_path, {"nodes": 3, "min_nodes": 2}, "train.batch_size=16", "train.allow_batch_size_change=true")
    _nodes(tmp_path, {"nodes": 3, "min_nodes": 2}, "train.batch_size=16", "train.allow_global_batch_change=true")
    _nodes(tmp_path, {"nodes": 3, "min_nodes": 2}, "train.batch_size=16", "train.grad_accum=2")
    _nodes(tmp_path, {"nodes": 2, "min_nodes": 1}, "train.batch_size=16")   # 64 on 1 node: accumulation 2


def test_a_node_range_goes_on_down_to_its_min_and_only_the_supervisor_is_checked(tmp_path):
    with pytest.raises(ConfigError) as e:          # started on 3 nodes (global 96), down to 2 (4 ranks)
        _nodes(tmp_path, {"nodes": "2-3"}, "train.batch_size=16")
    text = str(e.value)
    assert "--nodes 2-3 (slurm.nodes)" in text and "2 nodes after starting on 3 (global batch 96" in text
    assert "after starting on 2" not in text        # a start on 2 never grows inside its allocation
    _nodes(tmp_path, {"nodes": "2-3"}, "train.batch_size=16", backend="local")   # runs 3, never fewer
    _nodes(tmp_path, {"nodes": "2-3", "max_restarts": 0}, "train.batch_size=16")  # no supervisor
    _nodes(tmp_path, {"nodes": 3}, "train.batch_size=16")                        # one count: nothing to keep
    # the config's own slurm: section is checked when no options are given
    with pytest.raises(ConfigError, match="--min-nodes 2"):
        validate_job(load_config(DEMO, ["train.batch_size=16", "slurm.nodes=3", "slurm.min_nodes=2",
                                        "slurm.gpus_per_node=2"]),
                     backend=backends.get("sbatch"), workdir=str(tmp_path), create_log_dir=False)


def test_submit_refuses_min_nodes_the_batch_cannot_shrink_to(tmp_path):
    import os
    import subprocess
    env = {**os.environ, "DDP_HPC_HOME": str(tmp_path / "home"), "PATH": os.path.dirname(sys.executable)}
    p = subprocess.run([sys.executable, "-m", "ddp_hpc.submit", "--backend", "sbatch", "--dry-run", "-N", "3",
                        "-G", "2", "--min-nodes", "2", str(DEMO), "train.batch_size=16"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "--nodes 3 --min-nodes 2" in p.stderr and "2 nodes after starting on 3" in p.stderr, p.stderr
    assert "HINT: set train.allow_batch_size_change=true" in p.stderr, p.stderr


def test_the_builtin_names_the_check_knows_are_the_objects_the_job_builds():
    from ddp_hpc.examples import DATASET_NAMES, MODEL_NAMES
    from ddp_hpc.examples.models import BUILTIN_MODELS
    from ddp_hpc.examples.synthetic import BUILTIN_DATASETS

    assert sorted(MODEL_NAMES) == sorted(BUILTIN_MODELS)
    assert sorted(DATASET_NAMES) == sorted(BUILTIN_DATASETS)


def test_checking_a_job_before_submit_does_not_import_torch(tmp_path):
    """`ddp-hpc submit` runs on a login node and in every test that submits: torch's import
    (~1.7 s of CPU) is paid by the ranks, not by the check of their config."""
    import os
    import subprocess

    code = ("import sys, runpy\n"
            f"sys.argv = ['submit', '--backend', 'local', '--dry-run', '-N', '2', '-G', '2', {str(DEMO)!r}]\n"
            "try:\n    runpy.run_module('ddp_hpc.submit', run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "print('torch' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1] == "False", p.stdout + p.stderr
