"""``python -m ddp_hpc.submit``: the front door. One command submits a DDP job to Slurm, or runs
the same job on this machine when there is no Slurm.

    python -m ddp_hpc.submit --nodes 2 --gpus 2 jobs/demo.yaml --wait
    python -m ddp_hpc.submit --nodes 4 --gpus 4 --partition gpu --time 02:00:00 jobs/demo.yaml \\
        -- train.epochs=10 optim.lr=0.05
    python -m ddp_hpc.submit --nodes 1 --gpus 2 jobs/demo.yaml --sweep optim.lr=0.1,0.03 \\
        --sweep train.seed=0,1          # one job array of 4 tasks
    python -m ddp_hpc.submit --backend sbatch --dry-run jobs/demo.yaml   # print the script

Backends: ``submitit`` (Slurm through submitit), ``sbatch`` (a rendered batch script, see
``ddp_hpc.submit.render``), ``local`` (N x G processes on this machine as N pretend nodes, gloo on CPU),
``auto`` (submitit when sbatch is installed and the controller answers, else local; it says which
and why). Options may also come from the job YAML's ``slurm:`` section; the command line wins.
Every submission leaves a job record (``ddp_hpc.records``) so ``python -m ddp_hpc.status``
finds it from any directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Sequence

from ddp_hpc.submit.spec import (BACKENDS, JobSpec, SpecError, build_spec, merge_options,
                                 parse_sbatch_args, parse_sweeps)

__all__ = ["main", "choose_backend", "parse_args"]

DEFAULT_CONFIG = "jobs/demo.yaml"


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{value} is not allowed: at least 1 is needed (a job needs a node and a task)")
    return value


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m ddp_hpc.submit",
        description="Submit a DDP training job to Slurm (submitit or a rendered sbatch script), "
                    "or run it here as N pretend nodes x G processes when there is no Slurm. "
                    "Config overrides go after `--` (key=value).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("config", nargs="?", default=None,
                    help=f"job YAML (default {DEFAULT_CONFIG})")
    g = ap.add_argument_group("layout (one task per GPU)")
    g.add_argument("--nodes", "-N", type=_positive, help="nodes (YAML slurm.nodes; default 1)")
    g.add_argument("--gpus", "-G", type=_positive, dest="gpus_per_node",
                   help="GPUs per node = tasks per node (YAML slurm.gpus_per_node; default 1)")
    g.add_argument("--cpus-per-task", "-c", type=_positive,
                   help="CPUs per task (default data.num_workers + 1)")
    s = ap.add_argument_group("Slurm options (also from the YAML's slurm: section)")
    for opt in ("partition", "account", "qos", "mem", "constraint", "dependency"):
        s.add_argument(f"--{opt}")
    s.add_argument("--time", "-t", help="time limit, e.g. 02:00:00 (default 01:00:00)")
    s.add_argument("--exclusive", action="store_true", default=None, help="whole nodes")
    s.add_argument("--job-name", "-J", help="job name (default: the config's name)")
    s.add_argument("--signal", help="preemption signal and grace seconds before the time limit, "
                                     "e.g. USR2@90 (default <preempt.signal>@90)")
    s.add_argument("--sbatch-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="any other sbatch option, e.g. mail-type=END (repeatable)")
    ap.add_argument("--backend", choices=BACKENDS, default=None,
                    help="auto: submitit when Slurm answers, else local (default auto)")
    ap.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                    help="one job array over the product of all --sweep values (repeatable)")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the script / parameters / commands; submit nothing")
    ap.add_argument("--wait", action="store_true",
                    help="wait for the end; exit non-zero unless every rank completed")
    ap.add_argument("--wait-timeout", type=float, default=None, help="give up waiting after S s")
    return ap


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    overrides: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1:]
    return _parser().parse_args(argv), overrides


def _say(msg: str) -> None:
    print(f"ddp_hpc submit: {msg}", file=sys.stderr, flush=True)


def choose_backend(requested: str, cli) -> tuple[str, str]:
    """(backend, why). ``auto`` needs both an sbatch on PATH and a controller that answers
    sinfo: Slurm's client tools are often installed where no cluster is configured."""
    from ddp_hpc.slurm.cli import SlurmError
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


