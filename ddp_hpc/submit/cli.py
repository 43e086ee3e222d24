"""``ddp-hpc submit`` (``python -m ddp_hpc.submit``): the front door. One command submits a DDP
job to Slurm, or runs the same job on this machine when there is no Slurm.

    ddp-hpc submit --nodes 2 --gpus 2 jobs/demo.yaml --wait
    ddp-hpc submit -N 4 -G 4 -p gpu -t 02:00:00 jobs/demo.yaml train.epochs=10 optim.lr=0.05
    ddp-hpc submit -N 1 -G 2 jobs/demo.yaml --sweep optim.lr=0.1,0.03 --sweep train.seed=0,1
    ddp-hpc submit --backend sbatch --dry-run jobs/demo.yaml      # print the script

Backends: ``submitit`` (Slurm through submitit), ``sbatch`` (a rendered batch script, see
``ddp_hpc.submit.render``), ``local`` (N x G processes on this machine as N pretend nodes, gloo
on CPU), ``auto`` (submitit when sbatch is installed and the controller answers, else local; it
says which and why). The Slurm options and their flags are the fields of
``ddp_hpc.config.SlurmOptions``; they may also come from the job YAML's ``slurm:`` section (the
command line wins). Every submission leaves a job record (``ddp_hpc.records``) so
``ddp-hpc status`` finds it from any directory, and a copy of the resolved config
(``config.yaml``) in each run's log directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Sequence

import yaml

from ddp_hpc import cli as ddp_cli
from ddp_hpc import records
from ddp_hpc.config import ConfigError, JobConfig, config_to_dict, load_config, slurm_options
from ddp_hpc.errors import HintError, report
from ddp_hpc.fsutil import atomic_write_text
from ddp_hpc.runlogs.schema import CONFIG_FILE
from ddp_hpc.slurm.cli import SlurmCLI, SlurmError
from ddp_hpc.submit import local as submit_local
from ddp_hpc.submit import render
from ddp_hpc.submit import slurm as submit_slurm
from ddp_hpc.submit.spec import (JobSpec, SpecError, build_spec, check_overrides, is_override,
                                 parse_sweeps, sweep_tasks)
from ddp_hpc.submit.wait import wait_and_judge

__all__ = ["main", "choose_backend", "parse_args"]

DEFAULT_CONFIG = "jobs/demo.yaml"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=ddp_cli.prog("submit"), formatter_class=ddp_cli.HelpFormatter,
        usage="%(prog)s [options] [CONFIG] [KEY=VALUE ...] [-- KEY=VALUE ...]",
        description="Submit a DDP training job to Slurm (submitit or a rendered sbatch script), "
                    "or run it here as N pretend nodes x G processes when there is no Slurm. "
                    "Config overrides (key=value) follow the config, before or after `--`.")
    ap.add_argument("config", nargs="?", default=None, metavar="CONFIG",
                    help=f"job YAML (default: {DEFAULT_CONFIG})")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                    help="config overrides, e.g. train.epochs=2 optim.lr=0.01")
    slurm_options.add_arguments(ap)
    ap.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                    help="one job array over the product of all --sweep values (repeatable)")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the script / parameters / commands; submit nothing")
    ap.add_argument("--wait", action="store_true",
                    help="wait for the end (showing rank 0's progress); exit non-zero unless "
                         "every rank completed")
    ap.add_argument("--wait-timeout", type=float, default=None, metavar="SECONDS",
                    help="give up waiting after this many seconds")
    return ap


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, str, list[str]]:
    """(options, config path, overrides). Overrides may follow the config directly
    (``jobs/demo.yaml train.epochs=2``) or come after ``--``; with no config, a first
    ``key=value`` is an override and the default config is used."""
    argv = list(argv)
    after: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, after = argv[:i], argv[i + 1:]
    args = _parser().parse_intermixed_args(argv)
    positionals = ([args.config] if args.config is not None else []) + list(args.overrides)
    config = DEFAULT_CONFIG
    if positionals and not (is_override(positionals[0]) and not Path(positionals[0]).is_file()):
        config = positionals.pop(0)
    return args, config, positionals + after


def _say(msg: str) -> None:
    print(f"ddp_hpc submit: {msg}", file=sys.stderr, flush=True)


def choose_backend(requested: str, cli) -> tuple[str, str]:
    """(backend, why). ``auto`` needs both an sbatch on PATH and a controller that answers
    sinfo: Slurm's client tools are often installed where no cluster is configured."""
    if requested != "auto":
        return requested, "asked for with --backend" if requested else "default"
    if not cli.available():
        return "local", "no `sbatch` on PATH, so this machine is not a Slurm login node"
    try:
        parts = cli.sinfo_partitions()
    except SlurmError as exc:
        first = str(exc).splitlines()[0]
        return "local", f"`sbatch` is installed but the Slurm controller does not answer ({first})"
    return "submitit", (f"`sbatch` is on PATH and the controller answers (partitions: "
                        f"{', '.join(p['name'] for p in parts) or 'none'})")


