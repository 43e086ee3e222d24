"""A job's state, decided in one place (`decide`) from what its backend described and what its
record and run logs say. Every answer to "what state is this job in?" comes from here: the job
table and the detail view (``ddp_hpc.status.assemble.resolve``, and the row cache's key), ``--follow`` and
``ddp-hpc cancel``'s wait for the end (through ``ddp_hpc.status.collect``), ``Job.state()`` of
the Python API for a job it did not start here, and a Slurm backend's ``cancel``.

The sources, in the order they are asked (the first that knows answers; ``SourceState.source``
names it):

1. **the backend's description** (``Described``, from ``Backend.describe``): a scheduler's answer
   for a job that has one (squeue, else sacct, else ``sacct -c``), the one authority on a job it
   lists in a state it names; a job without a scheduler has its processes instead (3);
2. **the record's final state** (``final``: what status last saw from the scheduler, what the
   local driver saw when the run ended, ``ddp-hpc cancel``): answers once the scheduler forgot the
   job or cannot be reached (not when the user asked for one source). For a job without a
   scheduler it comes first: its driver wrote it when the run ended, and nothing newer can tell;
3. **the run logs** (their ``end`` events), with a job's processes alive or gone where its backend
   can tell: the only source left when neither a scheduler nor a record knows the job.

`told` is 1 and 2 alone, for a caller that chooses how much of the logs to read by it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ddp_hpc import records
from ddp_hpc.judge.kept import KeptLogs
from ddp_hpc.judge.reader import RunLogs
from ddp_hpc.slurm.query import SourceState
from ddp_hpc.slurm.states import JobState, StateInfo, parse_state
from ddp_hpc.slurm.times import format_duration

__all__ = ["Described", "Decision", "decide", "told", "from_logs", "from_final",
           "PROCESSES", "LOGS", "RECORD", "STATUS"]

PROCESSES, LOGS, RECORD = "processes", "logs", "record"
#: the ``source`` of a final state kept for a job without a scheduler whose processes status found gone
STATUS = "ddp-hpc status (the processes were gone)"


@dataclass(frozen=True)
class Described:
    """What a backend can tell about one of its jobs now, before any log is read
    (``Backend.describe``).

    ``scheduled``: a scheduler queues and runs the job, and its word (``scheduler``: its answer,
    None when it does not list the job or was not asked) is the authority; else ``alive`` says
    whether the processes the record keeps still run (None: cannot tell from here). ``tried``: what
    each source that did not know the job said; ``notes``: what the backend noticed for the user
    (pids recorded on another host, a job of another cluster); ``output``: the file where the
    backend's own part of the job wrote (a batch script's output, the local driver's), named when
    a job ended before its ranks could write."""

    scheduled: bool
    scheduler: SourceState | None = None
    alive: bool | None = None
    tried: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    output: str | None = None


@dataclass(frozen=True)
class Decision:
    """The state decided and, for a job without a scheduler whose end status saw, the final state
    to keep in its record (None: nothing new to keep)."""

    state: SourceState
    keep: dict | None = None


def told(d: Described, final: dict | None, only: str | None = None) -> SourceState | None:
    """Sources 1 and 2: the state the scheduler or the record tells; None when the logs must."""
    if not d.scheduled:
        return from_final(final, []) if final and parse_state(final.get("state")).job_state.terminal else None
    sched = d.scheduler
    if sched is not None and sched.info.job_state is not JobState.UNKNOWN:
        return sched
    final = final if only is None else None
    if final:
        return from_final(final, sched.tried if sched else list(d.tried))
    return sched  # the scheduler lists it in a state it does not name: that, not the logs


def decide(d: Described, final: dict | None, logs: RunLogs | KeptLogs, *, only: str | None = None,
           task_id: str | None = None, submitted_at: float | None = None,
           now: float | None = None) -> Decision:
    """The job's state from its sources in the module's order. ``task_id``: an array task's
    (its run may wait for the earlier tasks); ``submitted_at``: when the record says the job was
    submitted (a job without a scheduler counts its time from there); ``now``: the clock."""
    state = told(d, final, only)
    if state is not None:
        return Decision(state)
    if d.scheduled:
        return Decision(from_logs(logs, list(d.tried), scheduled=True, output=d.output))
    return _unscheduled(d, logs, task_id, submitted_at, time.time() if now is None else now)


def _unscheduled(d: Described, logs: RunLogs | KeptLogs, task_id: str | None,
                 submitted_at: float | None, now: float) -> Decision:
    """A job without a scheduler and without a final state kept: its processes (alive: RUNNING)
    and its logs; the final state to keep once its processes are seen gone."""
    alive = d.alive
    st = from_logs(logs, [], PROCESSES if alive is not None else LOGS, alive, output=d.output)
    if alive and task_id is not None and not logs.exists:
        st.info = StateInfo(JobState.PENDING, "waiting for the earlier tasks")
    cur = logs.current_run()
    first = cur.started if cur is not None else None
    started = first if task_id is not None else (submitted_at or first)
    ended = now if st.info.job_state.active else (cur.last_time if cur is not None else None)
    st.elapsed = format_duration(ended - started) if started and ended else None
    if alive is False and st.info.job_state.terminal:
        return Decision(st, records.local_final(st.info.label, started, ended or now, STATUS, reason=st.reason))
    return Decision(st)


def from_logs(logs: RunLogs | KeptLogs, tried: list[str], source: str = LOGS,
              now_alive: bool | None = None, output: str | None = None, scheduled: bool = False) -> SourceState:
    """A state told by the run logs alone (no scheduler knows the job); ``output``: where the
    backend's own part of the job wrote what happened before the ranks could write events.
    ``scheduled``: a Slurm job, whose SIGTERM may be a user's ``scancel`` or a preemption (Slurm
    sends both the same signal, and only its own records tell them apart): a run stopped by it
    says so."""
    outcome = logs.outcome()
    reason = None
    cur = logs.current_run()
    stopped = cur.end_status if cur is not None and outcome is None else None
    if now_alive:
        return SourceState(StateInfo(JobState.RUNNING, "processes alive"), source, list(tried))
    if logs.log_dir is not None and not logs.listed:
        st = StateInfo(JobState.UNKNOWN, "log directory gone")
        reason = f"log directory {logs.log_dir} is gone and no final state was kept"
    elif stopped == "interrupted":  # Ctrl-C: every rank stopped cleanly
        st = StateInfo(JobState.INTERRUPTED, "end: interrupted")
    elif stopped == "killed":  # a signal from outside (the wrapper forwarded it)
        sigs = sorted({str(e.get("signal")) for e in logs.last_events().values()
                       if e.get("event") == "end" and e.get("signal")})
        st = StateInfo(JobState.CANCELLED, "end: killed", f"by {sigs[0]}" if len(sigs) == 1 else "")
        reason = _either(scheduled, sigs == ["SIGTERM"], "stopped by SIGTERM")
    elif outcome == "completed":
        st = StateInfo(JobState.COMPLETED, "end: completed")
    elif outcome == "failed":
        st = StateInfo(JobState.FAILED, "end: failed")
    elif outcome == "preempted":
        requeued = bool(cur and cur.requeued)
        # under Slurm only the preemption signal (USR2) requeues: a stop without a requeue is SIGTERM's
        either = scheduled and not requeued and cur is not None and cur.preempt_reason == "preemption"
        st = StateInfo(JobState.REQUEUED if requeued else JobState.PREEMPTED,
                       "end: preempted", "(requeue requested)" if requeued else "(or scancel)" if either else "")
        reason = _either(either, True, "stopped with a checkpoint on SIGTERM")
    elif now_alive is False and not logs.ranks:  # died before any rank wrote an event
        st = StateInfo(JobState.FAILED, "ended before its first event")
        reason = "ended before its first event" + (f"; see {output}" if output else "")
    elif not logs.exists:
        st = StateInfo(JobState.UNKNOWN, "no scheduler record and no run logs")
    elif now_alive is False:
        st = StateInfo(JobState.FAILED, "processes gone without an end event",
                       "(processes gone without an end event)")
    else:
        st = StateInfo(JobState.UNKNOWN, "logs have no end event yet")
    return SourceState(st, source, list(tried), reason=reason)


def _either(scheduled: bool, sigterm: bool, what: str) -> str | None:
    """The reason of a Slurm job's run that SIGTERM stopped, as far as its logs can tell."""
    if not (scheduled and sigterm):
        return None
    return (f"{what}, which both `scancel` and a preemption send; with no scheduler source left (squeue, "
            "sacct) status cannot tell which")


def from_final(final: dict, tried: list[str]) -> SourceState:
    """The terminal state a job's record keeps (`records.store_final`)."""
    seen = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(final.get("seen_at") or 0)))
    note = f"record: the final state {final.get('source') or 'the scheduler'} reported at {seen}"
    return SourceState(parse_state(final.get("state")), RECORD, list(tried) + [note],
                       elapsed=final.get("elapsed"), time_limit=final.get("time_limit"),
                       node_list=final.get("node_list"), exit_code=final.get("exit_code"),
                       steps=list(final.get("steps") or []), restarts=final.get("restarts"),
                       reason=final.get("reason"))
