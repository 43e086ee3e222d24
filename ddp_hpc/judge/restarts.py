"""In-allocation restarts as the run logs keep them, read back: ``restarts.jsonl`` in the run's log
directory, one JSON object per restart (`schema.ALLOC_RESTART_KEYS`), appended by the supervisor in
the batch step (``ddp_hpc.runlogs.restarts``), read here for status and for the supervisor of a
requeued run (which numbers its restarts on from the earlier runs').

The scheduler's runs of a job (sacct's rows) and the logs' restart numbers: an in-allocation
restart takes a restart number of its own but is no run of the scheduler's, so the scheduler's run
of restart number R is ``R - base - (in-allocation restarts numbered <= R)`` (`sched_index`).

Where a restart's seconds went (`phases`, docs/restarts.md): from the fault to the first training
step of the new run, cut at the supervisor's marks (``detected_at``, ``stopped_at``) and the new
run's rank events (``rendezvous``'s ``proc_start``, ``called_at``, ``up_at``; the ``restored``
event; the first ``step``), each the newest over the ranks, since the first step waits for the
slowest rank. A phase whose mark is missing is folded into the next one that has its mark (no
``restored`` event: the restore counts in the first step), so the phases always add up to the
time lost.
"""
from __future__ import annotations

import json
from pathlib import Path

from ddp_hpc.parsing import to_float, to_int
from ddp_hpc.runlogs.schema import ALLOC_RESTARTS_FILE

__all__ = ["read_restarts", "read_stops", "read_health", "read_holds", "read_restarts_and_stops", "sched_index",
           "first_step_at", "time_lost", "phases", "PHASES", "restored_text", "restored_event", "warm_start"]


def read_restarts(log_dir: str | Path | None, job_id: str | None = None) -> list[dict]:
    """The restarts recorded in ``log_dir`` (of job ``job_id`` only, when given), in order;
    unreadable lines are skipped."""
    return _numbered(_lines(log_dir, job_id), "restart")


def read_stops(log_dir: str | Path | None, job_id: str | None = None) -> list[dict]:
    """The steps the supervisor stopped without restarting them (`runlogs.restarts.append_stop`),
    in order."""
    return _numbered(_lines(log_dir, job_id), "stopped_run")


def read_health(log_dir: str | Path | None, job_id: str | None = None) -> list[dict]:
    """The health checks that excluded nodes before a start (``ddp_hpc.supervise.health``), in
    order."""
    return _numbered(_lines(log_dir, job_id), "health_check")


def read_holds(log_dir: str | Path | None, job_id: str | None = None) -> list[dict]:
    """The times the hang limit stood back because ranks worked outside a collective
    (``ddp_hpc.supervise``), in order."""
    return _numbered(_lines(log_dir, job_id), "held_run")


def read_restarts_and_stops(log_dir: str | Path | None, job_id: str | None = None,
                            ) -> tuple[list[dict], list[dict]]:
    """`read_restarts` and `read_stops` from one read of the file."""
    lines = _lines(log_dir, job_id)
    return _numbered(lines, "restart"), _numbered(lines, "stopped_run")


def _numbered(lines: list[dict], number: str) -> list[dict]:
    """The lines whose ``number`` key holds a whole number."""
    return [rec for rec in lines if to_int(rec.get(number), None) is not None]


def _lines(log_dir: str | Path | None, job_id: str | None) -> list[dict]:
    """The objects of restarts.jsonl (of job ``job_id`` only, when given), in order."""
    if not log_dir:
        return []
    try:
        lines = Path(log_dir, ALLOC_RESTARTS_FILE).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and (job_id is None or str(rec.get("job_id")) == str(job_id)):
            out.append(rec)
    return out


def sched_index(restart: int, base: int, entries: list[dict]) -> int:
    """The index in the scheduler's history of the run with restart number ``restart``: the
    in-allocation restarts numbered ``base..restart`` are no runs of the scheduler's."""
    inside = sum(1 for e in entries if base <= to_int(e.get("restart"), -1) <= restart)
    return restart - base - inside


