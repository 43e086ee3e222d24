"""``ddp-hpc status JOBID --stacks``: ask a running job's ranks for the Python stacks of all their
threads, and show them.

How: ``STACK_SIGNAL`` (SIGURG) goes to every rank -- ``scancel --signal=URG`` for a Slurm job
(every task of every step), ``kill`` of the recorded processes for a local one -- and each rank's
watchdog thread (``ddp_hpc.runlogs.watchdog``; the training core starts one, and in a script
``ddp_hpc.report`` or the instrumentation of ``ddp_hpc.exec``, which forwards the signal) writes
a ``stack`` event, which this command waits for. SIGURG is ignored by default, so a process
without a watchdog is unharmed.
A rank that answers nothing is frozen (SIGSTOP, a kernel hang), gone, or does not run ddp_hpc's
watchdog (yet); `silence_causes` names, per rank, only the causes its run logs leave open: a rank
that wrote a step or a stack before runs a watchdog, the training core starts one with its loop,
and a script's exec wrapper writes in its ``start`` event whether it instrumented the script.
"""
from __future__ import annotations

import time
from pathlib import Path

from ddp_hpc import backends
from ddp_hpc.backends.base import CancelError
from ddp_hpc.judge.consequences import ranks_text
from ddp_hpc.judge.reader import RunLogs
from ddp_hpc.judge.stacks import hang_line, stack_summary
from ddp_hpc.runlogs.schema import rank_out
from ddp_hpc.runlogs.watchdog import STACK_SIGNAL
from ddp_hpc.status.targets import StatusError, StatusTarget

__all__ = ["ask_stacks", "render_stacks"]

WAIT_S = 6.0
TAIL = 14


def _signal(target: StatusTarget, cli) -> str:
    """Send STACK_SIGNAL to the target's ranks, through the backend of its job; returns how."""
    backend = backends.of_record(target.record, job_id=target.id, client=cli)
    try:
        return backend.signal_ranks(target.record, target.id, STACK_SIGNAL)
    except CancelError as exc:
        raise StatusError(exc.problem, exc.hint) from None


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


#: how much of the start of rank<R>.out is read for the start-up hook's words
OUT_HEAD_BYTES = 16 << 10
#: what the script's start-up hook prints on its stderr when the instrumentation could not start
_BOOT_FAILED = ("ddp_hpc: no instrumentation in", "ddp_hpc: instrumentation failed to start")
FROZEN = "frozen (stopped, a hang in the kernel) or gone"


def silence_causes(log_dir: str | None, ranks: list[int]) -> dict[int, str]:
    """rank -> why it may not have answered, from what its events of the current run say."""
    logs = RunLogs(log_dir) if log_dir else None
    restart = logs.current_restart() if logs is not None else 0
    out = {}
    for r in ranks:
        stream = logs.ranks.get(r) if logs is not None else None
        evs = stream.of_restart(restart) if stream is not None else []
        out[r] = _cause(r, evs, _out_lines(log_dir, r))
    return out


def _out_lines(log_dir: str | None, rank: int) -> list[str]:
    """The start of ``rank<R>.out`` (where a script's start-up hook says it could not start)."""
    try:
        with open(Path(log_dir or "", rank_out(rank)), "rb") as f:
            return f.read(OUT_HEAD_BYTES).decode("utf-8", "replace").splitlines()
    except OSError:
        return []


def _cause(rank: int, evs: list[dict], out_lines: list[str]) -> str:
    kinds = {e.get("event") for e in evs}
    if kinds & {"end", "error"}:
        return "ended"
    if kinds & {"step", "stack"}:      # its watchdog ran: the training core's, report's or exec's
        return FROZEN
    start = next((e for e in reversed(evs) if e.get("event") == "start"), {})
    launcher = str(start.get("launcher") or "")
    if launcher.startswith("function/"):
        return (f"{FROZEN}, or its function has not called ddp_hpc.report nor ddp_hpc.fit yet (the "
                "watchdog starts then)")
    if not launcher.startswith("exec/"):
        return f"{FROZEN}, or its training loop has not started (its watchdog starts with the loop)"
    if start.get("instrumented") is False:
        return (f"{FROZEN}, or its command runs without ddp_hpc's watchdog: the exec wrapper did not "
                "instrument it (DDP_HPC_INSTRUMENT=0 / submit --no-instrument, or not a Python command)")
    said = next((ln.strip() for ln in out_lines if ln.strip().startswith(_BOOT_FAILED)), None)
    if said:
        return f"{FROZEN}, or no watchdog: {rank_out(rank)} says {said!r}"
    return (f"{FROZEN}, or its script has not imported torch nor taken a step yet (the watchdog of "
            "ddp_hpc's instrumentation starts then)"
            + ("" if start.get("instrumented") else ", or it runs uninstrumented (--no-instrument)"))


def render_stacks(job_id: str, how: str, answers: dict[int, dict], silent: list[int],
                  causes: dict[int, str] | None = None) -> str:
    out = [f"Stacks of job {job_id} (asked with {how}):"]
    if line := hang_line({r: str(ev.get("stack") or "") for r, ev in answers.items()}, ranks_text):
        out.append(f"hang: {line}")
    for r, ev in sorted(answers.items()):
        where = stack_summary(str(ev.get("stack") or ""))
        out.append(f"rank {r} on {ev.get('host') or '?'}: in {where or '?'}"
                   + (f" (step {ev['step']})" if ev.get("step") is not None else ""))
        lines = str(ev.get("stack") or "").rstrip().splitlines()
        out += [f"    {ln}" for ln in lines[:TAIL]] + (["    ..."] if len(lines) > TAIL else [])
    groups: dict[str, list[int]] = {}
    for r in silent:
        groups.setdefault((causes or {}).get(r) or FROZEN + ", ended, or without ddp_hpc's watchdog", []).append(r)
    out += [f"no answer from {ranks_text(rs)}: {why}" for why, rs in groups.items()]
    return "\n".join(out) + "\n"
