"""ddp_hpc.backends.checks: CPUs and memory per node against sinfo's partitions (parsed from
sinfo-shaped output by SlurmCLI, as submit gets them), on jobs/demo.yaml."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ddp_hpc.backends.checks import check_resources, partition_named, size_mb
from ddp_hpc.backends.slurmjob import check_against_cluster
from ddp_hpc.backends.spec import SpecError, build_spec
from ddp_hpc.config import load_config
from ddp_hpc.config.slurm_options import merged
from ddp_hpc.slurm.cli import SEP, SlurmCLI

DEMO = Path(__file__).resolve().parents[1] / "jobs" / "demo.yaml"

#: sinfo --exact lines (%R %P %a %l %D %T %N %G %c %m): 'debug' has 4-CPU, 4000 MB nodes with
#: 2 GPUs; 'big' mixes 16- and 64-CPU nodes; 'odd' has nodes whose size sinfo does not know
SINFO = "".join(SEP.join(row) + "\n" for row in [
    ("debug", "debug*", "up", "infinite", "4", "idle", "n[1-4]", "gpu:2", "4", "4000"),
    ("big", "big", "up", "1-00:00:00", "2", "idle", "b[1-2]", "gpu:a100:4(S:0-1)", "16", "64000"),
    ("big", "big", "up", "1-00:00:00", "1", "mixed", "b3", "gpu:a100:4(S:0-1)", "64", "256000"),
    ("odd", "odd", "up", "infinite", "2", "idle", "o[1-2]", "gpu:8", "2+", "N/A"),
])


def _partitions():
    def runner(argv, **_):
        return subprocess.CompletedProcess(argv, 0, SINFO, "")
    return SlurmCLI(runner=runner).sinfo_partitions()


def _spec(tmp_path, cli=None, overrides=()):
    cfg = load_config(DEMO, overrides)
    return build_spec(merged(cfg.slurm, cli or {}), config_path=DEMO, cfg=cfg,
                      overrides=overrides, workdir=str(tmp_path), run_id="demo-x")


def _check(spec):
    parts = _partitions()
    check_resources(spec, partition_named(parts, check_against_cluster(spec, parts)))


def test_partitions_carry_the_largest_node():
    parts = {p["name"]: p for p in _partitions()}
    assert (parts["debug"]["cpus_per_node"], parts["debug"]["mem_per_node_mb"]) == (4, 4000)
    assert (parts["big"]["cpus_per_node"], parts["big"]["mem_per_node_mb"]) == (64, 256000)
    assert (parts["odd"]["cpus_per_node"], parts["odd"]["mem_per_node_mb"]) == (0, 0)


def test_what_fits_passes(tmp_path):
    _check(_spec(tmp_path, {"gpus_per_node": 2}, ["data.num_workers=1"]))        # 2 x 2 = 4
    _check(_spec(tmp_path, {"gpus_per_node": 2, "cpus_per_task": 2, "mem": "4000M"}))
    _check(_spec(tmp_path, {"gpus_per_node": 4, "cpus_per_task": 16, "partition": "big",
                            "mem": "250G"}))                 # fits the 64-CPU node only
    _check(_spec(tmp_path, {"mem": "0"}))                    # 0: all of the node's memory


def test_default_cpus_per_task_too_many_for_the_nodes(tmp_path):
    spec = _spec(tmp_path, {"gpus_per_node": 2}, ["data.num_workers=2"])
    assert spec.cpus_per_task == 3
    with pytest.raises(SpecError) as e:
        _check(spec)
    assert e.value.problem.startswith(
        "3 CPUs per task x 2 tasks per node = 6 CPUs, but the nodes of partition 'debug' have 4 "
        "(sinfo)")
    assert "--cpus-per-task 2 (the most that fits 2 tasks on a 4-CPU node)" in e.value.hint
    assert "fewer tasks per node (--gpus)" in e.value.hint
    assert "data.num_workers + 1" in e.value.hint


def test_one_task_with_too_many_cpus(tmp_path):
    with pytest.raises(SpecError) as e:
        _check(_spec(tmp_path, {"cpus_per_task": 65, "partition": "big"}))
    assert e.value.problem.startswith("65 CPUs per task x 1 task per node = 65 CPUs, but the "
                                      "nodes of partition 'big' have 64 (sinfo)")
    assert "--cpus-per-task 64 (the most that fits 1 task on a 64-CPU node)" in e.value.hint


def test_more_tasks_than_cpus_asks_for_fewer_gpus(tmp_path):
    parts = [{"name": "tiny", "default": True, "nodes": 2, "gpus_per_node": 8,
              "cpus_per_node": 4, "mem_per_node_mb": 0}]
    spec = _spec(tmp_path, {"gpus_per_node": 8, "cpus_per_task": 1})
    with pytest.raises(SpecError) as e:
        check_resources(spec, partition_named(parts, check_against_cluster(spec, parts)))
    assert "1 CPU per task x 8 tasks per node = 8 CPUs" in e.value.problem
    assert e.value.hint.startswith("use --gpus 4 or fewer")


def test_memory_per_node(tmp_path):
    with pytest.raises(SpecError) as e:
        _check(_spec(tmp_path, {"mem": "8G"}))
    assert e.value.problem.startswith("--mem 8G (8192 MB per node) is more than the nodes of "
                                      "partition 'debug' have: 4000 MB (sinfo)")
    assert e.value.hint == "use --mem 4000M or less, or --mem 0 for all of a node's memory"
    with pytest.raises(SpecError, match=r"--mem 1T \(1048576 MB per node\) .* 'big' have: 256000 MB"):
        _check(_spec(tmp_path, {"mem": "1T", "partition": "big"}))


def test_memory_per_cpu_and_per_gpu_from_sbatch_args(tmp_path):
    spec = _spec(tmp_path, {"cpus_per_task": 2, "gpus_per_node": 2,
                            "sbatch_args": {"mem-per-cpu": "2G"}})
    with pytest.raises(SpecError) as e:
        _check(spec)
    assert e.value.problem.startswith("mem-per-cpu=2G x 4 CPUs per node = 8192 MB per node is "
                                      "more than the nodes of partition 'debug' have: 4000 MB")
    assert e.value.hint == "use --sbatch-arg mem-per-cpu=1000M or less, or --mem instead"
    with pytest.raises(SpecError, match="mem-per-gpu=3000M x 2 GPUs per node = 6000 MB per node"):
        _check(_spec(tmp_path, {"gpus_per_node": 2, "cpus_per_task": 1,
                                "sbatch_args": {"mem-per-gpu": "3000M"}}))


def test_unknown_sizes_skip_the_checks(tmp_path):
    _check(_spec(tmp_path, {"partition": "odd", "cpus_per_task": 100, "mem": "1T"}))
    bare = {"name": "debug", "default": True, "nodes": 1, "gpus_per_node": 1}   # older rows
    check_resources(_spec(tmp_path, {"cpus_per_task": 100, "mem": "1T"}), bare)


def test_partition_named_and_size_mb():
    parts = _partitions()
    assert partition_named(parts, "big")["nodes"] == 3
    with pytest.raises(SpecError, match="partition 'gpu' is not in sinfo's list"):
        partition_named(parts, "gpu")
    assert [size_mb(t) for t in ("4000", "4000M", "8g", "1T", "512K", "1K", 0)] == [
        4000, 4000, 8192, 1048576, 1, 1, 0]
    assert [size_mb(t) for t in (None, True, "4GB", "", "-1")] == [None, None, None, None, None]