def first_step_at(logs, restart: int) -> float | None:
    """When the first rank of run ``restart`` reported a training step (a ``RunLogs``)."""
    times = [to_float(e.get("time")) for s in logs.ranks.values() for e in s.of_restart(restart)
             if e.get("event") == "step"]
    times = [t for t in times if t is not None]
    return min(times) if times else None


def time_lost(entry: dict, logs) -> float | None:
    """Seconds from the fault to the first training step after the restart (None: no step yet)."""
    first = first_step_at(logs, to_int(entry.get("restart"), -1))
    fault = to_float(entry.get("fault_at")) or to_float(entry.get("detected_at"))
    return None if first is None or fault is None else round(first - fault, 1)


#: a restart's phases in order, each named after the mark that ends it (`phases`)
PHASES = ("detect", "stop", "start", "import", "rendezvous", "restore", "first_step")


def _newest(events: list[dict], name: str, key: str) -> float | None:
    vals = [t for e in events if e.get("event") == name and (t := to_float(e.get(key))) is not None]
    return max(vals) if vals else None


def phases(entry: dict, logs) -> dict[str, float]:
    """Seconds of each phase (`PHASES`) of the restart ``entry`` (a line of restarts.jsonl), from
    its marks and the new run's events in ``logs`` (a ``RunLogs``): detect (the fault to the
    supervisor's decision), stop (the old ranks gone), start (the new step's processes started),
    import (to ``init_process_group``), rendezvous (the process group up), restore (the
    ``restored`` event), first_step. A phase without its mark is left out and its time counts in
    the next phase that has one; a run with no step yet has no phases past its newest mark."""
    restart = to_int(entry.get("restart"), -1)
    events = [e for s in logs.ranks.values() for e in s.of_restart(restart)]
    marks = (to_float(entry.get("detected_at")), to_float(entry.get("stopped_at")),
             _newest(events, "rendezvous", "proc_start"), _newest(events, "rendezvous", "called_at"),
             _newest(events, "rendezvous", "up_at"), _newest(events, "restored", "time"),
             first_step_at(logs, restart))
    before = to_float(entry.get("fault_at")) or marks[0]
    out: dict[str, float] = {}
    if before is None:
        return out
    for name, at in zip(PHASES, marks, strict=True):
        if at is None:
            continue
        at = max(at, before)
        out[name], before = round(at - before, 3), at
    return out


def warm_start(logs, restart: int) -> bool:
    """Whether every rank of run ``restart`` that wrote its ``rendezvous`` event started from the
    supervisor's warm standby (``ddp_hpc.supervise.warm``): its start-up was paid before the fault."""
    rdzv = [e for s in logs.ranks.values() for e in s.of_restart(restart) if e.get("event") == "rendezvous"]
    return bool(rdzv) and all(e.get("warm") is True for e in rdzv)


def restored_text(event: dict) -> str | None:
    """A ``restored`` event in words: ``restored step 212 from n1's memory (n2 was lost), 0.4 s``
    (None for a start with nothing to restore); a memory restore that failed comes first:
    ``restore of step 212 from n1's memory failed (rank 5: ...): restored step 200 from ...``."""
    source = event.get("source")
    if source not in ("memory", "peer", "file"):
        return None
    where = f"{event.get('node')}'s memory" if source in ("memory", "peer") else event.get("path")
    lost = [str(n) for n in event.get("lost") or []]
    gone = f" ({', '.join(lost)} {'was' if len(lost) == 1 else 'were'} lost)" if lost else ""
    seconds = to_float(event.get("seconds"))
    took = f", {seconds:.1f} s" if seconds is not None else ""
    why = f"{event['fallback']}: " if event.get("fallback") else ""
    return f"{why}restored step {event.get('step')} from {where}{gone}{took}"


def restored_event(logs, restart: int) -> dict | None:
    """Rank 0's ``restored`` event of run ``restart`` (a ``RunLogs``), None without one."""
    stream = logs.ranks.get(0)
    if stream is None:
        return None
    return next((e for e in reversed(stream.of_restart(restart)) if e.get("event") == "restored"), None)
