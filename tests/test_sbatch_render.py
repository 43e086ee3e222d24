"""The sbatch renderer is a pure function: golden files pin its exact text, and running the
rendered script with bash (a stand-in `srun` that records its argv) proves that user strings
reach the program as literal arguments and never as shell code."""

import dataclasses
import os
import stat
import subprocess
from pathlib import Path

import pytest

from ddp_hpc.backends.render import render, sbatch_options
from ddp_hpc.backends.spec import JobSpec, TaskSpec
from ddp_hpc.config import SlurmOptions

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("DDP_HPC_UPDATE_GOLDEN") == "1"


_OPTION_NAMES = {f.name for f in dataclasses.fields(SlurmOptions)}


def _spec(**kw) -> JobSpec:
    """A resolved spec; keyword arguments that name a SlurmOptions field go to its options."""
    opts = dict(job_name="demo", nodes=2, gpus_per_node=2, cpus_per_task=3, time="00:30:00",
                signal="USR2@90", max_restarts=0)   # 0: today's script (no supervisor), the goldens
    opts.update({k: kw.pop(k) for k in list(kw) if k in _OPTION_NAMES})
    base = dict(options=SlurmOptions(**opts), config="/work/jobs/demo.yaml",
                overrides=("train.epochs=2",), tasks=(TaskSpec(None, (), "/work/runs/demo-1"),),
                log_dir="/work/runs/demo-1", workdir="/work", python="/venv/bin/python")
    base.update(kw)
    return JobSpec(**base)


CASES = {
    "sbatch_basic.sh": _spec(),
    "sbatch_all_options.sh": _spec(
        partition="gpu", account="proj1", qos="high", mem="64G", constraint="a100&ib",
        exclusive=True, dependency="afterok:41", signal="USR1@120",
        sbatch_args={"mail-type": "END", "hold": True}),
    "sbatch_array.sh": _spec(
        tasks=tuple(TaskSpec(i, ov, f"/work/runs/demo-1/task{i}") for i, ov in enumerate(
            [("optim.lr=1e-3", "train.seed=0"), ("optim.lr=1e-3", "train.seed=1"),
             ("optim.lr=3e-4", "train.seed=0"), ("optim.lr=3e-4", "train.seed=1")]))),
    "sbatch_srun_args.sh": _spec(
        srun_args={"cpu-bind": "none", "container-image": "nvcr.io#nvidia/pytorch:24.01-py3",
                   "label": True, "export": "ALL,FOO=a&b"},
        container="docker://pytorch/pytorch:2.3.0-cuda12.1"),
    "sbatch_node_range.sh": _spec(nodes="1-2"),
    "sbatch_supervised.sh": _spec(
        max_restarts=3, spare_nodes=1, min_nodes=1, restart_on_error=True, stall_timeout_s=35.0,
        srun_args={"cpu-bind": "none"}),
    "sbatch_quoting.sh": _spec(
        workdir="/work/my dir", config="/work/my dir/it's.yaml",
        overrides=("name=$(touch /tmp/pwned)", "log.dir=`id`; rm -rf x", 'model.name="a b"')),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name):
    text = render(CASES[name])
    path = GOLDEN / name
    if UPDATE:
        path.write_text(text)
    assert text == path.read_text(), "render() changed; review and rerun with DDP_HPC_UPDATE_GOLDEN=1"
    assert render(CASES[name]) == text   # pure: same spec, same text


def test_one_task_per_gpu_and_preemption_options():
    opts = dict(sbatch_options(_spec(nodes=4, gpus_per_node=8, cpus_per_task=6)))
    assert opts["nodes"] == "4" and opts["ntasks-per-node"] == "8" and opts["gpus-per-node"] == "8"
    assert opts["cpus-per-task"] == "6" and opts["signal"] == "USR2@90"
    assert "requeue" in opts and opts["requeue"] is None and opts["open-mode"] == "append"
    text = render(_spec())
    assert "srun --kill-on-bad-exit=1" in text and 'rank%t.out' in text
    assert 'export SRUN_CPUS_PER_TASK="${SLURM_CPUS_PER_TASK:-3}"' in text


@pytest.mark.parametrize("given, stored", [(3, 3), ("3", 3), ("1-2", "1-2"), (" 2 - 4 ", "2-4"),
                                           ("2-2", 2)])
def test_nodes_take_a_count_or_sbatchs_range(given, stored):
    opts = SlurmOptions(nodes=given)
    assert opts.nodes == stored
    low, high = opts.node_range
    assert (low, high) == ((stored, stored) if isinstance(stored, int) else tuple(map(int, stored.split("-"))))
    assert dict(sbatch_options(_spec(nodes=given)))["nodes"] == str(stored)
    assert _spec(nodes=given).nodes == high      # the spec's node count (local backend, records): MAX


