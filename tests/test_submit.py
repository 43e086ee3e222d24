"""ddp_hpc.submit without a cluster: option merging and validation, sweeps, backend choice,
SLURM_* cleaning, pre-submit checks against sinfo's answer, injection refusals, dry runs.
(Runs against a cluster live in tests/cluster/test_submit_cluster.py; the local backend
end-to-end in tests/test_submit_local.py.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_hpc import backends
from ddp_hpc.backends.base import clean_slurm_env
from ddp_hpc.backends.slurmjob import check_against_cluster, submitit_parameters
from ddp_hpc.backends.spec import SpecError, build_spec, parse_sweeps, sweep_tasks
from ddp_hpc.config import ConfigError, SlurmOptions, load_config, parse_signal, time_to_seconds
from ddp_hpc.config.slurm_options import merged
from ddp_hpc.errors import HintError
from ddp_hpc.slurm.cli import SlurmCLI
from ddp_hpc.submit import cli as submit

PY = sys.executable


@pytest.fixture
def job(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("name: demo\ndata: {num_workers: 3}\nlog: {dir: logs}\n"
                   "slurm:\n  nodes: 3\n  time: '00:20:00'\n  partition: yamlpart\n"
                   "  sbatch_args: {mail-type: END}\n")
    return cfg


def _spec(cfgpath, cli=None, overrides=(), sweeps=(), workdir=None):
    cfg = load_config(cfgpath, overrides)
    opts = merged(cfg.slurm, cli or {})
    return build_spec(opts, config_path=cfgpath, cfg=cfg, overrides=overrides,
                      sweeps=parse_sweeps(sweeps), workdir=workdir or str(cfgpath.parent),
                      run_id="demo-x")


def test_yaml_section_then_command_line_wins(job, tmp_path):
    s = _spec(job)
    assert (s.nodes, s.gpus_per_node, s.time, s.partition) == (3, 1, "00:20:00", "yamlpart")
    assert s.cpus_per_task == 4                         # data.num_workers + 1
    assert s.options.sbatch_args == {"mail-type": "END"}
    s = _spec(job, {"nodes": 2, "gpus_per_node": 4, "partition": "cli", "cpus_per_task": 7,
                    "sbatch_args": {"mail-type": "FAIL", "hold": True}})
    assert (s.nodes, s.gpus_per_node, s.partition, s.cpus_per_task) == (2, 4, "cli", 7)
    assert s.options.sbatch_args == {"hold": True, "mail-type": "FAIL"}
    assert s.log_dir == str(tmp_path / "logs" / "demo-x") and s.config == str(job)
    assert s.world_size == 8 and not s.is_array


def test_unknown_slurm_key_lists_valid_ones(tmp_path):
    cfg = tmp_path / "j.yaml"
    cfg.write_text("slurm: {nodse: 2}\n")
    with pytest.raises(ConfigError) as e:
        _spec(cfg)
    assert "unknown config key 'slurm.nodse'" in str(e.value) and str(cfg) in str(e.value)
    assert "HINT: valid keys in slurm are: account, backend, constraint" in str(e.value)
    assert "slurm.sbatch_args or --sbatch-arg KEY=VALUE" in str(e.value)


@pytest.mark.parametrize("yaml_line, needle", [
    ("nodes: 0", "slurm.nodes 0 is too few: at least 1 is needed"),
    ("time: 2 hours", "slurm.time '2 hours' is not a Slurm time"),
    ("partition: 'a b'", "slurm.partition 'a b' contains characters"),
    ("exclusive: 1", "slurm.exclusive must be true or false"),
    ("sbatch_args: {gres: 'gpu:2'}", "sbatch option 'gres' is set by ddp_hpc itself"),
])
def test_bad_yaml_slurm_values_name_key_file_and_fix(tmp_path, yaml_line, needle):
    cfg = tmp_path / "j.yaml"
    cfg.write_text(f"slurm:\n  {yaml_line}\n")
    with pytest.raises(ConfigError) as e:
        _spec(cfg)
    assert needle in str(e.value) and str(cfg) in str(e.value) and "HINT:" in str(e.value)


def test_yaml_numbers_for_string_options_and_cli_flags_from_one_dataclass(tmp_path):
    cfg = tmp_path / "j.yaml"
    cfg.write_text("slurm: {time: 30, nodes: 2}\n")
    s = _spec(cfg)
    assert (s.time, s.nodes) == ("30", 2)
    args, config, overrides = submit.parse_args(
        ["-p", "gpu", "-A", "proj", "-q", "high", "--gpus-per-node", "4", "-N", "2", str(cfg)])
    assert submit.slurm_options.given(vars(args)) == {"partition": "gpu", "account": "proj",
                                                "qos": "high", "gpus_per_node": 4, "nodes": 2}
    assert config == str(cfg) and overrides == []
    assert submit.parse_args(["-G", "3"])[0].gpus_per_node == 3
    assert submit.parse_args(["--gpus", "3"])[0].gpus_per_node == 3


@pytest.mark.parametrize("cli, needle", [
    ({"nodes": 0}, "--nodes 0 is too few"),
    ({"gpus_per_node": -1}, "--gpus -1 is too few"),
    ({"time": "2 hours"}, "'2 hours' is not a Slurm time"),
    ({"signal": "USR9@10"}, "'USR9@10' is not a signal name"),
    ({"signal": "USR2@7200", "time": "01:00:00"}, "not shorter than the time limit"),
    ({"job_name": "x'; touch /tmp/pwned #"}, "--job-name \"x'; touch /tmp/pwned #\""),
    ({"partition": "a b"}, "partition 'a b'"),
    ({"mem": "lots"}, "mem 'lots'"),
    ({"dependency": "afterok:1;rm"}, "dependency 'afterok:1;rm'"),
    ({"sbatch_args": {"output": "/x"}}, "set by ddp_hpc itself"),
    ({"sbatch_args": {"ntasks-per-node": "1"}}, "use --gpus (one task per GPU)"),
    ({"sbatch_args": {"comment": "a\nb"}}, "value of sbatch option comment"),
    ({"sbatch_args": {"comment": "$(id)"}}, "value of sbatch option comment"),
    ({"sbatch_args": {"Bad_Key": "1"}}, "sbatch option name 'Bad_Key'"),
    ({"backend": "k8s;rm"}, "backend 'k8s;rm'"),      # an unknown plain name: backends.get refuses it
])
def test_bad_requests_name_value_and_fix(job, cli, needle):
    with pytest.raises(HintError) as e:      # ConfigError (one value) or SpecError (the request)
        _spec(job, cli)
    assert needle in str(e.value) and "HINT:" in str(e.value)


def test_time_and_signal_formats():
    assert [time_to_seconds(t) for t in ("30", "1:30", "01:00:00", "2-00", "1-02:03", "1-00:00:05")] == \
        [1800, 90, 3600, 2 * 86400, 86400 + 7200 + 180, 86405]
    assert parse_signal("SIGUSR1@120") == ("USR1", 120) and parse_signal("usr2") == ("USR2", 90)


def test_signal_other_than_config_becomes_an_override(job):
    s = _spec(job, {"signal": "USR1@60"})
    assert (s.signal, s.grace_s) == ("USR1", 60) and "preempt.signal=USR1" in s.overrides
    assert "preempt.signal=USR1" not in _spec(job, {"signal": "USR2@60"}).overrides


def test_sweep_is_one_array_with_product_overrides(job, tmp_path):
    s = _spec(job, overrides=("train.epochs=1",), sweeps=["optim.lr=1e-3,3e-4", "train.seed=0,1"])
    assert s.is_array and [t.task_id for t in s.tasks] == [0, 1, 2, 3]
    assert [t.overrides for t in s.tasks] == [
        ("optim.lr=1e-3", "train.seed=0"), ("optim.lr=1e-3", "train.seed=1"),
        ("optim.lr=3e-4", "train.seed=0"), ("optim.lr=3e-4", "train.seed=1")]
    assert [t.log_dir for t in s.tasks] == [str(tmp_path / "logs" / "demo-x" / f"task{i}") for i in range(4)]
    assert s.task_argv(s.tasks[3])[-3:] == ["train.epochs=1", "optim.lr=3e-4", "train.seed=1"]
    for bad in (["lr"], ["lr="], ["a b=1,2"], ["x=1,,2"]):
        with pytest.raises(SpecError):
            parse_sweeps(bad)
    assert sweep_tasks([]) == []


def test_log_dir_with_blanks_refused(job):
    with pytest.raises(HintError, match="log directory"):
        _spec(job, overrides=("log.dir=/tmp/a b",))


def test_clean_slurm_env_keeps_only_slurm_conf():
    env = {"SLURM_JOB_ID": "5", "SLURM_MEM_PER_NODE": "100", "SLURM_CONF": "/etc/s.conf",
           "SRUN_CPUS_PER_TASK": "4", "SBATCH_ACCOUNT": "a", "PATH": "/bin"}
    clean, removed = clean_slurm_env(env)
    assert clean == {"SLURM_CONF": "/etc/s.conf", "SBATCH_ACCOUNT": "a", "PATH": "/bin"}
    assert removed == ["SLURM_JOB_ID", "SLURM_MEM_PER_NODE", "SRUN_CPUS_PER_TASK"]


PARTS = [{"name": "debug", "default": True, "nodes": 4, "gpus_per_node": 4},
         {"name": "big", "default": False, "nodes": 2, "gpus_per_node": 8},
         {"name": "cpu", "default": False, "nodes": 8, "gpus_per_node": 0}]


def test_checks_against_sinfo(job):
    assert check_against_cluster(_spec(job, {"partition": "big", "gpus_per_node": 8, "nodes": 2}), PARTS) == "big"
    s = _spec(job, {"gpus_per_node": 4})
    assert check_against_cluster(build_like(s, partition=None), PARTS) == "debug"
    with pytest.raises(SpecError) as e:
        check_against_cluster(_spec(job, {"partition": "gpuz"}), PARTS)
    assert "'gpuz' does not exist" in str(e.value) and "debug, big, cpu" in str(e.value)
    with pytest.raises(SpecError) as e:
        check_against_cluster(build_like(_spec(job, {"gpus_per_node": 5}), partition=None), PARTS)
    assert "--gpus 5" in str(e.value) and "at most 4" in str(e.value) and "big (8 GPUs)" in str(e.value)
    with pytest.raises(SpecError, match="--nodes 3 is more than partition 'big'"):
        check_against_cluster(_spec(job, {"partition": "big"}), PARTS)


def build_like(spec, **kw):
    import dataclasses
    return dataclasses.replace(spec, options=dataclasses.replace(spec.options, **kw))


def test_submitit_parameters(job):
    s = _spec(job, {"gpus_per_node": 2, "exclusive": True})
    p = submitit_parameters(s)
    assert (p["nodes"], p["ntasks_per_node"], p["gpus_per_node"], p["cpus_per_task"]) == (3, 2, 2, 4)
    assert p["additional_parameters"]["signal"] == "USR2@90" and p["additional_parameters"]["requeue"] is True
    assert p["additional_parameters"]["time"] == "00:20:00" and p["exclusive"] is True
    assert "--kill-on-bad-exit=1" in p["srun_args"] and f"--output={s.log_dir}/rank%t.out" in p["srun_args"]
    assert "export SRUN_CPUS_PER_TASK=4" in p["setup"]
    assert 'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"' in p["setup"]
    # submitit accepts every key (it refuses unknown ones against its own signature)
    import submitit
    ex = submitit.SlurmExecutor(folder=s.log_dir)
    ex.update_parameters(**p)


class _NoCluster(SlurmCLI):
    def __init__(self, have_sbatch):
        super().__init__(env={"PATH": "/nonexistent"})
        self.have = have_sbatch

    def available(self):
        return self.have


def test_auto_backend_says_why(tmp_path):
    b, why = backends.choose(SlurmOptions(backend="sbatch"))
    assert (b.name, why) == ("sbatch", "asked for with --backend")
    b, why = backends.choose(SlurmOptions(), _NoCluster(False))
    assert b.name == "local" and "no `sbatch` on PATH" in why
    # sbatch "installed" but the controller cannot be asked (sinfo is not found here)
    b, why = backends.choose(SlurmOptions(), _NoCluster(True))
    assert b.name == "local" and "no Slurm controller answered" in why


def _cli(args, cwd, env=None, **kw):
    e = {**os.environ, "DDP_HPC_HOME": str(cwd / "home"), **(env or {})}
    return subprocess.run([PY, "-m", "ddp_hpc.submit", *args], cwd=cwd, env=e,
                          capture_output=True, text=True, timeout=120, **kw)


def test_cli_errors_before_submitting(job, tmp_path):
    for args, needle in [
        (["--nodes", "0", str(job)], "--nodes 0 is too few: at least 1 is needed\nHINT: use 1"),
        ([str(job), "trian.epochs=2"], "unknown config key 'trian'"),
        ([str(job), str(job)], f"override {str(job)!r} is not of the form key=value"),
        ([str(job), "--", "trian.epochs=2"], "unknown config key 'trian'"),
        ([str(job), "--sweep", "optim.lr=0.1,fast"], "optim.lr"),
        ([str(job), "--job-name", "x'; touch /tmp/pwned #"], "--job-name \"x'; touch"),
        ([str(tmp_path / "missing.yaml")], "does not exist"),
        ([str(job), "--backend", "sbatch"], "`sbatch` is not on PATH"),
    ]:
        p = _cli(args, tmp_path, env={"PATH": os.path.dirname(PY)})
        assert p.returncode == 2, (args, p.stdout, p.stderr)
        assert needle in p.stderr and "HINT:" in p.stderr, (args, p.stderr)
        assert p.stderr.count(": error: ") == 1, p.stderr
    assert not (tmp_path / "home").exists() and not (tmp_path / "logs").exists()


def test_cli_dry_run_sbatch_prints_script_and_submits_nothing(job, tmp_path):
    p = _cli(["--backend", "sbatch", "--dry-run", "--nodes", "2", "--gpus", "2", str(job),
              "--", "name=$(touch /tmp/pwned)"], tmp_path, env={"PATH": os.path.dirname(PY)})
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("#!/bin/bash") and "#SBATCH --ntasks-per-node=2" in p.stdout
    assert "'name=$(touch /tmp/pwned)'" in p.stdout and "partition and GPU checks skipped" in p.stderr
    assert not (tmp_path / "home").exists() and not (tmp_path / "logs").exists()


def test_cli_dry_run_submitit_and_local(job, tmp_path):
    p = _cli(["--backend", "submitit", "--dry-run", str(job), "--sweep", "train.seed=0,1"],
             tmp_path, env={"PATH": os.path.dirname(PY)})
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["folder"].endswith("/submitit")         # submitit's *.pkl files in a subfolder
    assert out["parameters"]["nodes"] == 3 and [c["args"][1] for c in out["calls"]] == [
        ["train.seed=0"], ["train.seed=1"]]
    p = _cli(["--dry-run", "--nodes", "2", "--gpus", "2", str(job)], tmp_path,
             env={"PATH": os.path.dirname(PY)})
    assert p.returncode == 0 and "backend local: no `sbatch` on PATH" in p.stderr
    assert "--nodes 2 --procs-per-node 2" in p.stdout
    assert not (tmp_path / "home").exists() and not (tmp_path / "logs").exists()


class _Cluster:
    def available(self):
        return True

    def sinfo_partitions(self):
        return [{"name": "gpu", "nodes": 2, "gpus_per_node": 2}]


def test_a_node_range_goes_to_sbatch_and_the_local_backend_runs_max(job, tmp_path, monkeypatch, capsys):
    # (the rendered #SBATCH --nodes=1-2: tests/golden/sbatch_node_range.sh)
    monkeypatch.setenv("PATH", os.path.dirname(PY))
    monkeypatch.setenv("DDP_HPC_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert submit.main(["--backend", "local", "--dry-run", "--nodes", "1-2", str(job)]) == 0
    out, err = capsys.readouterr()
    assert "--nodes 1-2: the local backend runs the most, 2 pretend nodes" in err
    assert "--nodes 2 --procs-per-node 1" in out
    assert submit.main(["--backend", "submitit", "--dry-run", "--nodes", "1-2", str(job)]) == 2
    err = capsys.readouterr().err
    assert "--nodes 1-2 is a range, which the submitit backend cannot take" in err
    assert "HINT: use --backend sbatch (or auto)" in err
    opts = merged(load_config(job).slurm, {"nodes": "1-2"})
    assert submit._backend(opts, client=_Cluster()).name == "sbatch"     # auto would pick submitit for a count
    assert submit._backend(merged(opts, {"nodes": 2}), client=_Cluster()).name == "submitit"
    # the record keeps MAX as its nodes and MIN beside it (status shows the range); the local
    # backend's runs MAX, no range
    from ddp_hpc.backends.base import record
    sbatch, local = backends.get("sbatch"), backends.get("local")
    spec = build_spec(opts, config_path=job, cfg=load_config(job), overrides=[])
    assert (record(spec, "55", sbatch, "c").nodes, record(spec, "55", sbatch, "c").min_nodes) == (2, 1)
    assert record(spec, "local-x", local, "c").min_nodes is None
    assert record(build_spec(merged(opts, {"nodes": 2}), config_path=job, cfg=load_config(job), overrides=[]),
                  "56", sbatch, "c").min_nodes is None


def _write_events(d: Path, rank: int, events):
    d.mkdir(parents=True, exist_ok=True)
    with open(d / f"rank{rank}.events.jsonl", "w") as f:
        for e in events:
            f.write(json.dumps({"rank": rank, **e}) + "\n")
        f.write('{"half a line')          # a writer mid-flush must not break the reader


def test_run_verdict_and_progress_from_run_logs(tmp_path):
    from ddp_hpc.backends.wait import latest_step, run_verdict, world_that_ran
    d = tmp_path / "run"
    _write_events(d, 0, [{"event": "start"}, {"event": "step", "step": 5, "total_steps": 9, "loss": 0.5},
                         {"event": "end", "status": "completed", "step": 9}])
    _write_events(d, 1, [{"event": "start"}, {"event": "step", "step": 5, "total_steps": 9, "loss": 0.5}])
    ok, why = run_verdict(d, 3)
    assert not ok and "no end event from ranks [1, 2]" in why
    _write_events(d, 1, [{"event": "end", "status": "failed", "step": 5}])
    _write_events(d, 2, [{"event": "end", "status": "completed", "step": 9}])
    ok, why = run_verdict(d, 3)
    assert not ok and "rank 1: failed" in why
    _write_events(d, 1, [{"event": "end", "status": "completed", "step": 9}])
    assert run_verdict(d, 3) == (True, "all 3 ranks completed")
    assert latest_step([d]) == "step 9/? (completed)"
    _write_events(d, 0, [{"event": "step", "step": 5, "total_steps": 9, "loss": 0.5}])
    assert latest_step([d, tmp_path / "nothing"]) == "run step 5/9 loss 0.5"
    # a node range MIN-MAX is judged on the world size of rank 0's newest start event
    assert world_that_ran(d, 8) == 8 and world_that_ran(tmp_path / "nothing", 8) == 8
    _write_events(d, 0, [{"event": "start", "world_size": 4}, {"event": "start", "world_size": 2},
                         {"event": "step", "step": 1}])
    assert world_that_ran(d, 8) == 2


def test_overrides_without_double_dash_are_accepted(job, tmp_path):
    args, config, overrides = submit.parse_args(
        [str(job), "train.epochs=2", "--wait", "optim.lr=0.1", "--", "train.seed=3"])
    assert config == str(job) and args.wait
    assert overrides == ["train.epochs=2", "optim.lr=0.1", "train.seed=3"]
    _, config, overrides = submit.parse_args(["train.epochs=2"])     # no config: the default one
    assert config == submit.DEFAULT_CONFIG and overrides == ["train.epochs=2"]
    p = _cli(["--backend", "sbatch", "--dry-run", str(job), "train.epochs=2", "--", "optim.lr=0.5"],
             tmp_path, env={"PATH": os.path.dirname(PY)})
    assert p.returncode == 0, p.stderr
    assert f"ddp_hpc.run {job} train.epochs=2 optim.lr=0.5)" in p.stdout


def test_usage_and_help_name_the_per_node_gpus_and_short_forms(tmp_path):
    p = _cli(["--help"], tmp_path)
    assert p.returncode == 0 and "(default: None)" not in p.stdout
    text = " ".join(p.stdout.split())
    for needle in ("--gpus G, -G G, --gpus-per-node G", "GPUs per node", "--partition NAME, -p NAME",
                   "--account NAME, -A NAME", "--qos NAME, -q NAME", "[CONFIG] [KEY=VALUE ...]"):
        assert needle in text, needle
