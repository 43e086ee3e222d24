"""The in-allocation restarts of a job (``ddp_hpc.supervise``) as status shows them: when, why (the
rank, the node, the evidence), what was excluded, the world size before and after, and the time
lost from the fault to the first training step after the restart. From the run's
``restarts.jsonl``, else (the logs gone) from the job's record."""
from __future__ import annotations

import time

from ddp_hpc.parsing import to_float
from ddp_hpc.records import JobRecord
from ddp_hpc.runlogs.reader import RunLogs
from ddp_hpc.runlogs.restarts import read_restarts, time_lost

__all__ = ["alloc_restarts", "restart_lines"]


def alloc_restarts(rec: JobRecord | None, log_dir: str | None, logs: RunLogs) -> list[dict]:
    """Each restart's record with ``lost_s`` (None while no step followed it yet)."""
    rows = read_restarts(log_dir) or [dict(r) for r in ((rec.alloc_restarts if rec is not None else None) or [])]
    out = []
    for row in rows:
        lost = time_lost(row, logs) if logs.ranks else row.get("lost_s")
        out.append({**row, "lost_s": lost})
    return out


def _when(t) -> str:
    t = to_float(t)
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def restart_lines(rows: list[dict]) -> list[str]:
    """The detail view's section (nothing without restarts)."""
    if not rows:
        return []
    out = [f"Restarts inside the allocation: {len(rows)}"]
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
    return out
