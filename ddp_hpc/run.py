"""``python -m ddp_hpc.run CONFIG [key=value ...]``: the on-node entry, identical under every launcher.

    srun python -m ddp_hpc.run jobs/demo.yaml train.epochs=3
    torchrun --nproc-per-node 4 -m ddp_hpc.run jobs/demo.yaml
    python -m ddp_hpc.launch --nodes 1 --procs-per-node 2 -- python -m ddp_hpc.run jobs/demo.yaml

A run whose log directory says it already completed is not trained again: the command says so
(the step, where its logs and checkpoints are, how to start over) and exits 0.

Exit codes: 0 completed (or already complete, or preempted and requeued: the job will continue), 75 (preempt.exit_code,
EX_TEMPFAIL) preempted and checkpointed but not requeued (outside Slurm: run the same command
again to resume), 2 bad configuration, 1 any other failure (the traceback is in the rank's log
and error event).
"""
from __future__ import annotations

import argparse
import signal
import sys

from ddp_hpc.config import ConfigError, JobConfig, load_config, run_key
from ddp_hpc.data.errors import StageError
from ddp_hpc.data.scriptstage import EXIT_STAGE_FAILED, call_staged, requested_items
from ddp_hpc.env import detect, job_facts
from ddp_hpc.errors import report
from ddp_hpc.exec.events import SafeLog
from ddp_hpc.judge.reader import run_ending
from ddp_hpc.runlogs.writer import resolve_log_dir
from ddp_hpc.text import ArgumentParser, HelpFormatter, prog

EXIT_OK, EXIT_CONFIG = 0, 2  # any other failure is an uncaught exception: exit status 1


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog("run"), formatter_class=HelpFormatter,
                                description="Train the job CONFIG on this rank (any launcher).",
                                epilog=__doc__.split("\n", 1)[1])
    p.add_argument("config", metavar="CONFIG", help="YAML job file, e.g. jobs/demo.yaml")
    p.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                   help="optional dotted overrides, e.g. train.batch_size=64 optim.lr=0.01")
    return p


def already_complete(cfg: JobConfig) -> str | None:
    """What to tell the user when this run's log directory holds a completed run (its rank 0
    ended "completed" after its last start), else None. A run that does not resume from its
    checkpoints (checkpoint.resume=false) always trains."""
    if not cfg.checkpoint.resume:
        return None
    env = detect()
    log_dir = resolve_log_dir(cfg.log.dir, str(env.job_id) if env.job_id else run_key(cfg)).absolute()
    end = run_ending(log_dir)
    if end.status != "completed":
        return None
    again = ("submit the same command again for a new run (a completed run is never resumed)"
             if job_facts().log_dir else
             f"give another log.dir (e.g. log.dir={cfg.log.dir.rstrip('/')}-2); this run stays as it is")
    where = f"logs in {log_dir}" + (f", last checkpoint {end.checkpoint}" if end.checkpoint else "")
    return (f"this run is already complete (step {end.step}; {where}): nothing to train. "
            f"To train it again from the start, {again}")


def _train(cfg: JobConfig):
    """Train ``cfg``; with ``slurm.stage`` (or ``--stage``) items from submit, on this node's copies
    (``$DDP_HPC_STAGE_<NAME>``), given back after the run unless it was preempted (the requeue
    reuses them); None when that staging failed (said on stderr and in an ``error`` event)."""
    from ddp_hpc.train.api import run_job  # torch: imported once the configuration is good
    from ddp_hpc.train.preempt import preempt_signum

    # the loop catches the preemption notice while it trains and then gives back this handler: a
    # notice after that (in the rank's teardown, its run complete) is moot, and the default action
    # would kill a rank whose run completed (srun then reports the job failed by that signal);
    # SIGTERM and SIGINT keep their meaning (a stop) whatever preempt.signal says
    notice = preempt_signum(cfg.preempt.signal)
    if notice not in (signal.SIGTERM, signal.SIGINT):
        signal.signal(notice, signal.SIG_IGN)
    items = requested_items()
    if not items:
        return run_job(cfg)
    env = detect()
    log = SafeLog(resolve_log_dir(cfg.log.dir, str(env.job_id) if env.job_id else run_key(cfg)),
                  env.rank, job_id=env.job_id, restart=env.restart_count, who=prog("run"))
    started: list[bool] = []

    def body():
        started.append(True)
        return run_job(cfg)

    try:
        return call_staged(env, items, log, body, requeued=lambda result: result.status == "preempted")
    except (StageError, OSError) as exc:
        if started:
            raise
        report(prog("run"), exc)
        log.event("error", exc_type=type(exc).__name__, message=str(exc), traceback=None,
                  exit_code=EXIT_STAGE_FAILED, signal=None)
        return None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        done = already_complete(cfg)
        if done is not None:
            if detect().rank == 0:
                print(f"{prog('run')}: {done}", file=sys.stderr, flush=True)
            return EXIT_OK
        result = _train(cfg)
    except ConfigError as e:
        report(prog("run"), f"bad configuration: {e}")
        return EXIT_CONFIG
    if result is None:   # slurm.stage / --stage failed: reported and logged; nothing trained
        return EXIT_STAGE_FAILED
    if result.status == "preempted" and not result.requeued:
        return cfg.preempt.exit_code
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
