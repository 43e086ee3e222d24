"""A hang, found in seconds rather than after the collective timeout, and its culprit named from
the ranks' stacks (docs/restarts.md, "A hang").

The clock (`StepClock`): the ranks' ``step`` events (ddp_hpc's loop, and a plain script's through
the instrumentation of ``ddp_hpc.exec``) give each rank's seconds per step (the time between two of
its step events over the steps between them) and the gap between its events (a log interval of
several steps). The step is hung when no rank showed a sign of life for
``max(floor, HANG_FACTOR x the median seconds per step, EVENT_GAPS x the median gap)``: the floor
is ``--hang-timeout`` (30 s by default; 0 turns the fast detection off), and the gaps keep a run
that logs every N steps from being called hung between two of its events. No limit before a rank
wrote two step events: a run still loading is left to the stall timeout (a config job's
``train.collective_timeout_s`` + 15 s).

The culprit (`find_culprit`): before the step is stopped, every rank is asked for its stacks
(SIGURG, as ``ddp-hpc status --stacks`` does), so the evidence survives the stop: up to 5 s, or
2 s after the newest answer. Each answer carries what the rank did over its last seconds
(``work``: CPU time, bytes read and written, the places its main thread was seen;
``runlogs.vitals``). A rank whose main thread is not inside a collective while the others wait in
one hangs only when it is still (no CPU, no IO, one place); else a rank that does not answer
(frozen: stopped, or a hang outside Python). A rank that works outside a collective (a script's
rank-0 ``torch.save`` or evaluation while the others wait in ``dist.barrier()``) is busy, never
hung, before the collective timeout (`busy_ranks`), and so is a step where every rank answered
and none waits in a collective (`all_busy`: every rank evaluates, or saves, between two steps):
the supervisor watches on and asks again after twice the wait (the stall timeout still applies).
A rank in an endless loop outside a collective is left to the collective timeout.
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass

from ddp_hpc.judge.stacks import collective, own_frame
from ddp_hpc.parsing import to_float, to_int
from ddp_hpc.runlogs.vitals import working
from ddp_hpc.slurm.cli import SlurmError

__all__ = ["StepClock", "Hang", "find_culprit", "all_busy", "busy_ranks", "no_hang", "hold_row", "work_text",
           "ask_stacks", "HANG_FACTOR", "EVENT_GAPS", "DEFAULT_HANG_S"]

#: the floor of the hang limit by default (``--hang-timeout``), seconds
DEFAULT_HANG_S = 30.0
#: the hang limit is at least this many times the median seconds per step
HANG_FACTOR = 10.0
#: ... and this many times the median gap between a rank's step events
EVENT_GAPS = 3.0
#: how long the ranks get to answer the stack request, seconds
STACK_WAIT_S = 5.0
#: ... and how long the last ones get once no answer came for this long (a frozen rank never
#: answers: the others' answers come together, within a second)
ANSWER_GAP_S = 2.0
#: intervals kept for the medians
KEEP = 64


class StepClock:
    """The hang limit from the ranks' step events (`limit`)."""

    def __init__(self, floor_s: float) -> None:
        self.floor_s = floor_s
        self._last: dict[int, tuple[float, int]] = {}
        self._per_step: deque[float] = deque(maxlen=KEEP)
        self._gaps: deque[float] = deque(maxlen=KEEP)

    def add(self, ev: dict) -> None:
        """Take a ``step`` event (others are ignored)."""
        t, step, rank = to_float(ev.get("time")), to_int(ev.get("step"), None), to_int(ev.get("rank"), None)
        if ev.get("event") != "step" or t is None or step is None or rank is None:
            return
        before = self._last.get(rank)
        self._last[rank] = (t, step)
        if before is not None and step > before[1] and t >= before[0]:
            self._per_step.append((t - before[0]) / (step - before[1]))
            self._gaps.append(t - before[0])

    def limit(self) -> float | None:
        """Seconds without a sign of life that make a hang; None: off, or no interval seen yet."""
        if self.floor_s <= 0 or not self._per_step:
            return None
        return round(max(self.floor_s, HANG_FACTOR * statistics.median(self._per_step),
                         EVENT_GAPS * statistics.median(self._gaps)), 1)


@dataclass(frozen=True)
class Hang:
    """The rank that hangs, its node, what it was doing (``why``, without the rank), and how we know."""

    rank: int
    host: str | None
    why: str
    basis: str


