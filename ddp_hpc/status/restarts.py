"""The in-allocation restarts of a job (``ddp_hpc.supervise``) as status shows them: when, why (the
rank, the node, the evidence; and, when the supervisor stopped the step, why it did), what was
excluded, the world size before and after, the time lost from the fault to the first training
step after the restart, and where those seconds went (its phases, `judge.restarts.phases`). From
the run's ``restarts.jsonl``, else (the logs gone) from the job's record; and where each restarted
run's state came from (rank 0's ``restored`` event: a node's memory, a peer's, or a file). A step
the supervisor stopped and did not restart (a stop line of ``restarts.jsonl``, with
``stopped_run`` and no ``restart``) is shown too: the supervisor, not a rank, ended it. So is a
health check that excluded nodes before a start (``health_check``: ``ddp_hpc.supervise.health``):
``n2 excluded: /tmp full (0.1 GB free, checkpoint needs 1.5 GB)``."""
from __future__ import annotations

import time

from ddp_hpc.judge.reader import RunLogs
from ddp_hpc.judge.restarts import (
    phases,
    read_health,
    read_holds,
    read_restarts_and_stops,
    restored_event,
    restored_text,
    time_lost,
    warm_start,
)
from ddp_hpc.parsing import to_float
from ddp_hpc.records import JobRecord

__all__ = ["alloc_restarts", "restart_lines", "health_lines", "hold_lines", "supervisor_stop", "phase_line",
           "current_restore"]


def alloc_restarts(rec: JobRecord | None, log_dir: str | None, logs: RunLogs) -> list[dict]:
    """Each restart's record with ``lost_s`` (None while no step followed it yet), then each step
    the supervisor stopped without restarting it (``stopped_run``: no ``restart`` key), then each
    health check that excluded nodes (``health_check``), then each time the hang limit stood back
    (``held_run``)."""
    rows, stops = read_restarts_and_stops(log_dir)
    rows = rows or [dict(r) for r in ((rec.alloc_restarts if rec is not None else None) or [])]
    out = []
    for row in rows:
        lost = time_lost(row, logs) if logs.ranks else row.get("lost_s")
        ev = restored_event(logs, row.get("restart")) if logs.ranks else None
        out.append({**row, "lost_s": lost, "phases": phases(row, logs) if logs.ranks else row.get("phases") or {},
                    **({"restored": restored_text(ev)} if ev and restored_text(ev) else {}),
                    **({"warm": True} if logs.ranks and warm_start(logs, row.get("restart")) else {})})
    return out + stops + read_health(log_dir) + read_holds(log_dir)


def current_restore(logs, cur) -> str | None:
    """Where the current run's state came from, in words (rank 0's ``restored`` event)."""
    if cur is None or not getattr(logs, "ranks", None):
        return None
    ev = restored_event(logs, cur.restart)
    return restored_text(ev) if ev else None


def supervisor_stop(rows: list[dict], restart: int) -> dict | None:
    """The stop line of run ``restart``, when the supervisor stopped its step and did not restart it."""
    return next((r for r in rows if r.get("stopped_run") == restart and r.get("restart") is None), None)


#: the phases' words in the detail view (`judge.restarts.PHASES`)
_PHASE_WORDS = {"first_step": "step"}


def phase_line(r: dict) -> str:
    """``restart 1: 9.8 s = detect 0.6 + stop 1.1 + ... + step 2.3``: where the restart's seconds went."""
    ph = r.get("phases") or {}
    parts = " + ".join(f"{_PHASE_WORDS.get(k, k)} {v:.1f}" for k, v in ph.items())
    line = f"restart {r.get('restart')}: {sum(ph.values()):.1f} s = {parts}"
    if "first_step" in ph and "restore" not in ph:
        line += " (no restored event: the restore is counted in the step)"
    if r.get("warm"):
        line += " (warm standby: the ranks had imported torch before the fault)"
    return line


def _when(t) -> str:
    t = to_float(t)
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def restart_lines(rows: list[dict]) -> list[str]:
    """The detail view's section (nothing without restarts or a stop of the supervisor's)."""
    stops = [r for r in rows if r.get("restart") is None and r.get("stopped_run") is not None]
    restarts = [r for r in rows if r.get("restart") is not None]
    out = [f"Restarts inside the allocation: {len(restarts)}"] if restarts else []
    for r in restarts:
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
        if r.get("phases"):
            out.append(f"    {phase_line(r)}")
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
    return out + health_lines(rows) + hold_lines(rows)


def hold_lines(rows: list[dict]) -> list[str]:
    """One line per run in which the hang limit stood back (ranks worked outside a collective):
    how often, the newest time, who worked and how."""
    runs: dict[int, list[dict]] = {}
    for r in (r for r in rows if r.get("held_run") is not None and r.get("restart") is None):
        runs.setdefault(r["held_run"], []).append(r)
    out = []
    for run, held in sorted(runs.items()):
        last = held[-1]
        ranks = ", ".join(map(str, last.get("ranks") or [])) or "every rank"
        out.append(f"Hang limit stood back {len(held)} time(s) in restart {run}, last at {_when(last.get('time'))}: "
                   f"rank(s) {ranks} worked outside a collective after {to_float(last.get('after_s')) or 0:g} s "
                   f"without a step ({last.get('work') or '-'}); no step stopped")
    return out


def health_lines(rows: list[dict]) -> list[str]:
    """The health checks that excluded nodes: before which start, each node and why, where the
    run started (or why it did not)."""
    out = []
    for r in (r for r in rows if r.get("health_check") is not None and r.get("restart") is None):
        run = r["health_check"]
        excluded = r.get("excluded") if isinstance(r.get("excluded"), dict) else {}
        when = f"restart {run}" if run else "the first start"
        out.append(f"Health check before {when} at {_when(r.get('time'))} "
                   f"({to_float(r.get('seconds')) or 0:.1f} s): "
                   + ("; ".join(f"{n} excluded: {why}" for n, why in excluded.items()) or "no node excluded"))
        out += [f"  noted: {n}" for n in r.get("notes") or ()]
        if not excluded and not r.get("not_started"):
            continue
        started = ", ".join(r.get("nodes_after") or [])
        out.append(f"  not started: {r['not_started']}" if r.get("not_started") else f"  started on {started or '-'}")
    return out