def _load(config: str, overrides: Sequence[str], tasks: Sequence[Sequence[str]]):
    """Load the config once per task so a bad key or value in any sweep value fails here."""
    from ddp_hpc.config import load_config
    cfg = load_config(config, overrides)
    for extra in tasks:
        load_config(config, [*overrides, *extra])
    return cfg


def _record(spec: JobSpec, job_id: str, backend: str, cluster: str, *, script: str | None = None,
            pids=None, overrides: Sequence[str] = ()):
    from ddp_hpc import records
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


def _make_dirs(spec: JobSpec) -> None:
    """Slurm cannot create the directory of --output itself: make them all before submitting."""
    for t in spec.tasks:
        Path(t.log_dir).mkdir(parents=True, exist_ok=True)
    Path(spec.log_dir).mkdir(parents=True, exist_ok=True)


def _local(spec: JobSpec, args, run_id: str) -> int:
    from ddp_hpc.submit import local as submit_local
    from ddp_hpc.submit.slurm import clean_slurm_env

    job_id = f"local-{run_id}"
    env, removed = clean_slurm_env(os.environ)
    if args.dry_run:
        for t in spec.tasks:   # what the local driver runs, as the equivalent launcher command
            tid = job_id if t.task_id is None else f"{job_id}_{t.task_id}"
            print(f"DDP_HPC_LOG_DIR={shlex.quote(t.log_dir)} {shlex.quote(spec.python)} -m "
                  f"ddp_hpc.launch --nodes {spec.nodes} --procs-per-node {spec.gpus_per_node} "
                  f"--log-dir {shlex.quote(t.log_dir)} --job-id {tid} -- "
                  f"{shlex.join(spec.task_argv(t))}")
        return 0
    if removed:
        _say(f"removed {len(removed)} SLURM_* variables of an enclosing job: {', '.join(removed[:6])}"
             + (" ..." if len(removed) > 6 else ""))
    _make_dirs(spec)
    rec = _record(spec, job_id, "local", socket.gethostname())
    plan = submit_local.write_plan(spec, job_id, record_id=job_id,
                                   ddp_hpc_home=os.environ.get("DDP_HPC_HOME"))
    _say(f"job {job_id}: {spec.world_size} processes ({spec.nodes} pretend node(s) x "
         f"{spec.gpus_per_node}), logs in {spec.log_dir}")
    if args.wait:
        rc = submit_local.run_plan(plan, follow=True, env=env)
        _say(f"job {job_id} {'completed' if rc == 0 else f'failed (exit status {rc})'}")
        return rc
    pid = submit_local.start_detached(plan, env, spec.python)
    from ddp_hpc import records
    rec.pids = [pid]
    records.update_record(rec)
    _say(f"started in the background (driver pid {pid}); follow it with "
         f"`python -m ddp_hpc.status {job_id}`")
    print(job_id)
    return 0