@pytest.mark.parametrize("given, words", [
    ("2-1", ["'2-1'", "1 <= MIN <= MAX", "MIN 2 and MAX 1", "HINT: write e.g. --nodes 2-2"]),
    ("0-2", ["'0-2'", "MIN 0 and MAX 2", "HINT: write e.g. --nodes 1-2"]),
    ("1-2;x", ["'1-2;x'", "a node count or a range MIN-MAX", "HINT: write e.g. --nodes 2, or --nodes 1-2"]),
    (0, ["--nodes 0 is too few"]),
])
def test_a_bad_node_range_is_refused_naming_the_value(given, words):
    from ddp_hpc.config import ConfigError
    from ddp_hpc.config.slurm_options import merged
    with pytest.raises(ConfigError) as info:
        merged(SlurmOptions(), {"nodes": given})
    for w in words:
        assert w in str(info.value)


def _fake_srun(tmp_path: Path) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    srun = bindir / "srun"
    # records its argv (one per line, NUL-free) and the exported env it matters
    srun.write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$FAKE_SRUN_OUT"\n'
                    'echo "LOG=$DDP_HPC_LOG_DIR CPUS=$SRUN_CPUS_PER_TASK OMP=$OMP_NUM_THREADS" >> "$FAKE_SRUN_OUT"\n')
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    return bindir


def _run_script(tmp_path, spec, extra_env=None):
    script = tmp_path / "job.sh"
    script.write_text(render(spec))
    out = tmp_path / "srun.argv"
    env = {"PATH": f"{_fake_srun(tmp_path)}:/usr/bin:/bin", "FAKE_SRUN_OUT": str(out),
           "SLURM_JOB_ID": "7", "SLURM_CPUS_PER_TASK": "3", **(extra_env or {})}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, cwd=tmp_path)
    return done, (out.read_text().splitlines() if out.exists() else [])


def test_rendered_script_passes_hostile_strings_literally(tmp_path):
    marker = tmp_path / "pwned"
    work = tmp_path / "my dir; touch x"
    work.mkdir()
    hostile = (f"name=$(touch {marker})", f"log.dir=`touch {marker}`", f"x='; touch {marker} #",
               'y="$HOME" \\ * ?')
    spec = _spec(workdir=str(work), config=str(work / "c.yaml"), overrides=hostile,
                 tasks=(TaskSpec(None, (), str(tmp_path / "logs dir")),),
                 log_dir=str(tmp_path / "logs dir"))
    done, argv = _run_script(tmp_path, spec)
    assert done.returncode == 0, done.stderr
    assert not marker.exists()
    assert not (work / "x").exists()
    i = argv.index("/venv/bin/python")
    assert argv[:i] == ["--kill-on-bad-exit=1", "--open-mode=append",
                        f"--output={tmp_path}/logs dir/rank%t.out"]
    assert argv[i:i + 4] == ["/venv/bin/python", "-m", "ddp_hpc.run", str(work / "c.yaml")]
    assert argv[i + 4:i + 8] == list(hostile)
    assert argv[-1] == f"LOG={tmp_path}/logs dir CPUS=3 OMP=3"     # a thread per CPU of the task
    assert (tmp_path / "logs dir").is_dir()
    done, argv = _run_script(tmp_path, spec, {"OMP_NUM_THREADS": "1"})
    assert argv[-1].endswith("CPUS=3 OMP=1")                          # the user's own setting kept


def test_rendered_array_picks_each_task(tmp_path):
    spec = CASES["sbatch_array.sh"]
    spec = _spec(tasks=tuple(TaskSpec(t.task_id, t.overrides, str(tmp_path / f"task{t.task_id}"))
                             for t in spec.tasks), log_dir=str(tmp_path), workdir=str(tmp_path))
    for task in spec.tasks:
        done, argv = _run_script(tmp_path, spec, {"SLURM_ARRAY_TASK_ID": str(task.task_id)})
        assert done.returncode == 0, done.stderr
        assert argv[-3:-1] == list(task.overrides)
        assert argv[-1].startswith(f"LOG={task.log_dir} ")
    done, _ = _run_script(tmp_path, spec, {"SLURM_ARRAY_TASK_ID": "9"})
    assert done.returncode == 2 and "no task 9" in done.stderr


def _stand_in_runtime(bindir: Path, name: str = "apptainer") -> Path:
    """A container runtime that logs its argv, then runs what follows ``exec --nv IMAGE``."""
    rt = bindir / name
    rt.write_text('#!/bin/bash\nprintf "%s\\n" "$0" "$@" > "$FAKE_RUNTIME_OUT"\nshift 3\nexec "$@"\n')
    rt.chmod(0o755)
    return rt


def test_srun_args_and_the_container_reach_srun_as_single_words(tmp_path):
    spec = _spec(srun_args={"cpu-bind": "none", "container-image": "nvcr.io#nv/pt:24.01",
                            "label": True, "export": "ALL,FOO=a&b|c"},
                 container="/images/torch.sif", log_dir=str(tmp_path), workdir=str(tmp_path),
                 tasks=(TaskSpec(None, (), str(tmp_path / "logs")),))
    bindir = _fake_srun(tmp_path)
    _stand_in_runtime(bindir, "singularity")          # the second choice, when apptainer is absent
    done, argv = _run_script(tmp_path, spec)
    assert done.returncode == 0, done.stderr
    i = argv.index("/venv/bin/python")
    assert argv[3:i] == ["--container-image=nvcr.io#nv/pt:24.01", "--cpu-bind=none",
                         "--export=ALL,FOO=a&b|c", "--label",
                         str(bindir / "singularity"), "exec", "--nv", "/images/torch.sif"]


