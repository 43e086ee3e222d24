"""After the job is known and checked (``JobSpec``): make its directories, write its record, and
hand it to a backend -- local processes, submitit or a rendered sbatch script -- or, with
``--dry-run``, print what that backend would run. (The command line: ``ddp_hpc.submit.cli``.)
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

from ddp_hpc import records
from ddp_hpc.config import JobConfig, config_to_dict
from ddp_hpc.env.job import RESTART_BASE_VAR
from ddp_hpc.fsutil import atomic_write_text
from ddp_hpc.launch.tree import start_time
from ddp_hpc.runlogs.schema import CONFIG_FILE
from ddp_hpc.slurm.cli import SlurmCLI, SlurmError
from ddp_hpc.submit import local as submit_local
from ddp_hpc.submit import render
from ddp_hpc.submit import slurm as submit_slurm
from ddp_hpc.submit.checks import check_resources, partition_named
from ddp_hpc.submit.spec import JobSpec, SpecError
from ddp_hpc.submit.wait import wait_and_judge
from ddp_hpc.text import plural, prog

__all__ = ["say", "dispatch", "preflight", "record", "make_run_dirs"]


def say(msg: str) -> None:
    print(f"ddp_hpc submit: {msg}", file=sys.stderr, flush=True)


def preflight(spec, backend: str, cli: SlurmCLI, dry_run: bool) -> None:
    """Compare the request with what sinfo lists; a dry run goes on without a cluster."""
    if backend == "submitit" and isinstance(spec.options.nodes, str):
        raise SpecError(f"--nodes {spec.options.nodes} is a range, which the submitit backend cannot "
                        "take (it counts its tasks from one node count)",
                        f"use --backend sbatch (or auto), or a count such as --nodes {spec.nodes}")
    if not cli.available():
        if dry_run:
            say("dry run without Slurm (`sbatch` is not on PATH): partition and GPU checks skipped")
            return
        raise SpecError(f"--backend {backend} needs Slurm but `sbatch` is not on PATH",
                        "run on a login node, or use --backend local (or auto)")
    try:
        partitions = cli.sinfo_partitions()
    except SlurmError as exc:
        if not dry_run:
            raise
        say(f"dry run without a reachable cluster: partition and GPU checks skipped "
            f"({str(exc).splitlines()[0]})")
        return
    name = submit_slurm.check_against_cluster(spec, partitions)
    check_resources(spec, partition_named(partitions, name))


def record(spec: JobSpec, job_id: str, backend: str, cluster: str, *, script: str | None = None,
           pids=None) -> records.JobRecord:
    array = None
    if spec.is_array:
        array = [{"task_id": t.task_id, "overrides": list(t.overrides), "log_dir": t.log_dir}
                 for t in spec.tasks]
    rec = records.JobRecord(
        id=job_id, cluster=cluster, name=spec.name, backend=backend, nodes=spec.nodes,
        gpus_per_node=spec.gpus_per_node, time_limit=spec.time if backend != "local" else None,
        log_dir=spec.log_dir, config=spec.config, overrides=list(spec.overrides),
        submitted_at=time.time(), cwd=spec.workdir, array=array, pids=pids, script=script,
        command=list(spec.command) if spec.is_command else None, restart_base=spec.restart_base,
        min_nodes=spec.options.node_range[0] if isinstance(spec.options.nodes, str) and backend != "local" else None)
    records.write_record(rec)
    return rec


def make_run_dirs(spec: JobSpec, task_cfgs: Sequence[JobConfig] | None) -> None:
    """Every log directory (Slurm cannot create the directory of --output itself), each with a
    copy of the config its run trains with (`task_cfgs`, one per task; None for a script job),
    the Slurm options as submitted included."""
    try:
        Path(spec.log_dir).mkdir(parents=True, exist_ok=True)
        for t in spec.tasks:
            Path(t.log_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SpecError(f"cannot create the log directory {spec.log_dir}: {exc.strerror}",
                        "choose a writable place with --log-dir (or log.dir= for a config)") from exc
    for t, cfg in zip(spec.tasks, task_cfgs or (), strict=task_cfgs is not None):
        resolved = config_to_dict(dataclasses.replace(cfg, slurm=spec.options))
        atomic_write_text(Path(t.log_dir) / CONFIG_FILE,
                          yaml.safe_dump(resolved, sort_keys=False))


def _removed_note(removed: list[str]) -> str:
    return (f"removed {len(removed)} SLURM_* variables of an enclosing job: "
            f"{', '.join(removed[:6])}" + (" ..." if len(removed) > 6 else ""))


def _local(spec: JobSpec, args: argparse.Namespace, task_cfgs: Sequence[JobConfig] | None) -> int:
    job_id = f"local-{Path(spec.log_dir).name}"
    if isinstance(spec.options.nodes, str):
        say(f"--nodes {spec.options.nodes}: the local backend runs the most, "
            f"{plural(spec.nodes, 'pretend node')}")
    env, removed = submit_slurm.clean_slurm_env(os.environ)
    submit_local.check_gpus(spec, env)
    if spec.is_command:
        env["DDP_HPC_PREEMPT_SIGNAL"] = spec.signal
    env.update(spec.stage_environ())   # --stage: what each pretend node copies first
    base = f"{RESTART_BASE_VAR}={spec.restart_base} " if spec.restart_base else ""
    base += "".join(f"{k}={shlex.quote(v)} " for k, v in spec.stage_environ().items())
    if spec.restart_base:   # resumes a stopped run: its restart numbers follow that run's
        env[RESTART_BASE_VAR] = str(spec.restart_base)
    if args.dry_run:
        for t in spec.tasks:   # what the local driver runs, as the equivalent launcher command
            tid = job_id if t.task_id is None else f"{job_id}_{t.task_id}"
            sig = f"DDP_HPC_PREEMPT_SIGNAL={spec.signal} " if spec.is_command else ""
            print(f"{sig}{base}DDP_HPC_LOG_DIR={shlex.quote(t.log_dir)} {shlex.quote(spec.python)} -m "
                  f"ddp_hpc.launch --nodes {spec.nodes} --procs-per-node {spec.gpus_per_node} "
                  f"--log-dir {shlex.quote(t.log_dir)} --job-id {tid} -- "
                  f"{shlex.join(spec.task_argv(t))}")
        return 0
    if removed:
        say(_removed_note(removed))
    make_run_dirs(spec, task_cfgs)
    rec = args.record = record(spec, job_id, "local", socket.gethostname())
    plan = submit_local.write_plan(spec, job_id, record_id=job_id,
                                   ddp_hpc_home=os.environ.get("DDP_HPC_HOME"))
    n = spec.nodes
    say(f"job {job_id}: {plural(spec.world_size, 'process')} "
        f"({plural(n, 'pretend node')} x {spec.gpus_per_node}), "
        f"logs in {spec.log_dir}")
    if args.wait:
        rc = submit_local.run_plan(plan, follow=True, env=env)
        say(f"job {job_id} {submit_local.ending_words(rc)}")
        return rc
    rec.pids = [submit_local.start_detached(plan, env, spec.python)]
    rec.pid_times = [start_time(rec.pids[0])]
    records.update_record(rec)
    say(f"started in the background (driver pid {rec.pids[0]}); follow it with "
        f"`{prog('status')} {job_id}`")
    if not getattr(args, "quiet", False):
        print(job_id)
    return 0


def _dry_run_slurm(spec: JobSpec, backend: str) -> int:
    if backend == "sbatch":
        sys.stdout.write(render.render(spec))
        return 0
    calls = [{"task_id": t.task_id, "function": f"{fn.__module__}.{fn.__name__}", "args": fargs}
             for t, (fn, fargs) in zip(spec.tasks, submit_slurm.submitit_calls(spec))]
    print(json.dumps({"executor": "submitit.SlurmExecutor",
                      "folder": str(submit_slurm.submitit_folder(spec)),
                      "parameters": submit_slurm.submitit_parameters(spec), "calls": calls},
                     indent=2))
    return 0


def _slurm(spec: JobSpec, args: argparse.Namespace, backend: str, cli: SlurmCLI,
           task_cfgs: Sequence[JobConfig] | None) -> int:
    if args.dry_run:
        return _dry_run_slurm(spec, backend)
    try:
        cluster = cli.cluster_name()
    except SlurmError:
        cluster = socket.gethostname()
    make_run_dirs(spec, task_cfgs)
    env_clean, removed = submit_slurm.clean_slurm_env(os.environ)
    if removed:
        say(_removed_note(removed) + " (before submitting)")
    if backend == "sbatch":
        job_id, path = submit_slurm.submit_sbatch(spec, render.render(spec),
                                                  SlurmCLI(env=env_clean))
        script = str(path)
    else:
        job_id = submit_slurm.submit_submitit(spec)[0].split("_")[0]
        script = submit_slurm.submitit_script(spec, job_id)
    args.record = record(spec, job_id, backend, cluster, script=script)
    array = f", array of {len(spec.tasks)}" if spec.is_array else ""
    nodes = f"{spec.options.nodes} nodes" if isinstance(spec.options.nodes, str) else plural(spec.nodes, "node")
    say(f"submitted job {job_id} ({backend}, {nodes} x "
        f"{plural(spec.tasks_per_node, 'task')}{array}), logs in {spec.log_dir}")
    if not getattr(args, "quiet", False):
        print(job_id)
    if not args.wait:
        return 0
    return wait_and_judge(spec, job_id, cli, args.wait_timeout, say)


def dispatch(spec: JobSpec, args: argparse.Namespace, backend: str, cli: SlurmCLI,
             task_cfgs: Sequence[JobConfig] | None) -> int:
    """Run or submit ``spec`` on ``backend`` (``args``: dry_run, wait, wait_timeout, and quiet:
    no job id on stdout); the exit status of submit. The job record lands in ``args.record``."""
    try:
        submit_slurm.check_container(spec, backend)
    except SpecError as exc:
        if not (args.dry_run and backend == "sbatch"):
            raise
        say(f"dry run: {str(exc).splitlines()[0]}; the script checks the node's PATH as well")
    if backend == "local":
        return _local(spec, args, task_cfgs)
    preflight(spec, backend, cli, args.dry_run)
    return _slurm(spec, args, backend, cli, task_cfgs)
