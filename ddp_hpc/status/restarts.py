"""The in-allocation restarts of a job (``ddp_hpc.supervise``) as status shows them: when, why (the
rank, the node, the evidence; and, when the supervisor stopped the step, why it did), what was
excluded, the world size before and after, and the time lost from the fault to the first training
step after the restart. From the run's ``restarts.jsonl``, else (the logs gone) from the job's
record; and where each restarted run's state came from (rank 0's ``restored`` event: a node's
memory, a peer's, or a file). A step the supervisor stopped and did not restart (a stop line of ``restarts.jsonl``, with
``stopped_run`` and no ``restart``) is shown too: the supervisor, not a rank, ended it."""
from __future__ import annotations

import time

from ddp_hpc.judge.reader import RunLogs
from ddp_hpc.judge.restarts import read_restarts_and_stops, restored_event, restored_text, time_lost
from ddp_hpc.parsing import to_float
from ddp_hpc.records import JobRecord

__all__ = ["alloc_restarts", "restart_lines", "supervisor_stop", "current_restore"]


def alloc_restarts(rec: JobRecord | None, log_dir: str | None, logs: RunLogs) -> list[dict]:
    """Each restart's record with ``lost_s`` (None while no step followed it yet), then each step
    the supervisor stopped without restarting it (``stopped_run``: no ``restart`` key)."""
    rows, stops = read_restarts_and_stops(log_dir)
    rows = rows or [dict(r) for r in ((rec.alloc_restarts if rec is not None else None) or [])]
    out = []
    for row in rows:
        lost = time_lost(row, logs) if logs.ranks else row.get("lost_s")
        ev = restored_event(logs, row.get("restart")) if logs.ranks else None
        out.append({**row, "lost_s": lost, **({"restored": restored_text(ev)} if ev and restored_text(ev) else {})})
    return out + stops


def current_restore(logs, cur) -> str | None:
    """Where the current run's state came from, in words (rank 0's ``restored`` event)."""
    if cur is None or not getattr(logs, "ranks", None):
        return None
    ev = restored_event(logs, cur.restart)
    return restored_text(ev) if ev else None


def supervisor_stop(rows: list[dict], restart: int) -> dict | None:
    """The stop line of run ``restart``, when the supervisor stopped its step and did not restart it."""
    return next((r for r in rows if r.get("stopped_run") == restart and r.get("restart") is None), None)


def _when(t) -> str:
    t = to_float(t)
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def restart_lines(rows: list[dict]) -> list[str]:
    """The detail view's section (nothing without restarts or a stop of the supervisor's)."""
    stops = [r for r in rows if r.get("restart") is None and r.get("stopped_run") is not None]
    rows = [r for r in rows if r.get("restart") is not None]
    out = [f"Restarts inside the allocation: {len(rows)}"] if rows else []
    for r in rows:
        who = f"rank {r['rank']}" if r.get("rank") is not None else "no rank named"
        where = f" on {r['node']}" if r.get("node") else ""
        excluded = f"excluded {', '.join(r['excluded'])}" if r.get("excluded") else "nothing excluded"
        lost = f"{r['lost_s']:.1f} s from the fault to the next step" if r.get("lost_s") is not None \
            else "no step since"
        why = r.get("why") or "-"
        said = why if why.startswith(f"{who}{where}") else f"{who}{where}: {why}"  # no "rank 3 on n2" twice
        out.append(f"  restart {r.get('restart')} at {_when(r.get('detected_at'))} ({r.get('trigger')}): {said}")
        out.append(f"    how we know: {r.get('basis') or '-'}; {excluded}; world size "
                   f"{r.get('world_before')} -> {r.get('world_after')} on "
                   f"{', '.join(r.get('nodes_after') or []) or '-'}; {lost}")
        if r.get("stop"):
            out.append(f"    the supervisor stopped the step because {r['stop']}")
        if r.get("restored"):
            out.append(f"    state: {r['restored']}")
    for r in stops:
        who = f"rank {r['rank']}" if r.get("rank") is not None else "no rank named"
        where = f" on {r['node']}" if r.get("node") else ""
        out.append(f"Supervisor: stopped the step of restart {r.get('stopped_run')} at {_when(r.get('detected_at'))} "
                   f"because {r.get('stop') or r.get('trigger')}; not restarted: {r.get('not_restarted') or '-'}")
        out.append(f"  what it found then: {who}{where}: {r.get('why') or '-'} ({r.get('basis') or '-'})")
    return out
