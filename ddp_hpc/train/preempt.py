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
``SLURM_JOB_END_TIME`` (Slurm >= 23.02 sets it) or ``DDP_HPC_JOB_END_TIME`` (unix seconds), else
from ``squeue``'s EndTime, asked once at start by rank 0; when none is known the reason is
"preemption".
"""
from __future__ import annotations

import os
import signal
import time
from typing import Mapping

import torch
import torch.distributed as dist


def signal_number(name: str) -> int:
    name = name.upper()
    return int(getattr(signal, name if name.startswith("SIG") else "SIG" + name))


class PreemptionFlag:
    """Installs handlers for the configured signal and SIGTERM that only record what arrived."""

    NONE, TERMINATE, PREEMPT = 0, 1, 2

    def __init__(self, signal_name: str = "USR2") -> None:
        self.preempt_signum = signal_number(signal_name)
        self.signums = sorted({self.preempt_signum, int(signal.SIGTERM)})
        self.agreed = self.NONE
        """What all ranks agreed on at the deciding step: NONE, TERMINATE or PREEMPT (requeue)."""
        self.received: int | None = None
        self.received_at: float | None = None
        self._previous: dict[int, object] = {}
        self._pending: tuple[object, torch.Tensor] | None = None

    def _handler(self, signum, frame) -> None:  # noqa: ARG002 - signal API
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
    return dist.is_initialized() and dist.get_backend() == "nccl"


def job_end_time(environ: Mapping[str, str] | None = None) -> float | None:
    environ = os.environ if environ is None else environ
    for key in ("SLURM_JOB_END_TIME", "DDP_HPC_JOB_END_TIME"):
        v = environ.get(key)
        if v:
            try:
                return float(v)
            except ValueError:
                pass
    return None


def slurm_end_time(job_id: str) -> float | None:
    """The job's EndTime from squeue (start + time limit while it runs), via ddp_hpc.slurm.cli."""
    import datetime
    try:
        from ddp_hpc.slurm.cli import SlurmCLI
        rows = SlurmCLI().squeue([job_id])
    except Exception:  # noqa: BLE001 - no squeue here: the reason falls back to "preemption"
        return None
    for row in rows:
        try:
            return datetime.datetime.fromisoformat(row.get("EndTime", "").strip()).timestamp()
        except ValueError:
            continue
    return None


def classify(received_at: float | None, end_time: float | None, window_s: float) -> str:
    """'timelimit' when the signal came within `window_s` of the job's end time, else 'preemption'."""
    if received_at is not None and end_time is not None and end_time - received_at <= window_s:
        return "timelimit"
    return "preemption"


def requeue(job_id: str) -> None:
    """Requeue this Slurm job (``JOBID_TASK`` for an array task) through ddp_hpc.slurm.cli."""
    try:
        from ddp_hpc.slurm.cli import SlurmCLI
    except ImportError as e:   # the module is built separately (issue "Slurm CLI")
        raise RuntimeError(f"cannot requeue job {job_id}: ddp_hpc.slurm.cli is missing ({e})") from e
    SlurmCLI().requeue(job_id)