def test_container_runs_each_rank_through_the_runtime(tmp_path):
    """srun stand-in that runs its command: the runtime logs its argv and runs the rank's command."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    srun = bindir / "srun"
    srun.write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    srun.chmod(0o755)
    _stand_in_runtime(bindir)
    spec = _spec(container="/images/torch.sif", workdir=str(tmp_path), log_dir=str(tmp_path),
                 tasks=(TaskSpec(None, (), str(tmp_path / "logs")),), python="/bin/echo")
    script = tmp_path / "job.sh"
    script.write_text(render(spec))
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "FAKE_RUNTIME_OUT": str(tmp_path / "rt.argv"),
           "SLURM_JOB_ID": "7"}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "rt.argv").read_text().splitlines()[:5] == [
        str(bindir / "apptainer"), "exec", "--nv", "/images/torch.sif", "/bin/echo"]
    assert done.stdout.splitlines()[-1] == "-m ddp_hpc.run /work/jobs/demo.yaml train.epochs=2"


def test_container_without_a_runtime_on_the_node_stops_the_script(tmp_path):
    spec = _spec(container="/images/torch.sif", workdir=str(tmp_path), log_dir=str(tmp_path),
                 tasks=(TaskSpec(None, (), str(tmp_path / "logs")),))
    done, argv = _run_script(tmp_path, spec)
    assert done.returncode == 2 and argv == []
    assert ("ddp_hpc: --container /images/torch.sif: neither apptainer nor singularity is on PATH on "
            in done.stderr)


def test_a_node_range_under_the_supervisor_goes_on_down_to_its_minimum():
    """--nodes MIN-MAX with restarts: sbatch gets the range as is, and the supervisor may go on with
    as few nodes as the job may start on (MIN) unless --min-nodes says otherwise."""
    text = render(_spec(nodes="2-4", max_restarts=2))
    assert "#SBATCH --nodes=2-4\n" in text
    assert "ddp_hpc.supervise --nodes 4 --tasks-per-node 2 --max-restarts 2 --min-nodes 2 " in text
    text = render(_spec(nodes="2-4", max_restarts=2, min_nodes=3))
    assert "--max-restarts 2 --min-nodes 3 " in text
    text = render(_spec(nodes=3, max_restarts=1, spare_nodes=1))
    assert "#SBATCH --nodes=4\n" in text and "--nodes 3 " in text


def test_the_hang_timeout_reaches_the_supervisor_and_needs_restarts():
    """--hang-timeout S (slurm.hang_timeout): the supervisor's line gets it when it is not the
    default 30 s (the default script stays as it was); without restarts it is refused."""
    assert "--hang-timeout" not in render(_spec(max_restarts=2))
    text = render(_spec(max_restarts=2, hang_timeout=12))
    assert " --hang-timeout 12 " in text
    with pytest.raises(Exception, match=r"--hang-timeout \(slurm.hang_timeout\) need restarts inside the allocation"):
        SlurmOptions(nodes=2, max_restarts=0, hang_timeout=12)
    with pytest.raises(Exception, match=r"slurm.hang_timeout -1 is negative"):
        SlurmOptions(nodes=2, max_restarts=2, hang_timeout=-1)


def test_warm_standby_reaches_the_supervisor_and_needs_restarts():
    """--warm-standby (slurm.warm_standby: true): the supervisor keeps standby ranks for restarts."""
    assert "--warm-standby" not in render(_spec(max_restarts=2))
    assert " --warm-standby " in render(_spec(max_restarts=2, warm_standby=True))
    with pytest.raises(Exception, match=r"--warm-standby \(slurm.warm_standby\) need restarts"):
        SlurmOptions(nodes=2, max_restarts=0, warm_standby=True)


def test_no_health_check_reaches_the_supervisor():
    """--no-health-check (slurm.health_check: false; HEALTH_CHECK=0 for slurm/train.sbatch): the
    supervisor starts the ranks without checking their nodes; by default it checks them."""
    import argparse

    from ddp_hpc.config.slurm_options import add_arguments, given
    assert "--no-health-check" not in render(_spec(max_restarts=2))
    assert " --no-health-check " in render(_spec(max_restarts=2, health_check=False))
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert given(vars(ap.parse_args(["--no-health-check"]))) == {"health_check": False}
    assert given(vars(ap.parse_args([]))) == {}
    assert "SUPERVISE+=(--no-health-check)" in (GOLDEN.parents[1] / "slurm" / "train.sbatch").read_text()


def test_spare_nodes_with_a_node_range_are_refused():
    with pytest.raises(Exception, match=r"--spare-nodes 1 \(slurm.spare_nodes\) with the node range --nodes 1-2"):
        SlurmOptions(nodes="1-2", max_restarts=1, spare_nodes=1)
