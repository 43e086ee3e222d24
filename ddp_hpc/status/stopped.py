"""What a job stopped from outside (cancelled, interrupted, out of time) still tells: which rank
had stalled before the stop.

While a job runs, status names its silent ranks (``ddp_hpc.judge.timing.stall``: "rank 1
stopped first"). A user who sees that cancels the job, and the stop makes every rank write an
``end`` event: the stall is gone from the ranks' newest events. So the stall is judged again as
it stood at the moment of the stop, from the events written before it, and becomes the job's
First failure. Most often every rank had gone silent (one rank stuck, the others waiting for it
in a collective): then the stacks the ranks' watchdogs wrote during the silence name the culprit.
"""
from __future__ import annotations

from ddp_hpc.judge import timing
from ddp_hpc.judge.attribution import Failure
from ddp_hpc.judge.consequences import ranks_text
from ddp_hpc.judge.reader import RunLogs
from ddp_hpc.judge.stacks import collective, own_frame
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
    ``stuck``), or None when every rank was going on until the stop. When every rank had gone
    silent (the usual hang: one rank stuck, the others waiting for it in a collective), the
    stacks they wrote during the silence tell the culprit: the ranks outside a collective while
    the others wait in one, else the ranks that wrote no stack while the others did (frozen);
    else the ranks whose last step is behind the others'; else the whole job hung and the
    failure says so."""
    restart = logs.current_restart()
    per_rank = {r: s.of_restart(restart) for r, s in logs.ranks.items()}
    stop = stop_time(per_rank)
    if stop is None:
        return None
    before = {r: [e for e in evs if (to_float(e.get("time")) or 0.0) < stop] for r, evs in per_rank.items()}
    sl = timing.stall(before, stop)
    if sl is None:
        return None
    # a silent rank's newest event of its own (its watchdog's stack events come during the silence)
    last = {r: max((to_float(e.get("time")) or 0.0 for e in before[r] if e.get("event") != "stack"), default=0.0)
            for r in sl.ranks}
    blamed, how, basis = _culprits(before, sl, len(sl.ranks) == len([r for r, evs in before.items() if evs]))
    blamed = sorted(blamed, key=lambda r: (last[r], r))
    rank = blamed[0]
    step = sl.last_steps.get(str(rank))
    others = [s["step"] for r, evs in before.items() if r not in blamed
              for s in evs if s.get("event") == "step" and isinstance(s.get("step"), int)]
    at = f"last step {step}" if step is not None else "no step"
    went_on = f"; the others reached step {max(others)}" if others and max(others) != step else ""
    gap = format_duration(stop - last[rank])
    who = f"rank {rank}" if len(blamed) == 1 else (
        f"rank {rank} (of {plural(len(blamed), 'silent rank')})" if how == "stopped first" else ranks_text(blamed))
    hang = timing.hang(before, sl.ranks)
    host = next((e.get("host") for e in reversed(before[rank]) if e.get("host")), None)
    f = Failure(rank=rank, basis=basis, time=last[rank], host=host, restart=restart, kind="stuck", ranks=blamed,
                summary=f"{who} {how}: no event for {gap} before the stop ({at}{went_on})"
                + (f"; hang: {hang}" if hang else ""))
    stacks, _ = timing.silent_stacks(before, sl.ranks)
    if str(rank) in stacks:
        f.stack = {"summary": stacks[str(rank)], "reason": "its newest stack before the stop"}
    peers: dict[str, list[int]] = {}
    for r, where in stacks.items():
        if int(r) not in blamed:
            peers.setdefault(where, []).append(int(r))
    f.peer_stacks = [{"ranks": sorted(rs), "summary": where} for where, rs in peers.items()]
    return f


def _culprits(before: dict[int, list[dict]], sl: timing.Stall, everyone: bool) -> tuple[list[int], str, str]:
    """(the ranks to blame, how they stalled, how we know) for a stall before the stop."""
    if not everyone:
        return sl.ranks, "stopped first", "its events stopped before the job was stopped, while the others went on"
    texts = timing.silent_texts(before, sl.ranks)
    waiting = [r for r, text in texts.items() if collective(text) is not None]
    outside = sorted(r for r, text in texts.items() if collective(text) is None and own_frame(text) is not None)
    if waiting and outside:
        return outside, "hung outside a collective while the others waited in one", (
            "its stack before the stop is outside a collective while the others' are inside one")
    frozen = sorted(r for r in sl.ranks if r not in texts)
    if texts and frozen:
        return frozen, "wrote no stack while the others did (frozen or gone)", (
            "every rank went silent before the stop; it alone wrote no stack")
    if sl.behind:
        return sl.behind, "stopped first", (
            "every rank went silent before the stop; its last step is behind the others'")
    return sl.ranks, "all went silent together: the whole job hung, no rank stopped first", (
        "every rank went silent before the stop, at the same step, with no stack telling them apart")
