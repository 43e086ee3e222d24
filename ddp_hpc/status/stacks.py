"""``ddp-hpc status JOBID --stacks``: ask a running job's ranks for the Python stacks of all their
threads, and show them.

How: ``STACK_SIGNAL`` (SIGURG) goes to every rank -- ``scancel --signal=URG`` for a Slurm job
(every task of every step), ``kill`` of the recorded processes for a local one -- and each rank's
watchdog thread (``ddp_hpc.runlogs.watchdog``; the training core starts one, and in a script
``ddp_hpc.report`` or the instrumentation of ``ddp_hpc.exec``, which forwards the signal) writes
a ``stack`` event, which this command waits for. SIGURG is ignored by default, so a process
without a watchdog is unharmed.
A rank that answers nothing is frozen (SIGSTOP, a kernel hang), gone, or does not run ddp_hpc's
watchdog; its silence is reported as such.
"""
from __future__ import annotations

import os
import time

from ddp_hpc.runlogs.consequences import ranks_text
from ddp_hpc.runlogs.reader import RunLogs
from ddp_hpc.runlogs.stacks import hang_line, stack_summary
from ddp_hpc.runlogs.watchdog import STACK_SIGNAL
from ddp_hpc.status.targets import StatusError, StatusTarget

__all__ = ["ask_stacks", "render_stacks"]

WAIT_S = 6.0
TAIL = 14


def _signal(target: StatusTarget, cli) -> str:
    """Send STACK_SIGNAL to the target's ranks; returns how."""
    rec = target.record
    if target.local:
        pids = [p for p in ((rec.pids if rec is not None else None) or []) if isinstance(p, int)]
        sent = []
        for pid in pids:
            try:
                os.kill(pid, STACK_SIGNAL)
                sent.append(pid)
            except (ProcessLookupError, PermissionError):
                continue
        if not sent:
            raise StatusError(f"job {target.id}: none of its processes {pids} is running here",
                              "--stacks asks a running job; for an ended one see its logs")
        return f"SIGURG to processes {', '.join(map(str, sent))}"
    if cli is None:
        raise StatusError(f"job {target.id}: Slurm's commands are not on PATH",
                          "run --stacks on a login node of the job's cluster")
    cli.cancel(target.id, signal="URG")
    return f"scancel --signal=URG {target.id}"


def ask_stacks(target, cli, wait_s: float = WAIT_S) -> tuple[str, dict[int, dict], list[int]]:
    """(how the ranks were asked, rank -> its stack event written after the request, ranks that
    did not answer). Waits up to ``wait_s`` for every rank that has written events."""
    if not target.log_dir:
        raise StatusError(f"job {target.id}: no log directory known", "pass --log-dir DIR")
    asked_at = time.time()
    how = _signal(target, cli)
    deadline = time.monotonic() + wait_s
    answers: dict[int, dict] = {}
    ranks: list[int] = []
    while True:
        logs = RunLogs(target.log_dir)
        ranks = sorted(logs.ranks)
        for r, stream in logs.ranks.items():
            fresh = [e for e in stream.events
                     if e.get("event") == "stack" and float(e.get("time") or 0) >= asked_at - 0.5]
            if fresh:
                answers[r] = fresh[-1]
        if (ranks and set(answers) >= set(ranks)) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    return how, answers, [r for r in ranks if r not in answers]


def render_stacks(job_id: str, how: str, answers: dict[int, dict], silent: list[int]) -> str:
    out = [f"Stacks of job {job_id} (asked with {how}):"]
    if line := hang_line({r: str(ev.get("stack") or "") for r, ev in answers.items()}, ranks_text):
        out.append(f"hang: {line}")
    for r, ev in sorted(answers.items()):
        where = stack_summary(str(ev.get("stack") or ""))
        out.append(f"rank {r} on {ev.get('host') or '?'}: in {where or '?'}"
                   + (f" (step {ev['step']})" if ev.get("step") is not None else ""))
        lines = str(ev.get("stack") or "").rstrip().splitlines()
        out += [f"    {ln}" for ln in lines[:TAIL]] + (["    ..."] if len(lines) > TAIL else [])
    if silent:
        out.append(f"no answer from rank{'s' if len(silent) > 1 else ''} "
                   f"{', '.join(map(str, silent))}: frozen (stopped, a hang in the kernel), ended, "
                   "or not running ddp_hpc's watchdog (a script run with --no-instrument, or one that has not "
                   "imported torch yet)")
    return "\n".join(out) + "\n"
