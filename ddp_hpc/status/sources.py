"""Where a job's state comes from: the scheduler (`ddp_hpc.slurm.query`: squeue, else sacct,
else ``sacct -c``), else processes or logs.

A local-backend job has only its process ids and its run logs, and a Slurm job that no source
knows any more has its run logs: this module reads a state from those. The status command names
the source that answered, so a user can judge how fresh the answer is.
"""
from __future__ import annotations

import socket

import psutil

from ddp_hpc.runlogs.reader import RunLogs
from ddp_hpc.slurm.query import SUBMIT_SLACK_S, SourceState
from ddp_hpc.slurm.states import JobState, StateInfo

PROCESSES, LOGS = "processes", "logs"


def from_logs(logs: RunLogs, tried: list[str], source: str = LOGS,
              now_alive: bool | None = None, driver_out: str | None = None) -> SourceState:
    """A state told by the run logs alone (no scheduler knows the job); ``driver_out``: where a
    local job's driver wrote what happened before the ranks could write events."""
    outcome = logs.outcome()
    reason = None
    if now_alive:
        return SourceState(StateInfo(JobState.RUNNING, "processes alive"), source, list(tried))
    if outcome == "completed":
        st = StateInfo(JobState.COMPLETED, "end: completed")
    elif outcome == "failed":
        st = StateInfo(JobState.FAILED, "end: failed")
    elif outcome == "preempted":
        runs = logs.runs()
        requeued = bool(runs and runs[-1].requeued)
        st = StateInfo(JobState.REQUEUED if requeued else JobState.PREEMPTED,
                       "end: preempted", "(requeue requested)" if requeued else "")
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


def pids_alive(pids, submitted_at: float | None, cluster: str | None) -> bool | None:
    """True when any of the local job's processes still runs; None when this machine cannot tell
    (the record was written on another host). A pid reused by a process started long after the
    submission does not count. An empty list is the local driver's word that it finished."""
    if pids is not None and len(pids) == 0:
        return False
    if not pids:
        return None
    if cluster and cluster not in (socket.gethostname(), socket.getfqdn(), "localhost"):
        return None
    for pid in pids:
        try:
            p = psutil.Process(int(pid))
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if submitted_at and p.create_time() > float(submitted_at) + SUBMIT_SLACK_S:
                continue
            return True
        except (psutil.Error, ValueError, TypeError):
            continue
    return False
