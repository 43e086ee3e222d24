"""What a job stopped from outside (cancelled, interrupted, out of time) still tells: which rank
had stalled before the stop.

While a job runs, status names its silent ranks (``ddp_hpc.judge.timing.stall``: "rank 1
stopped first"). A user who sees that cancels the job, and the stop makes every rank write an
``end`` event: the stall is gone from the ranks' newest events. So the stall is judged again as
it stood at the moment of the stop, from the events written before it, and becomes the job's
First failure.
"""
from __future__ import annotations

from ddp_hpc.judge import timing
from ddp_hpc.judge.attribution import Failure
from ddp_hpc.judge.reader import RunLogs
from ddp_hpc.parsing import to_float
from ddp_hpc.slurm.states import JobState
from ddp_hpc.slurm.times import format_duration
from ddp_hpc.text import plural

#: states in which the job was stopped from outside: a stall before the stop is the diagnosis
STOPPED = frozenset({JobState.CANCELLED, JobState.INTERRUPTED, JobState.TIMEOUT})
#: events that a stop makes a rank write
STOP_EVENTS = ("end", "preempt")


def stop_time(per_rank: dict[int, list[dict]]) -> float | None:
    """When the stop reached the job: its first ``end`` or ``preempt`` event, else (the ranks
    were killed before they could write one) the newest event of any rank."""
    stops = [t for evs in per_rank.values() for e in evs
             if e.get("event") in STOP_EVENTS and (t := to_float(e.get("time"))) is not None]
    if stops:
        return min(stops)
    last = [t for evs in per_rank.values() for e in evs if (t := to_float(e.get("time"))) is not None]
    return max(last) if last else None


def stall_before_stop(logs: RunLogs) -> Failure | None:
    """The rank that had stalled when the current run was stopped, as a Failure (kind
    ``stuck``), or None when every rank was going on until the stop."""
    restart = logs.current_restart()
    per_rank = {r: s.of_restart(restart) for r, s in logs.ranks.items()}
    stop = stop_time(per_rank)
    if stop is None:
        return None
    before = {r: [e for e in evs if (to_float(e.get("time")) or 0.0) < stop] for r, evs in per_rank.items()}
    sl = timing.stall(before, stop)
    if sl is None or len(sl["ranks"]) == len([r for r, evs in before.items() if evs]):
        return None  # every rank silent: the whole job hung, no rank stopped first
    last = {r: max(to_float(e.get("time")) or 0.0 for e in before[r]) for r in sl["ranks"]}
    blamed = sorted(sl["ranks"], key=lambda r: (last[r], r))
    rank = blamed[0]
    step = sl["last_steps"].get(str(rank))
    others = [s["step"] for r, evs in before.items() if r not in sl["ranks"]
              for s in evs if s.get("event") == "step" and isinstance(s.get("step"), int)]
    at = f"last step {step}" if step is not None else "no step"
    went_on = f"; the others reached step {max(others)}" if others else ""
    gap = format_duration(stop - last[rank])
    who = f"rank {rank}" if len(blamed) == 1 else f"rank {rank} (of {plural(len(blamed), 'silent rank')})"
    host = next((e.get("host") for e in reversed(before[rank]) if e.get("host")), None)
    f = Failure(rank=rank, basis=f"its events stopped {gap} before the job was stopped, while the others "
                "went on", time=last[rank], host=host, restart=restart, kind="stuck", ranks=blamed,
                summary=f"{who} stopped first: no event for {gap} before the stop ({at}{went_on})")
    stacks, _ = timing.silent_stacks(before, [rank])
    if str(rank) in stacks:
        f.stack = {"summary": stacks[str(rank)], "reason": "its newest stack before the stop"}
    return f