def _slurm(spec: JobSpec, args, backend: str, cli) -> int:
    from ddp_hpc.submit import render, slurm as submit_slurm
    from ddp_hpc.slurm.cli import SlurmError

    script = render.render(spec) if backend == "sbatch" else None
    if args.dry_run:
        if script is not None:
            sys.stdout.write(script)
        else:
            params = submit_slurm.submitit_parameters(spec)
            calls = [{"task_id": t.task_id, "function": "ddp_hpc.submit.slurm.run_task",
                      "args": [spec.config, [*spec.overrides, *t.overrides], t.log_dir]}
                     for t in spec.tasks]
            print(json.dumps({"executor": "submitit.SlurmExecutor", "folder": spec.log_dir,
                              "parameters": params, "calls": calls}, indent=2))
        return 0
    try:
        cluster = cli.cluster_name()
    except SlurmError:
        cluster = socket.gethostname()
    _make_dirs(spec)
    env_clean, removed = submit_slurm.clean_slurm_env(os.environ)
    if removed:
        _say(f"removed {len(removed)} SLURM_* variables of an enclosing job before submitting: "
             f"{', '.join(removed[:6])}" + (" ..." if len(removed) > 6 else ""))
    if backend == "sbatch":
        from ddp_hpc.slurm.cli import SlurmCLI
        job_id, path = submit_slurm.submit_sbatch(spec, script, SlurmCLI(env=env_clean))
        script_path = str(path)
    else:
        ids = submit_slurm.submit_submitit(spec)
        job_id, script_path = ids[0].split("_")[0], None
        sub = Path(spec.log_dir) / f"{job_id}_submission.sh"
        script_path = str(sub) if sub.exists() else None
    _record(spec, job_id, backend, cluster, script=script_path)
    _say(f"submitted job {job_id} ({backend}, {spec.nodes} node(s) x {spec.gpus_per_node} "
         f"task(s){f', array of {len(spec.tasks)}' if spec.is_array else ''}), logs in "
         f"{spec.log_dir}")
    print(job_id)
    if not args.wait:
        return 0
    states = submit_slurm.wait_for_jobs(
        cli, job_id, timeout=args.wait_timeout,
        echo=lambda m: print(m, file=sys.stderr, flush=True),
        progress=lambda: submit_slurm.latest_step([t.log_dir for t in spec.tasks]))
    ok_all = True
    for t in spec.tasks:
        ok, why = submit_slurm.run_verdict(t.log_dir, spec.world_size)
        label = f"task {t.task_id}" if t.task_id is not None else f"job {job_id}"
        _say(f"{label}: {'completed' if ok else 'NOT completed'}: {why}")
        ok_all = ok_all and ok
    _say("final Slurm state: " + ", ".join(f"{k} {v}" for k, v in sorted(states.items())))
    return 0 if ok_all else 1


def main(argv: Sequence[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    from ddp_hpc.config import ConfigError
    from ddp_hpc.slurm.cli import SlurmCLI, SlurmError

    config = args.config or DEFAULT_CONFIG
    try:
        sweeps = parse_sweeps(args.sweep)
        from ddp_hpc.submit.spec import check_overrides, sweep_tasks
        check_overrides(overrides)
        cfg = _load(config, overrides, sweep_tasks(sweeps))
        cli_opts = {
            "nodes": args.nodes, "gpus_per_node": args.gpus_per_node,
            "cpus_per_task": args.cpus_per_task, "partition": args.partition,
            "account": args.account, "qos": args.qos, "time": args.time, "mem": args.mem,
            "constraint": args.constraint, "exclusive": args.exclusive,
            "job_name": args.job_name, "dependency": args.dependency, "signal": args.signal,
            "sbatch_args": parse_sbatch_args(args.sbatch_arg) if args.sbatch_arg else None,
            "backend": args.backend,
        }
        opts = merge_options(cfg.slurm, cli_opts, yaml_source=config)
        cli = SlurmCLI(env=_clean_env())
        backend, why = choose_backend(opts.backend, cli)
        _say(f"backend {backend}: {why}")
        spec = build_spec(opts, config_path=config, cfg=cfg, overrides=overrides, sweeps=sweeps)
        if backend == "local":
            return _local(spec, args, Path(spec.log_dir).name)
        from ddp_hpc.submit.slurm import check_against_cluster
        try:
            if not cli.available():
                raise SpecError(f"--backend {backend} needs Slurm but `sbatch` is not on PATH.\n"
                                f"HINT: run on a login node, or use --backend local (or auto)")
            check_against_cluster(spec, cli.sinfo_partitions())
        except (SpecError, SlurmError) as exc:
            if not args.dry_run or isinstance(exc, SpecError) and "sbatch` is not on PATH" not in str(exc):
                raise
            _say(f"dry run without a reachable cluster: partition and GPU checks skipped "
                 f"({str(exc).splitlines()[0]})")
        return _slurm(spec, args, backend, cli)
    except (SpecError, ConfigError, SlurmError) as exc:
        print(f"ddp_hpc submit: error: {exc}", file=sys.stderr)
        return 2


def _clean_env() -> dict[str, str]:
    from ddp_hpc.submit.slurm import clean_slurm_env
    return clean_slurm_env(os.environ)[0]


if __name__ == "__main__":
    sys.exit(main())
