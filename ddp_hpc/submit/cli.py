"""``ddp-hpc submit`` (``python -m ddp_hpc.submit``): the front door. One command submits a DDP
job to Slurm, or runs the same job on this machine when there is no Slurm.

    ddp-hpc submit --nodes 2 --gpus 2 jobs/demo.yaml --wait
    ddp-hpc submit -N 4 -G 4 -p gpu -t 02:00:00 jobs/demo.yaml train.epochs=10 optim.lr=0.05
    ddp-hpc submit -N 1 -G 2 jobs/demo.yaml --sweep optim.lr=0.1,0.03 --sweep train.seed=0,1
    ddp-hpc submit --backend sbatch --dry-run jobs/demo.yaml      # print the script
    ddp-hpc submit -N 2 -G 4 train.py --lr 0.1 --epochs 10        # your own torchrun-style script
    ddp-hpc submit -N 2 -G 4 -m mypkg.train --lr 0.1               # a module, as python -m

A script or module runs on every rank under ``ddp_hpc.exec`` (preflight, the torchrun variables,
signal forwarding, start/end events for status); every word after it is its own, verbatim.

Backends: ``submitit`` (Slurm through submitit), ``sbatch`` (a rendered batch script, see
``ddp_hpc.backends.render``), ``local`` (N x G processes on this machine as N pretend nodes, gloo
on CPU), ``auto`` (submitit when sbatch is installed and the controller answers, else local; it
says which and why). The Slurm options and their flags are the fields of
``ddp_hpc.config.SlurmOptions``; they may also come from the job YAML's ``slurm:`` section (the
command line wins). Every submission leaves a job record (``ddp_hpc.records``) so
``ddp-hpc status`` finds it from any directory, and a copy of the resolved config
(``config.yaml``) in each run's log directory.

The same command again resumes a config job's interrupted, preempted or failed run from its
checkpoint, in the same run directory (``ddp_hpc.submit.resume``); ``--fresh`` starts a new run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Sequence

from ddp_hpc import backends
from ddp_hpc.backends.base import Backend, SubmitOptions, say
from ddp_hpc.backends.spec import (
    SpecError,
    build_command_spec,
    build_spec,
    check_overrides,
    is_override,
    parse_sweeps,
    script_sweeps,
    stage_items,
    sweep_tasks,
)
from ddp_hpc.config import ConfigError, JobConfig, load_config, slurm_options
from ddp_hpc.config.validate import validate_job
from ddp_hpc.errors import HintError, report
from ddp_hpc.slurm.cli import SlurmError
from ddp_hpc.submit.resume import resume_or_new
from ddp_hpc.submit.target import SubmitTarget, module_command, script_command, split_argv
from ddp_hpc.text import ArgumentParser, HelpFormatter, prog

__all__ = ["main", "parse_args", "parse"]

DEFAULT_CONFIG = "jobs/demo.yaml"


def _parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(
        prog=prog("submit"), formatter_class=HelpFormatter,
        usage="%(prog)s [options] [CONFIG] [KEY=VALUE ...] [-- KEY=VALUE ...]\n"
              "       %(prog)s [options] SCRIPT.py [ARGS ...]\n"
              "       %(prog)s [options] -m MODULE [ARGS ...]",
        description="Submit a DDP training job to Slurm (submitit or a rendered sbatch script), "
                    "or run it here as N pretend nodes x G processes when there is no Slurm. "
                    "The job is a config for ddp_hpc's loop (overrides key=value follow it, "
                    "before or after `--`), or your own script or module: every word after it "
                    "is passed to it verbatim, and each rank gets torchrun's variables.")
    ap.add_argument("config", nargs="?", default=None, metavar="CONFIG",
                    help=f"job YAML (default: {DEFAULT_CONFIG})")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                    help="config overrides, e.g. train.epochs=2 optim.lr=0.01")
    slurm_options.add_arguments(ap)
    ap.add_argument("-m", "--module", metavar="MODULE",
                    help="run MODULE on every rank as `python -m MODULE`; the words after it "
                         "are its arguments")
    ap.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                    help="one job array over the product of all --sweep values (repeatable); "
                         "for a script, each task gets --KEY=V as extra arguments")
    ap.add_argument("--log-dir", metavar="DIR",
                    help="where run directories go (default: runs for a script or module, "
                         "log.dir for a config)")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the script / parameters / commands; submit nothing")
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="say more: e.g. the error of a Slurm controller that did not answer")
    ap.add_argument("--wait", action="store_true",
                    help="wait for the end (showing rank 0's progress); exit non-zero unless "
                         "every rank completed")
    ap.add_argument("--fresh", action="store_true",
                    help="a config job: start a new run directory even when an earlier run of "
                         "the same command stopped with a checkpoint (by default it resumes); "
                         "the earlier run is kept")
    ap.add_argument("--wait-timeout", type=float, default=None, metavar="SECONDS",
                    help="give up waiting after this many seconds")
    ap.add_argument("--no-instrument", action="store_true",
                    help="a script or module: run it without ddp_hpc's instrumentation (step "
                         "events, hang stacks, native-crash stacks; docs/scripts.md); the same as "
                         "DDP_HPC_INSTRUMENT=0")
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


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, SubmitTarget]:
    """(options, target): a config target's ``what`` is the config path and ``rest`` its
    overrides; a script's or module's ``rest`` its arguments, verbatim."""
    target = split_argv(argv, _parser())
    if target.kind == "config":
        args, config, overrides = parse_args(target.ours)
        if args.log_dir:
            overrides = [*overrides, f"log.dir={args.log_dir}"]
        return args, dataclasses.replace(target, what=config, rest=tuple(overrides))
    return _parser().parse_intermixed_args(target.ours), target


def _load(config: str, overrides: Sequence[str], tasks: Sequence[Sequence[str]]) -> tuple[JobConfig, list]:
    """(the job's config, each task's config in the order of `sweep_tasks`; just the job's without
    a sweep). Loading every task's here makes a bad key or value in any sweep value fail early."""
    cfg = load_config(config, overrides)
    return cfg, [load_config(config, [*overrides, *extra]) for extra in tasks] or [cfg]


