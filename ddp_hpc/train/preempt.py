"""Preemption: a signal only sets a flag; ranks agree with one collective; rank 0 requeues.

Why this shape: a signal handler may run in the middle of an all_reduce or a checkpoint write, so
it does nothing but record the signal.  The loop checks the flag at step boundaries with ONE
all_reduce(MAX) of the flag, so every rank takes the same decision at the same step; the collective
is started asynchronously at one check and waited for at the next, so it costs no synchronisation
point of its own (the decision lands one check later, identically on all ranks).  Checks happen
every ``preempt.check_every_steps`` steps; the default 0 means "about every 0.2 s of training"
(every step until the first log interval has measured the step time; every step when steps are
slower than that), because on fast steps a collective per step costs measurable throughput.
Then: checkpoint (rank 0), every rank logs and exits cleanly, and under Slurm rank 0 requeues its
own job (``JOBID_TASK`` inside an array) through ``ddp_hpc.slurm.cli``, the one module that runs
Slurm commands -- but only for the configured preemption signal (USR2 by default). SIGTERM also
stops the run with a checkpoint, yet never requeues: it is what a user's plain ``scancel`` sends,
and what Slurm sends before it requeues a preempted job itself (PreemptMode=REQUEUE) or ends one at
its time limit; requeueing then would resurrect a cancelled job or requeue it twice.  The flag
all_reduce carries a code (0 nothing, 1 SIGTERM, 2 the preemption signal) so every rank knows
which one arrived, on whichever rank.

Time limit or preemption?  Rule: the signal is a **time limit** when the job's end time is known
and the signal arrives within ``preempt.timelimit_window_s`` (default 180 s) of it: that is what
``#SBATCH --signal=USR2@90`` and the final SIGTERM of a TIMEOUT look like.  Otherwise it is a
**preemption** (``scancel --signal=USR2``, a preempting job's SIGTERM).  The end time comes from
``SLURM_JOB_END_TIME`` (Slurm >= 23.02 sets it) or ``DDP_HPC_JOB_END_TIME`` (unix seconds), read
through ``ddp_hpc.env.job_facts``, else from ``squeue``'s EndTime, asked once at start by rank 0;
when none is known the reason is "preemption".
"""
from __future__ import annotations

import signal
import time
from typing import Mapping

import torch
import torch.distributed as dist

from ddp_hpc import exits
from ddp_hpc.dist import group_initialized
from ddp_hpc.env import job_facts
from ddp_hpc.errors import HintError
from ddp_hpc.slurm.cli import SlurmCLI
from ddp_hpc.slurm.times import timestamp
from ddp_hpc.supervise.avoid import requeue_avoiding


class SignalNameError(HintError, AttributeError):
    """A preemption signal name that names no signal (an AttributeError, as ``signal.SIGNOPE`` is)."""


def preempt_signum(name: str) -> int:
    """``USR2`` / ``SIGUSR2`` / ``usr2`` -> its number; a `SignalNameError` for anything else."""
    num = exits.signal_number(name, numbers=False)
    if num is None:
        raise SignalNameError(f"signal {name!r} is not a signal name",
                              "use a name such as USR2, USR1 or TERM")
    return num


