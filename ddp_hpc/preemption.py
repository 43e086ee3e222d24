"""Preemption for your own training script: stop at a step boundary, checkpoint, requeue.

The pattern, at the end of every step (or every few) on every rank::

    from ddp_hpc import checkpoint, preemption

    preemption.install()                       # at start-up: catch the signal from the first step on
    state = checkpoint.load(ckpt_dir, model, opt)
    start = state["step"] if state else 0
    for step in range(start, total):
        train_step(...)
        if preemption.requested():             # all ranks agree, at the same step
            checkpoint.save(ckpt_dir, model, opt, step=step + 1)
            preemption.requeue()               # rank 0 requeues the Slurm job; every rank exits 75

How it works (the same rules as the training core, ``ddp_hpc.train.preempt``): the signal handler
only records what arrived; `requested` agrees on it with one all_reduce(MAX) when
torch.distributed is initialised (so call it on every rank, at the same steps), and is local
otherwise.  The preemption signal is the job's ``--signal`` (``$DDP_HPC_PREEMPT_SIGNAL``, set by
``ddp-hpc submit``; USR2 by default); SIGTERM (a plain ``scancel``, Slurm ending the job) and
SIGINT (Ctrl-C; a second one raises KeyboardInterrupt at once) also stop the run, but only the
preemption signal requeues.  `requeue` waits for a background checkpoint write
(``checkpoint.save(..., blocking=False)``), writes ``preempt`` and ``requeue`` events to the
rank's run log, destroys the process group and ends the process with exit status 75
(EX_TEMPFAIL), which ``python -m ddp_hpc.exec`` records as "preempted".  Outside Slurm nothing is
requeued: run the same command again and it resumes from the checkpoint.
"""
from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn

import torch
import torch.distributed as dist

from ddp_hpc import exits
from ddp_hpc.checkpoint import last_saved_step
from ddp_hpc.checkpoint import wait as wait_for_checkpoint
from ddp_hpc.dist import group_initialized
from ddp_hpc.env import detect, job_facts
from ddp_hpc.exec.events import SafeLog
from ddp_hpc.exits import EX_TEMPFAIL
from ddp_hpc.progress import last_step, rank_log
from ddp_hpc.train.preempt import PreemptionFlag, classify, preempt_signum, requeue_if_wanted

__all__ = ["install", "requested", "requeue", "preempt_signal", "EX_TEMPFAIL"]

DEFAULT_SIGNAL = "USR2"
TIMELIMIT_WINDOW_S = 180.0   # a signal this close to the job's end time is its time limit

_flag: PreemptionFlag | None = None


def preempt_signal(spec: str | None = None) -> str:
    """``USR2`` from ``USR2``, ``SIGUSR2``, ``B:USR2@90`` (sbatch's --signal); the job's
    ``$DDP_HPC_PREEMPT_SIGNAL`` when ``spec`` is None, else USR2."""
    raw = spec or job_facts().preempt_signal or DEFAULT_SIGNAL
    name = raw.upper().removeprefix("B:").partition("@")[0].removeprefix("SIG")
    preempt_signum(name)  # a SignalNameError (an AttributeError) for a name that is no signal
    return name


def install(signal: str | None = None) -> PreemptionFlag:
    """Catch the preemption signal (`preempt_signal`), SIGTERM and SIGINT from now on; idempotent (a
    different ``signal`` replaces the handlers).  `requested` calls it too, but a signal that
    arrives before the first call ends the process, so call it at start-up."""
    global _flag
    name = preempt_signal(signal)
    if _flag is not None and (signal is None or _flag.preempt_signum == preempt_signum(name)):
        return _flag
    if _flag is not None:
        _flag.restore()
    _flag = PreemptionFlag(name).install()
    return _flag


def requested() -> bool:
    """True on every rank once any rank received the preemption signal, SIGTERM or SIGINT.  A collective
    when torch.distributed is initialised: call it on every rank at the same step."""
    flag = install()
    if not group_initialized():
        flag.agreed = flag.local_code
        return flag.local
    t = torch.tensor([flag.local_code], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    flag.agreed = int(t.item())
    return flag.agreed > PreemptionFlag.NONE


def requeue() -> NoReturn:
    """Every rank, after `requested` returned True (and the checkpoint is saved): rank 0 requeues
    its Slurm job when the preemption signal (not SIGTERM) stopped the run; then every rank
    destroys the process group and exits with status 75.  A background checkpoint write
    (``checkpoint.save(..., blocking=False)``) is complete first, or its failure raises here."""
    wait_for_checkpoint()
    flag = install()
    env = detect()
    log = rank_log() or SafeLog(None, env.rank, env.job_id, env.restart_count)
    sig = exits.signal_name(flag.received) if flag.received else None
    reason = classify(flag.received_at, job_facts().end_time, TIMELIMIT_WINDOW_S, flag.received)
    step = last_saved_step() if last_saved_step() is not None else last_step()
    log.event("preempt", signal=sig, reason=reason, step=step)
    log.info(f"stopping at step {step}: {reason} (signal {sig or 'on another rank'})")
    distributed = group_initialized()
    requeue_if_wanted(flag, env, rank=env.rank, enabled=True, distributed=distributed, log=log)
    if distributed:
        dist.destroy_process_group()
    _exit(EX_TEMPFAIL)


def _exit(code: int) -> NoReturn:
    """End the process now, without the interpreter's teardown: a DDP model still referenced by
    the script, freed there after its process group, aborts the process now and then
    ("terminate called without an active exception", exit by SIGABRT instead of 75).  The exit
    handlers (``atexit``, ``logging``'s flush) and stdout/stderr's flush still run."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(code)