def _backend(opts, verbose: bool = False, client=None) -> Backend:
    """The backend to submit with (``client``: the SlurmCLI `backends.choose` asks; None: its own),
    said in one line."""
    backend, why = backends.choose(opts, client)
    unreachable = getattr(backend, "unreachable", None)   # the local backend's, when auto fell back to it
    say(f"backend {backend.name}: {why}" + ("" if verbose or not unreachable else " (-v: why)"))
    if verbose and unreachable:
        say(f"  {unreachable}")
    return backend


def _options(args: argparse.Namespace) -> SubmitOptions:
    return SubmitOptions(dry_run=args.dry_run, wait=args.wait, wait_timeout=args.wait_timeout)


def _submit_config(args: argparse.Namespace, config: str, overrides: list[str]) -> int:
    sweeps = parse_sweeps(args.sweep)
    check_overrides(overrides)
    cfg, task_cfgs = _load(config, overrides, sweep_tasks(sweeps))
    opts = slurm_options.merged(cfg.slurm, slurm_options.given(vars(args)))
    backend = _backend(opts, args.verbose)
    spec = build_spec(dataclasses.replace(opts, backend=backend.name), config_path=config, cfg=cfg,
                      overrides=overrides, sweeps=sweeps)
    spec = dataclasses.replace(spec, stage=stage_items([(f"{config}: slurm.stage", cfg.slurm.stage),
                                                         ("--stage", args.stage or ())]))
    spec = resume_or_new(spec, backend, task_cfgs, fresh=args.fresh, say=say)
    for task_cfg in task_cfgs:   # factories, data paths, precision, log.dir: before it queues
        validate_job(task_cfg, backend=backend, workdir=spec.workdir, create_log_dir=False,
                     slurm=spec.options)
    return backends.dispatch(spec, backend, _options(args), task_cfgs).exit_code


def _submit_command(args: argparse.Namespace, target: SubmitTarget) -> int:
    """A script or module: no config; the Slurm options come from the command line only."""
    if target.kind == "module":
        command = module_command(str(target.what), target.rest)
        name = str(target.what).rsplit(".", 1)[-1]
    else:
        command = script_command(str(target.what), target.rest)
        name = Path(str(target.what)).stem
    sweeps = script_sweeps(args.sweep)
    if args.no_instrument:   # every backend's ranks inherit this environment
        os.environ["DDP_HPC_INSTRUMENT"] = "0"
    stage = stage_items([("--stage", args.stage)]) if args.stage else ()   # before the backend is chosen
    opts = slurm_options.merged(slurm_options.SlurmOptions(), slurm_options.given(vars(args)))
    backend = _backend(opts, args.verbose)
    spec = build_command_spec(dataclasses.replace(opts, backend=backend.name), command=command,
                              name=name, log_root=args.log_dir or "runs", sweeps=sweeps)
    return backends.dispatch(dataclasses.replace(spec, stage=stage), backend, _options(args)).exit_code


def _submit(args: argparse.Namespace, target: SubmitTarget) -> int:
    if target.kind == "config":
        return _submit_config(args, str(target.what), list(target.rest))
    return _submit_command(args, target)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args, target = parse(sys.argv[1:] if argv is None else argv)
        return _submit(args, target)
    except (SpecError, ConfigError, SlurmError) as exc:
        report(prog("submit"), exc)
        return 2
    except (HintError, TimeoutError) as exc:
        report(prog("submit"), exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
