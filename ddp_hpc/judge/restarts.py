"""In-allocation restarts as the run logs keep them, read back, and told as status shows them.

``restarts.jsonl`` in the run's log directory holds one JSON object per restart
(`schema.ALLOC_RESTART_KEYS`), appended by the supervisor in the batch step
(``ddp_hpc.runlogs.restarts``), read here for status and for the supervisor of a requeued run
(which numbers its restarts on from the earlier runs').

Status shows each restart (`alloc_restarts`, `restart_lines`): when, why (the rank, the node, the
evidence; and, when the supervisor stopped the step, why it did), what was excluded, the world
size before and after, the time lost from the fault to the first training step after the restart,
and where those seconds went (its phases, below). From ``restarts.jsonl``, else (the logs gone)
from the job's record; and where each restarted run's state came from (rank 0's ``restored``
event: a node's memory, a peer's, or a file). A step the supervisor stopped and did not restart
(a stop line, with ``stopped_run`` and no ``restart``) is shown too: the supervisor, not a rank,
ended it. So is a health check that excluded nodes before a start (``health_check``:
``ddp_hpc.supervise.health``): ``n2 excluded: /tmp full (0.1 GB free, checkpoint needs 1.5 GB)``,
and each time the hang limit stood back (``held_run``). A warm standby whose ranks stepped back (no
room in a node's memory, ``supervise.standroom``) is one line (`standby_lines`, from
``standby.out``): a restart then starts its ranks cold.

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
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ddp_hpc.parsing import to_float, to_int
from ddp_hpc.runlogs.schema import ALLOC_RESTARTS_FILE, STANDBY_BACK, STANDBY_MARK, STANDBY_OUT

if TYPE_CHECKING:
    from ddp_hpc.judge.reader import RunLogs
    from ddp_hpc.records import JobRecord

__all__ = ["read_restarts", "read_stops", "read_health", "read_holds", "read_restarts_and_stops", "sched_index",
           "first_step_at", "time_lost", "phases", "PHASES", "restored_text", "restored_event", "warm_start",
           "alloc_restarts", "restart_lines", "health_lines", "hold_lines", "supervisor_stop", "phase_line",
           "current_restore", "stepped_back", "standby_lines"]

#: how much of the end of ``standby.out`` is read for the newest standby (a line per rank: ~0.7 MB
#: for 8,192 ranks)
STANDBY_TAIL_BYTES = 4 << 20


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


# -- as status shows them ---------------------------------------------------------------------------

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


#: the phases' words in the detail view (`PHASES`)
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


def stepped_back(log_dir: str | Path | None) -> list[str]:
    """What the newest warm standby's ranks said when they stepped back, each ``on NODE (task T):
    why...`` (``standby.out``, after the supervisor's newest `STANDBY_MARK`); [] when none did."""
    if not log_dir:
        return []
    try:
        with open(Path(log_dir) / STANDBY_OUT, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - STANDBY_TAIL_BYTES))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    newest = text.rsplit(STANDBY_MARK, 1)[-1]
    return [line.split(STANDBY_BACK, 1)[1].strip() for line in newest.splitlines() if STANDBY_BACK in line]


def standby_lines(log_dir: str | Path | None) -> list[str]:
    """The detail view's line for a warm standby that stepped back (the first rank's words, and
    how many more said so); none when it did not."""
    back = stepped_back(log_dir)
    if not back:
        return []
    more = f" ({len(back) - 1} more standby rank{'s' if len(back) > 2 else ''} said so)" if len(back) > 1 else ""
    return [f"warm standby stepped back {back[0]}{more}"]