def _load(config: str, overrides: Sequence[str], tasks: Sequence[Sequence[str]]) -> tuple[JobConfig, list]:
    """(the job's config, each task's config in the order of `sweep_tasks`; just the job's without
    a sweep). Loading every task's here makes a bad key or value in any sweep value fail early."""
    cfg = load_config(config, overrides)
    return cfg, [load_config(config, [*overrides, *extra]) for extra in tasks] or [cfg]


def _preflight(spec, backend: str, cli: SlurmCLI, dry_run: bool) -> None:
    """Compare the request with what sinfo lists; a dry run goes on without a cluster."""
    if not cli.available():
        if dry_run:
            _say("dry run without Slurm (`sbatch` is not on PATH): partition and GPU checks skipped")
            return
        raise SpecError(f"--backend {backend} needs Slurm but `sbatch` is not on PATH",
                        "run on a login node, or use --backend local (or auto)")
    try:
        partitions = cli.sinfo_partitions()
    except SlurmError as exc:
        if not dry_run:
            raise
        _say(f"dry run without a reachable cluster: partition and GPU checks skipped "
             f"({str(exc).splitlines()[0]})")
        return
    submit_slurm.check_against_cluster(spec, partitions)


def _record(spec: JobSpec, job_id: str, backend: str, cluster: str, *, script: str | None = None,
            pids=None) -> records.JobRecord:
    array = None
    if spec.is_array:
        array = [{"task_id": t.task_id, "overrides": list(t.overrides), "log_dir": t.log_dir}
                 for t in spec.tasks]
    rec = records.JobRecord(
        id=job_id, cluster=cluster, name=spec.name, backend=backend, nodes=spec.nodes,
        gpus_per_node=spec.gpus_per_node, time_limit=spec.time if backend != "local" else None,
        log_dir=spec.log_dir, config=spec.config, overrides=list(spec.overrides),
        submitted_at=time.time(), cwd=spec.workdir, array=array, pids=pids, script=script)
    records.write_record(rec)
    return rec


def _make_run_dirs(spec: JobSpec, task_cfgs: Sequence[JobConfig]) -> None:
    """Every log directory (Slurm cannot create the directory of --output itself), each with a
    copy of the config its run trains with (`task_cfgs`, one per task), the Slurm options as
    submitted included."""
    Path(spec.log_dir).mkdir(parents=True, exist_ok=True)
    for t, cfg in zip(spec.tasks, task_cfgs, strict=True):
        Path(t.log_dir).mkdir(parents=True, exist_ok=True)
        resolved = config_to_dict(dataclasses.replace(cfg, slurm=spec.options))
        atomic_write_text(Path(t.log_dir) / CONFIG_FILE,
                          yaml.safe_dump(resolved, sort_keys=False))


def _removed_note(removed: list[str]) -> str:
    return (f"removed {len(removed)} SLURM_* variables of an enclosing job: "
            f"{', '.join(removed[:6])}" + (" ..." if len(removed) > 6 else ""))