class PreemptionFlag:
    """Installs handlers for the configured signal, SIGTERM and SIGINT (Ctrl-C: a clean stop at
    the next agreed step, with a checkpoint, instead of a KeyboardInterrupt in the middle of a
    collective) that only record what arrived."""

    NONE, TERMINATE, PREEMPT = 0, 1, 2

    def __init__(self, signal_name: str = "USR2") -> None:
        self.preempt_signum = preempt_signum(signal_name)
        self.signums = sorted({self.preempt_signum, int(signal.SIGTERM), int(signal.SIGINT)})
        self.agreed = self.NONE
        """What all ranks agreed on at the deciding step: NONE, TERMINATE or PREEMPT (requeue)."""
        self.received: int | None = None
        self.received_at: float | None = None
        self._previous: dict[int, object] = {}
        self._interrupted_at: float | None = None
        self._pending: tuple[object, torch.Tensor] | None = None

    def _handler(self, signum, frame) -> None:  # noqa: ARG002 - signal API
        if signum == signal.SIGINT:
            # a second Ctrl-C stops right here; one that arrives twice at once (the terminal's
            # and a launcher's forwarded copy) is still the first
            if self._interrupted_at is not None and time.time() - self._interrupted_at > 2.0:
                raise KeyboardInterrupt
            self._interrupted_at = self._interrupted_at or time.time()
        if self.received is None:
            self.received, self.received_at = signum, time.time()

    def install(self) -> "PreemptionFlag":
        for s in self.signums:
            try:
                self._previous[s] = signal.signal(s, self._handler)
            except ValueError:   # not the main thread: signals cannot be caught here
                pass
        return self

    def restore(self) -> None:
        for s, h in self._previous.items():
            try:
                signal.signal(s, h)
            except (ValueError, TypeError):
                pass
        self._previous.clear()

    @property
    def local(self) -> bool:
        return self.received is not None

    @property
    def local_code(self) -> int:
        if self.received is None:
            return self.NONE
        return self.PREEMPT if self.received == self.preempt_signum else self.TERMINATE

    @property
    def requeue_wanted(self) -> bool:
        """True when the agreed stop came from the preemption signal (not SIGTERM) on some rank."""
        return self.agreed == self.PREEMPT

    def poll(self, distributed: bool) -> bool:
        """Called once per step boundary on every rank.  Returns True when all ranks must stop now.

        Distributed: waits for the all_reduce started at the previous boundary (its result is
        identical on every rank), then starts the next one with the current local flag."""
        if not distributed:
            self.agreed = self.local_code
            return self.local
        decided = False
        if self._pending is not None:
            work, t = self._pending
            work.wait()
            self.agreed = int(t.item())
            decided = self.agreed > self.NONE
        t = torch.tensor([self.local_code], dtype=torch.int32)
        if _backend_needs_cuda():
            t = t.cuda()
        self._pending = (dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True), t)
        return decided

    def drain(self) -> None:
        """Wait for an outstanding flag all_reduce (every rank started it, every rank waits)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None


def _backend_needs_cuda() -> bool:
    return group_initialized() and dist.get_backend() == "nccl"


def in_slurm(env) -> bool:
    """A Slurm job step (srun, submitit on Slurm, torchrun under srun): requeue on preemption."""
    return bool(getattr(env, "in_slurm", env.launcher == "slurm"))


def job_end_time(env, rank: int, distributed: bool,
                 environ: Mapping[str, str] | None = None) -> float | None:
    """When this job's time limit ends: from the job's variables (``job_facts().end_time``),
    else, inside Slurm, squeue's EndTime asked by rank 0 and broadcast (then a collective)."""
    end = job_facts(environ).end_time
    if end is None and in_slurm(env) and env.job_id:
        box = [slurm_end_time(env.job_id) if rank == 0 else None]
        if distributed:
            dist.broadcast_object_list(box, src=0)
        end = box[0]
    return end


def slurm_end_time(job_id: str) -> float | None:
    """The job's EndTime from squeue (start + time limit while it runs), via ddp_hpc.slurm.cli."""
    try:
        rows = SlurmCLI().squeue([job_id])
    except Exception:  # noqa: BLE001 - no squeue here: the reason falls back to "preemption"
        return None
    ends = (timestamp(row.get("EndTime", "").strip()) for row in rows)
    return next((end for end in ends if end is not None), None)


def classify(received_at: float | None, end_time: float | None, window_s: float,
             signum: int | None = None) -> str:
    """'interrupted' for SIGINT (Ctrl-C); 'timelimit' when the signal came within `window_s` of
    the job's end time; else 'preemption'."""
    if signum == signal.SIGINT:
        return "interrupted"
    if received_at is not None and end_time is not None and end_time - received_at <= window_s:
        return "timelimit"
    return "preemption"


def requeue(job_id: str, log_dir=None, exclude: bool = True) -> list[str]:
    """Requeue this Slurm job (``JOBID_TASK`` for an array task) through ddp_hpc.slurm.cli; with
    ``exclude``, off the nodes that failed its earlier runs (ddp_hpc.supervise.avoid; returned)."""
    facts = job_facts()
    return requeue_avoiding(job_id, log_dir, exclude=exclude, restart=facts.restart_count,
                            base=facts.restart_base)


def requeue_if_wanted(flag: PreemptionFlag, env, *, rank: int, enabled: bool, distributed: bool,
                      log, exclude: bool | None = None) -> bool:
    """Rank 0 requeues its Slurm job when the preemption signal (not SIGTERM) stopped the run and
    preempt.requeue is on; every rank learns whether that worked (a collective when distributed).
    ``exclude`` (default: DDP_HPC_EXCLUDE_FAILED_NODES, on): keep the job off failed nodes."""
    requeued = False
    slurm_rank0 = rank == 0 and in_slurm(env)
    if slurm_rank0 and not flag.requeue_wanted:
        log.info("not requeuing: SIGTERM (a user's scancel, or Slurm ending or requeueing the job itself)")
    if slurm_rank0 and env.job_id and enabled and flag.requeue_wanted:
        try:
            facts = job_facts()
            avoid = requeue(env.job_id, getattr(log, "dir", None) or facts.log_dir,
                            facts.exclude_failed_nodes if exclude is None else exclude)
            requeued = True
            log.event("requeue", job_id=env.job_id, exclude_nodes=avoid)
            log.info(f"requeued Slurm job {env.job_id}"
                     + (f", off the failed node(s) {', '.join(avoid)}" if avoid else ""))
        except Exception as e:  # noqa: BLE001 - report, then exit with the preempt code
            log.warning(f"requeue of job {env.job_id} failed: {type(e).__name__}: {e}")
    if distributed:
        box = [requeued]
        dist.broadcast_object_list(box, src=0)
        requeued = bool(box[0])
    return requeued
