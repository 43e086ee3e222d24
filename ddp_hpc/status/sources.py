"""What status keeps of a job's state: the final state to keep in a record of an end a Slurm
source reported (`final_to_keep`), and the names of the sources (``ddp_hpc.judge.decide``, the
one place a state is decided, reads them). The status command names the source that answered, so
a user can judge how fresh the answer is.
"""
from __future__ import annotations

from ddp_hpc.judge import kept
from ddp_hpc.judge.decide import LOGS, PROCESSES, RECORD, STATUS
from ddp_hpc.judge.kept import KeptLogs
from ddp_hpc.slurm.query import SACCT, SACCT_C, SQUEUE, SourceState
from ddp_hpc.slurm.states import JobState

__all__ = ["final_to_keep", "scheduler_ended", "LOGS", "PROCESSES", "RECORD", "STATUS"]


def final_to_keep(sched: SourceState, logs, now: float, old: dict | None) -> dict | None:
    """What to keep of a terminal state a Slurm source reported (None: not one), with the table's
    facts of the logs (`kept.summarize`; a detail view's reading keeps those ``old`` had)."""
    if not scheduler_ended(sched):
        return None
    # srun's per-task codes are not shown for a completed job (a requeue's appended batch output
    # keeps an earlier run's): neither read nor kept
    codes = None if sched.info.job_state is JobState.COMPLETED else logs.srun_exit_codes()
    summary = logs.summary if isinstance(logs, KeptLogs) else kept.summarize(logs, codes)
    final = {"state": sched.info.label, "state_name": sched.info.job_state.name, "source": sched.source,
             "seen_at": round(now, 3), "elapsed": sched.elapsed, "time_limit": sched.time_limit,
             "exit_code": sched.exit_code, "steps": sched.steps, "node_list": sched.node_list,
             "restarts": sched.restarts, "rank_exit_codes": {str(r): c for r, c in (codes or {}).items()}}
    if (summary := summary or (old or {}).get("logs")) is not None:
        final["logs"] = summary
    return final


def scheduler_ended(sched: SourceState | None) -> bool:
    """A Slurm source (squeue, sacct) reports that the job ended."""
    return sched is not None and sched.source in (SQUEUE, SACCT, SACCT_C) and sched.info.job_state.terminal