def _local(spec: JobSpec, args: argparse.Namespace, task_cfgs: Sequence[JobConfig]) -> int:
    job_id = f"local-{Path(spec.log_dir).name}"
    env, removed = submit_slurm.clean_slurm_env(os.environ)
    if args.dry_run:
        for t in spec.tasks:   # what the local driver runs, as the equivalent launcher command
            tid = job_id if t.task_id is None else f"{job_id}_{t.task_id}"
            print(f"DDP_HPC_LOG_DIR={shlex.quote(t.log_dir)} {shlex.quote(spec.python)} -m "
                  f"ddp_hpc.launch --nodes {spec.nodes} --procs-per-node {spec.gpus_per_node} "
                  f"--log-dir {shlex.quote(t.log_dir)} --job-id {tid} -- "
                  f"{shlex.join(spec.task_argv(t))}")
        return 0
    if removed:
        _say(_removed_note(removed))
    _make_run_dirs(spec, task_cfgs)
    rec = _record(spec, job_id, "local", socket.gethostname())
    plan = submit_local.write_plan(spec, job_id, record_id=job_id,
                                   ddp_hpc_home=os.environ.get("DDP_HPC_HOME"))
    n = spec.nodes
    _say(f"job {job_id}: {ddp_cli.plural(spec.world_size, 'process')} "
         f"({ddp_cli.plural(n, 'pretend node')} x {spec.gpus_per_node}), "
         f"logs in {spec.log_dir}")
    if args.wait:
        rc = submit_local.run_plan(plan, follow=True, env=env)
        _say(f"job {job_id} {'completed' if rc == 0 else f'failed (exit status {rc})'}")
        return rc
    rec.pids = [submit_local.start_detached(plan, env, spec.python)]
    records.update_record(rec)
    _say(f"started in the background (driver pid {rec.pids[0]}); follow it with "
         f"`{ddp_cli.prog('status')} {job_id}`")
    print(job_id)
    return 0


def _dry_run_slurm(spec: JobSpec, backend: str) -> int:
    if backend == "sbatch":
        sys.stdout.write(render.render(spec))
        return 0
    calls = [{"task_id": t.task_id, "function": "ddp_hpc.submit.slurm.run_task",
              "args": [spec.config, [*spec.overrides, *t.overrides], t.log_dir]}
             for t in spec.tasks]
    print(json.dumps({"executor": "submitit.SlurmExecutor",
                      "folder": str(submit_slurm.submitit_folder(spec)),
                      "parameters": submit_slurm.submitit_parameters(spec), "calls": calls},
                     indent=2))
    return 0


def _slurm(spec: JobSpec, args: argparse.Namespace, backend: str, cli: SlurmCLI,
           task_cfgs: Sequence[JobConfig]) -> int:
    if args.dry_run:
        return _dry_run_slurm(spec, backend)
    try:
        cluster = cli.cluster_name()
    except SlurmError:
        cluster = socket.gethostname()
    _make_run_dirs(spec, task_cfgs)
    env_clean, removed = submit_slurm.clean_slurm_env(os.environ)
    if removed:
        _say(_removed_note(removed) + " (before submitting)")
    if backend == "sbatch":
        job_id, path = submit_slurm.submit_sbatch(spec, render.render(spec),
                                                  SlurmCLI(env=env_clean))
        script = str(path)
    else:
        job_id = submit_slurm.submit_submitit(spec)[0].split("_")[0]
        script = submit_slurm.submitit_script(spec, job_id)
    _record(spec, job_id, backend, cluster, script=script)
    array = f", array of {len(spec.tasks)}" if spec.is_array else ""
    _say(f"submitted job {job_id} ({backend}, {ddp_cli.plural(spec.nodes, 'node')} x "
         f"{ddp_cli.plural(spec.tasks_per_node, 'task')}{array}), logs in {spec.log_dir}")
    print(job_id)
    if not args.wait:
        return 0
    return wait_and_judge(spec, job_id, cli, args.wait_timeout, _say)


def _submit(args: argparse.Namespace, config: str, overrides: list[str]) -> int:
    sweeps = parse_sweeps(args.sweep)
    check_overrides(overrides)
    cfg, task_cfgs = _load(config, overrides, sweep_tasks(sweeps))
    opts = slurm_options.merged(cfg.slurm, slurm_options.given(args))
    cli = SlurmCLI(env=submit_slurm.clean_slurm_env(os.environ)[0])
    backend, why = choose_backend(opts.backend, cli)
    _say(f"backend {backend}: {why}")
    spec = build_spec(dataclasses.replace(opts, backend=backend), config_path=config, cfg=cfg,
                      overrides=overrides, sweeps=sweeps)
    if backend == "local":
        return _local(spec, args, task_cfgs)
    _preflight(spec, backend, cli, args.dry_run)
    return _slurm(spec, args, backend, cli, task_cfgs)


def main(argv: Sequence[str] | None = None) -> int:
    args, config, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return _submit(args, config, overrides)
    except (SpecError, ConfigError, SlurmError) as exc:
        report(ddp_cli.prog("submit"), exc)
        return 2
    except (HintError, TimeoutError) as exc:
        report(ddp_cli.prog("submit"), exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