def ask_stacks(cli, job_id, tail, wait_s: float = STACK_WAIT_S) -> tuple[dict[int, dict], dict[int, str | None]]:
    """Ask every rank of the job for its stacks (``scancel --signal=URG``) and wait up to
    ``wait_s`` for their ``stack`` events. ``tail``: a new ``watch.EventTail`` of the run.
    Returns (rank -> its answer, rank -> its host) for the ranks that wrote events in the run."""
    hosts = {to_int(e.get("rank"), -1): e.get("host") for e in tail.poll()}
    hosts.pop(-1, None)
    asked = time.time()
    try:
        cli.cancel(job_id, signal="URG")
    except (SlurmError, OSError):
        return {}, hosts
    answers: dict[int, dict] = {}
    deadline = last = time.monotonic() + wait_s
    while time.monotonic() < min(deadline, last) and not (hosts and set(answers) >= set(hosts)):
        time.sleep(0.2)
        for e in tail.poll():
            rank = to_int(e.get("rank"), None)
            if rank is not None and e.get("event") == "stack" and (to_float(e.get("time")) or 0) >= asked - 0.5:
                answers[rank] = e
                hosts.setdefault(rank, e.get("host"))
                last = time.monotonic() + ANSWER_GAP_S
    return answers, hosts


def _outside(answers: dict[int, dict]) -> tuple[dict[int, str | None], list[str]]:
    """rank -> the collective it waits in (None: outside one), and the collectives waited in."""
    waits = {r: collective(str(a.get("stack") or "")) for r, a in answers.items()}
    return waits, sorted({w for w in waits.values() if w})


def work_text(answer: dict) -> str:
    """``cpu 4.1 s, 120 MB read or written, 7 places in 10 s`` from an answer's ``work``."""
    w = answer.get("work") if isinstance(answer.get("work"), dict) else {}
    try:
        return (f"cpu {float(w['cpu_s']):.1f} s, {int(w['io_bytes']) / 1e6:.1f} MB read or written, "
                f"{int(w['places'])} place(s) in {float(w['over_s']):.0f} s")
    except (KeyError, TypeError, ValueError):
        return "no sample of its work"


def busy_ranks(answers: dict[int, dict], hosts: dict[int, str | None]) -> list[int]:
    """The ranks that answered outside a collective and work (`runlogs.vitals.working`)."""
    waits, _ = _outside(answers)
    return [r for r in sorted(hosts) if r in waits and not waits[r] and working(answers[r].get("work"))]


def find_culprit(answers: dict[int, dict], hosts: dict[int, str | None]) -> Hang | None:
    """The rank that hangs, from the stack answers of the ranks in ``hosts``: one not inside a
    collective and still (no CPU, no IO, one place; an answer without a sample counts as still)
    while another waits in one, else one that did not answer (frozen; a slow answer on a loaded
    machine does not outweigh a rank seen still outside the collective); None when the stacks
    name nobody (every rank silent, every rank in a collective or none), or while any rank works
    outside a collective (`busy_ranks`: the others may wait for it in more ways than a collective,
    a loaded machine may delay an answer; a frozen rank is named once nobody works)."""
    if busy_ranks(answers, hosts):
        return None
    ranks = sorted(hosts)
    waits, waiting = _outside(answers)
    others = f"the others waited in {', '.join(waiting)}" if waiting else "the others answered"
    free = [r for r in ranks if r in waits and not waits[r] and not working(answers[r].get("work"))]
    if free and waiting:
        r = free[0]
        where = own_frame(str(answers[r].get("stack") or "")) or "outside a collective"
        return Hang(r, hosts.get(r), f"hung in {where}, not in a collective",
                    f"its stacks: not in a collective ({where}) and still ({work_text(answers[r])}) "
                    f"while {others}")
    silent = [r for r in ranks if r not in answers]
    if silent and answers:
        r = silent[0]
        return Hang(r, hosts.get(r), "hung: it answered no stack request (frozen: stopped, or a hang "
                    "outside Python)", f"its stacks: no answer to SIGURG while {others}")
    return None


def all_busy(answers: dict[int, dict], hosts: dict[int, str | None]) -> bool:
    """Every rank answered and none waits in a collective: they work, no rank waits for another."""
    return bool(hosts) and set(answers) >= set(hosts) and not any(
        collective(str(a.get("stack") or "")) for a in answers.values())


def no_hang(answers: dict[int, dict], hosts: dict[int, str | None]) -> list[int] | None:
    """The ranks that work outside a collective (`busy_ranks`; empty when every rank answered
    outside one: `all_busy`), or None: the answers do not show the ranks at work."""
    busy = busy_ranks(answers, hosts)
    return busy if busy or all_busy(answers, hosts) else None


def hold_row(run: int, job_id, end, busy: list[int], answers: dict[int, dict], again_s: float) -> dict:
    """The line of restarts.jsonl for a hang limit that stood back (`schema.ALLOC_HOLD_KEYS`)
    after the stalled `watch.StepEnd` ``end`` of run ``run``."""
    return {"held_run": run, "job_id": job_id, "time": round(end.detected_at, 3), "after_s": end.stall_s,
            "ranks": busy, "again_s": again_s,
            "work": "; ".join(f"rank {r}: {work_text(answers[r])}" for r in busy) or "every rank outside a collective"}
