"""Judging a job from its logs and the scheduler's facts: which rank broke it (the primary
failure), how every rank ended, and the cause of each earlier run that did not complete. A job
that resumed a stopped run numbers its runs after that run's (``restart_base``), and the
scheduler's history maps onto the logs' restarts from there, leaving out the in-allocation
restarts (``inside``: restarts.jsonl), which have restart numbers but are no runs of the scheduler's.
"""
from __future__ import annotations

import dataclasses

from ddp_hpc.judge.attribution import SchedulerFacts, attribute
from ddp_hpc.judge.reader import RunLogs
from ddp_hpc.judge.restarts import sched_index, supervisor_stop
from ddp_hpc.judge.timing import STALL_MIN_S
from ddp_hpc.parsing import to_int
from ddp_hpc.slurm.query import SourceState
from ddp_hpc.slurm.states import JobState, parse_state
from ddp_hpc.status.stopped import STOPPED, stall_before_stop

__all__ = ["CRASHED", "diagnose", "run_causes"]

#: terminal states in which the job itself broke (rather than being stopped from outside): here
#: the rank whose events stopped first is a suspect even without an error event
CRASHED = frozenset({JobState.FAILED, JobState.NODE_FAIL, JobState.OUT_OF_MEMORY,
                     JobState.BOOT_FAIL, JobState.LAUNCH_FAILED})


def sched_state_at(hist: list, restart: int, base: int, inside=()) -> str | None:
    """The scheduler's state name of the run with this restart number (None: not this job's, or
    not in its history)."""
    i = sched_index(restart, base, list(inside))
    return parse_state(hist[i]).job_state.name if 0 <= i < len(hist) else None


def diagnose(logs: RunLogs, sched: SourceState, notes: list[str], base: int = 0, inside=(),
             now: float | None = None):
    """(the primary failure, every rank's ending) as far as the job's state allows judging. A
    job the scheduler requeued (or, resuming a stopped run, started) before its new run wrote
    events is judged by its last run. ``now``: of a job not known to have failed, the ranks
    that wrote an event within the stall floor (`timing.STALL_MIN_S`) of it still run."""
    state = sched.info.job_state
    cur = logs.current_restart()
    stop = supervisor_stop(list(inside), cur)   # the supervisor ended this run's step: no rank did
    inside = [r for r in inside if r.get("restart") is not None]
    over = bool(logs.ranks) and base + (sched.restarts or 0) + len(inside) > cur
    hist = [h.get("state") for h in sched.history]
    name = sched_state_at(hist, cur, base, inside) if over else state.name
    facts = SchedulerFacts(name, [c for c in [sched.exit_code] + [s.get("exit_code") for s in sched.steps] if c])
    crashed = name is not None and JobState[name] in CRASHED
    if stop is None and (crashed or logs.outcome() == "failed"):
        failure, endings = attribute(logs, sched=facts, assume_failed=crashed)
    else:  # cancelled, timed out, preempted, unknown, still running: every rank may have been
        # stopped from outside, so only what a rank wrote itself (an error event, a traceback)
        failure, endings = attribute(logs, sched=facts, evidence_only=True,
                                     live_since=None if now is None else now - STALL_MIN_S)
    if failure is None and (state in STOPPED or stop is not None) and not over:  # a stall the stop ended
        failure = stall_before_stop(logs)
    if failure is not None and state.active and not over:
        notes.append(f"the scheduler says {sched.info.label} but rank {failure.rank} failed "
                     f"({failure.basis}); the job should end soon (kill-on-bad-exit)")
    return failure, endings


def run_causes(logs: RunLogs, runs, sched: SourceState, base: int = 0, inside=()) -> list[dict]:
    """The runs of the event logs; an earlier run that failed says who broke it: the supervisor's
    finding when it restarted that run inside the allocation (its row in ``inside`` read srun's
    reports and the ranks' output while they were the newest; the events alone may name a rank
    that srun's stop hurt), else the attribution from the run's events."""
    hist = [h.get("state") for h in sched.history]
    found = {to_int(x.get("restart"), -1) - 1: x for x in inside if x.get("why")}
    out = []
    for r in runs:
        d = dataclasses.asdict(r)
        if r.restart in found and r.restart < logs.current_restart():
            d["cause"] = _finding(found[r.restart])
        elif r.restart < logs.current_restart() and r.end_status not in ("completed", "preempted"):
            name = sched_state_at(hist, r.restart, base, inside)
            f, _ = attribute(logs, restart=r.restart, sched=SchedulerFacts(name), files=False,
                             assume_failed=name is not None and JobState[name] in CRASHED)
            d["cause"] = f.summary if f else None
        out.append(d)
    return out


def _finding(row: dict) -> str:
    """A restart row's finding in the words of a run's cause: ``rank 3 on n2 killed by signal 9
    (SIGKILL) (the supervisor's finding: srun exit report)``."""
    who = f"rank {row['rank']}" if row.get("rank") is not None else "no rank named"
    where = f" on {row['node']}" if row.get("node") else ""
    why = str(row.get("why"))
    said = why if why.startswith(f"{who}{where}") else f"{who}{where}: {why}"
    return f"{said} (the supervisor's finding: {row.get('basis') or row.get('trigger') or '-'})"
