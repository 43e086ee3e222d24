"""Rank 0's event file as the job table reads it (``RunLogs(ends_only=True)``): its newest run
whole and, of the lines before that run, only the start and eval events.

The table's row of a job takes from rank 0's events the newest run (its start, steps, ending:
progress, device, elapsed, outcome), the job's first start (its world size) and the newest eval
event of any run. Decoding every earlier run's step events as well was a third of the JSON
decoding of a first ``status --limit 0`` over thousands of ended jobs. Where the newest run has
no metrics event with ``total_steps`` (progress then looks at the earlier runs), the file is
decoded whole, as `tails.read_events` does.
"""
from __future__ import annotations

from pathlib import Path

from ddp_hpc.judge.tails import RankStream, decoded, read_events, restart_of

__all__ = ["read_newest_run", "METRIC_EVENTS"]

#: what `timing.progress` takes progress from
METRIC_EVENTS = ("step", "epoch", "end", "eval", "checkpoint")
#: the earlier runs' events the table asks about (a line holding neither cannot be one of them)
EARLIER_EVENTS = ("start", "eval")


def read_newest_run(path: Path) -> RankStream:
    """Rank 0's events as `tails.read_events` reads them whole, but of the lines before the newest
    run's ``start`` event only the start and eval events (``newest_only``; bad lines are counted
    among those decoded); the whole file where the newest run holds no metrics event with
    ``total_steps``, or has no start event."""
    stream = RankStream(rank=0, path=path)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return stream
    lines = [line for line in text.splitlines() if line.strip()]
    newest, restart, cut = [], None, 0
    for i, ev in zip(range(len(lines) - 1, -1, -1), decoded(lines[::-1])):
        if not (isinstance(ev, dict) and "event" in ev):
            stream.bad_lines += 1
            continue
        r = ev.get("restart")
        r = r if type(r) is int else restart_of(ev)
        restart = r if restart is None else restart
        if r != restart:  # an earlier run's event: the newest run wrote no start
            cut = i + 1
            break
        newest.append(ev)
        if ev.get("event") == "start":
            cut = i
            break
    if cut and not (any(e.get("event") in METRIC_EVENTS for e in newest)
                    and any(e.get("total_steps") is not None for e in newest)):
        return read_events(path)
    for ev in decoded([line for line in lines[:cut] if '"start"' in line or '"eval"' in line]):
        if isinstance(ev, dict) and ev.get("event") in EARLIER_EVENTS:
            stream.events.append(ev)
    stream.events += reversed(newest)
    stream.newest_only = cut > 0
    return stream
