"""The sources a job's state is read from, one reader each: the scheduler's (`ddp_hpc.slurm.query`:
squeue, else sacct, else ``sacct -c``), the final state a record keeps (`from_final`), a local
job's processes (`local_state`, through `launch.tree.recorded_alive`) and the run logs
(`from_logs`); and what to keep in a record of an end a Slurm source reported (`final_to_keep`).
Which source answers is decided in one place, `ddp_hpc.status.resolve`. The status command names
the source that answered, so a user can judge how fresh the answer is.
"""
from __future__ import annotations

import time
from pathlib import Path

from ddp_hpc import records
from ddp_hpc.judge import kept
from ddp_hpc.judge.kept import KeptLogs
from ddp_hpc.judge.reader import RunLogs
from ddp_hpc.launch.tree import recorded_alive
from ddp_hpc.records import JobRecord
from ddp_hpc.runlogs.schema import LOCAL_DRIVER_OUT
from ddp_hpc.slurm.query import SACCT, SACCT_C, SQUEUE, SourceState
from ddp_hpc.slurm.states import JobState, StateInfo, parse_state
from ddp_hpc.slurm.times import format_duration

PROCESSES, LOGS, RECORD = "processes", "logs", "record"
#: the ``source`` of a local job's final state that status saw (its processes gone)
STATUS = "ddp-hpc status (the processes were gone)"


def from_logs(logs: RunLogs, tried: list[str], source: str = LOGS,
              now_alive: bool | None = None, driver_out: str | None = None, scheduled: bool = False) -> SourceState:
    """A state told by the run logs alone (no scheduler knows the job); ``driver_out``: where a
    local job's driver wrote what happened before the ranks could write events. ``scheduled``: a
    Slurm job, whose SIGTERM may be a user's ``scancel`` or a preemption (Slurm sends both the
    same signal, and only its own records tell them apart): a run stopped by it says so."""
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
        reason = "ended before its first event" + (f"; see {driver_out}" if driver_out else "")
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


def final_to_keep(sched: SourceState, logs, now: float, old: dict | None) -> dict | None:
    """What to keep of a terminal state a Slurm source reported (None: not one), with the table's
    facts of the logs (`kept.summarize`; a detail view's reading keeps those ``old`` had)."""
    if not scheduler_ended(sched):
        return None
    # srun's per-task codes are not shown for a completed job (a requeue's appended batch output
    # keeps an earlier run's): neither read nor kept
    codes = None if sched.state.state is JobState.COMPLETED else logs.srun_exit_codes()
    summary = logs.summary if isinstance(logs, KeptLogs) else kept.summarize(logs, codes)
    final = {"state": sched.state.label, "state_name": sched.state.state.name, "source": sched.source,
             "seen_at": round(now, 3), "elapsed": sched.elapsed, "time_limit": sched.time_limit,
             "exit_code": sched.exit_code, "steps": sched.steps, "node_list": sched.node_list,
             "restarts": sched.restarts, "rank_exit_codes": {str(r): c for r, c in (codes or {}).items()}}
    if (summary := summary or (old or {}).get("logs")) is not None:
        final["logs"] = summary
    return final


def scheduler_ended(sched: SourceState | None) -> bool:
    """A Slurm source (squeue, sacct) reports that the job ended."""
    return sched is not None and sched.source in (SQUEUE, SACCT, SACCT_C) and sched.state.state.terminal


def from_final(final: dict, tried: list[str]) -> SourceState:
    """The terminal state a job's record keeps (`records.store_final`)."""
    seen = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(final.get("seen_at") or 0)))
    note = f"record: the final state {final.get('source') or 'the scheduler'} reported at {seen}"
    return SourceState(parse_state(final.get("state")), RECORD, list(tried) + [note],
                       elapsed=final.get("elapsed"), time_limit=final.get("time_limit"),
                       node_list=final.get("node_list"), exit_code=final.get("exit_code"),
                       steps=list(final.get("steps") or []), restarts=final.get("restarts"),
                       reason=final.get("reason"))


def local_state(rec: JobRecord | None, task_id: str | None, logs: RunLogs | KeptLogs, notes: list[str],
                now: float) -> tuple[SourceState, dict | None]:
    """A local job's (or local array task's) state from its processes (alive: RUNNING) and its
    run logs, when its record keeps no final state (`ddp_hpc.status.resolve`), and the final
    state to keep in its record (None: nothing new)."""
    pids = rec.pids if rec is not None else None
    alive = recorded_alive(pids, rec.pid_times, rec.cluster) if rec is not None else None
    if alive is None and pids:
        notes.append("pids recorded on another host; state from the logs")
    log_dir = rec.log_dir if rec is not None else None
    driver = str(Path(log_dir) / LOCAL_DRIVER_OUT) if log_dir else None
    st = from_logs(logs, [], PROCESSES if alive is not None else LOGS, alive, driver_out=driver)
    if alive and task_id is not None and not logs.exists:
        st.state = StateInfo(JobState.PENDING, "waiting for the earlier tasks")
    cur = logs.current_run()
    first = cur.started if cur is not None else None
    started = first if task_id is not None else ((rec.submitted_at if rec is not None else None) or first)
    ended = now if st.state.state.active else (cur.last_time if cur is not None else None)
    st.elapsed = format_duration(ended - started) if started and ended else None
    if alive is False and st.state.state.terminal:
        return st, records.local_final(st.state.label, started, ended or now, STATUS, reason=st.reason)
    return st, None
