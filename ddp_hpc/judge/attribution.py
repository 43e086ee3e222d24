"""Who broke the run: every rank's ending weighed against the others, the primary cause, and
the ranks that only failed because of it (docs/status.md, "Who broke the job").

Why not the earliest ``error`` event: when rank 3 is killed (the OOM killer's SIGKILL), it
writes nothing, and the survivors' "Connection reset by peer" errors are the only events; when
rank 3 hangs, the others' collective timeouts are. So each rank is first classified by its own
evidence (`ddp_hpc.judge.evidence`), then in context:

1. a node failed (the scheduler says NODE_FAIL, srun says "Node failure on n2", or every rank
   of one host went silent while ranks elsewhere wrote how they failed): its silent ranks
   ``vanished``;
2. srun reported a rank killed before it began stopping the step: ``killed``;
3. the others failed in a collective timeout and a silent rank's last event is at least
   `STUCK_MIN_GAP_S` older than the earliest of those timeouts: ``stuck``;
4. what is still silent in a run that ended is ``lost`` (it left no end event).

The primary cause is a vanished node, else the first of the raised / exited / killed / stuck
ranks (by srun's report order when each of them has a report, else by time: a stuck or silently
killed rank counts from its last event), else the lost rank whose events stopped first, else the
first consequence. Everything else is shown as what followed from it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ddp_hpc.judge import consequences as conseq
from ddp_hpc.judge.evidence import RankEnding, own_ending
from ddp_hpc.judge.srun import signal_text, tail_lines
from ddp_hpc.judge.stacks import collective
from ddp_hpc.judge.tails import RunFiles
from ddp_hpc.parsing import to_float, to_int
from ddp_hpc.runlogs.schema import rank_out

#: how much older than the others' collective timeouts a silent rank's last event must be to
#: call it stuck (a collective timeout is at least tens of seconds)
STUCK_MIN_GAP_S = 5.0
#: kinds that can be the primary cause
CAUSES = ("raised", "exited", "killed", "stuck")


@dataclass
class Failure:
    """The primary cause of a run's failure, how we know, and what followed from it."""

    rank: int
    basis: str  # "error event" | "traceback in rankN.out" | "srun exit report" | "events stopped first" | ...
    exc_type: str | None = None
    message: str | None = None
    traceback_tail: list[str] = field(default_factory=list)
    time: float | None = None
    host: str | None = None
    restart: int = 0
    kind: str = "raised"  # raised | exited | killed | vanished | stuck | lost | consequence
    summary: str = ""  # the first failure line, after "First failure: "
    ranks: list[int] = field(default_factory=list)  # every rank blamed (a lost node: all of its)
    node: str | None = None
    signal: int | None = None
    consequences: list[dict] = field(default_factory=list)  # {ranks, text}
    stack: dict | None = None  # the blamed rank's newest stack event: summary, reason, lines
    peer_stacks: list[dict] = field(default_factory=list)  # {ranks, summary}: where the others were


@dataclass
class SchedulerFacts:
    """What the scheduler said about the run: its state (a JobState name) and exit codes
    (``code:signal``, the job's and its steps')."""

    state: str | None = None
    exit_codes: list[str] = field(default_factory=list)


def classify(logs: RunFiles, restart: int | None = None, sched: SchedulerFacts | None = None,
             ended: bool = True, files: bool = True, live_since: float | None = None) -> dict[int, RankEnding]:
    """rank -> its ending in run ``restart`` (default: the newest). ``ended``: the run is over,
    so silence means something; ``files``: read rank*.out and srun's reports (the current run).
    ``live_since`` (a running job): a rank whose newest event is newer than that, with no error
    and no end, still runs: its rank*.out is not read (a traceback there is one it caught and
    went on from; a job of 8,192 ranks is not 8,192 files opened a status)."""
    restart = logs.current_restart() if restart is None else restart
    reports = logs.task_reports() if files and ended else {}
    out: dict[int, RankEnding] = {}
    for rank, stream in sorted(logs.ranks.items()):
        evs = stream.of_restart(restart)
        if not evs:
            continue
        end = next((e for e in reversed(evs) if e.get("event") == "end"), {})
        read = files and end.get("status") not in ("completed", "preempted", "killed", "interrupted") and not (
            live_since is not None and _live(evs, live_since))
        tb = logs.out_traceback(rank) if read else None
        tail = logs.out_tail(rank) if read else []
        out[rank] = own_ending(rank, evs, tb, tail, reports.get(rank), rank_out(rank))
    # srun knows a task, or a rank*.out holds a traceback, of a rank that never wrote an event
    silent = set(reports) | {r for r in logs.outs
                             if files and r not in logs.ranks and logs.out_traceback(r)}
    for rank in sorted(silent - set(logs.ranks)):
        out[rank] = own_ending(rank, [], logs.out_traceback(rank), logs.out_tail(rank),
                               reports.get(rank), rank_out(rank))
    if ended:
        _waited(out, logs, restart)
        _in_context(out, logs, sched or SchedulerFacts(), files)
        _frozen(out, logs, restart)
    else:
        for e in out.values():
            e.kind = "running" if e.kind == "silent" else e.kind
    return out


def _live(events: list[dict], since: float) -> bool:
    """The rank's newest event (a watchdog's stack is none: it tells a rank stuck) is newer than
    ``since``, and none of its events is an error or an end."""
    t = next((to_float(e.get("time")) for e in reversed(events) if e.get("event") != "stack"), None)
    return t is not None and t > since and not any(e.get("event") in ("error", "end") for e in events)


def _silent(e: RankEnding) -> bool:
    """Nothing from the rank itself: no events telling its end (srun may have reported it)."""
    return not e.spoke and e.kind in ("silent", "killed", "stopped", "exited")


#: events a rank's own loop writes (not its watchdog): one after a stack shows the rank went on
MOVED_ON = frozenset({"epoch", "eval", "checkpoint", "progress"})


def _waited(endings: dict[int, RankEnding], logs: RunFiles, restart: int) -> None:
    """A rank that raised after its watchdog stack showed it waiting in a collective, with no step
    since (nor an epoch's end, an evaluation, a checkpoint or an evaluation's progress: `MOVED_ON`),
    is a victim: the collective failed under it while it waited for a peer, whatever words the
    backend chose. The stall the ranks wrote while the job ran wins over those words."""
    for rank, e in endings.items():
        if e.kind != "raised" or e.time is None or rank not in logs.ranks:
            continue
        waited, step = None, None
        for ev in logs.ranks[rank].of_restart(restart):
            t = to_float(ev.get("time"))
            if t is not None and t > e.time:
                break
            if t is None:
                continue
            if ev.get("event") == "stack":
                waited, step = collective(str(ev.get("stack") or "")), to_int(ev.get("step"), None)
            elif waited and ev.get("event") == "step":
                now = to_int(ev.get("step"), None)
                waited = None if step is None or now is None or now > step else waited  # it stepped on
            elif ev.get("event") in MOVED_ON:   # its main thread went on past that collective
                waited = None
        if waited:
            e.kind, e.waited, e.phrase = "consequence", waited, e.phrase or _words(e.text)
            e.basis = f"{e.basis}; its stack: waiting in {waited}"


def _words(text: str, most: int = 80) -> str:
    return text if len(text) <= most else text[:most - 3].rstrip() + "..."


def _in_context(endings: dict[int, RankEnding], logs: RunFiles, sched: SchedulerFacts,
                files: bool) -> None:
    node_fail, named = (logs.node_failures() if files else (False, []))
    why = "NODE_FAIL" if sched.state == "NODE_FAIL" else (
        f"srun: Node failure on {', '.join(named)}" if named else "Slurm: node failure")
    for node in _lost_nodes(endings, node_fail or sched.state == "NODE_FAIL", named):
        for e in endings.values():
            if e.host == node and _silent(e):
                e.kind, e.text = "vanished", f"vanished with node {node}"
                e.basis = why if node_fail or sched.state == "NODE_FAIL" else (
                    "every rank of the node went silent while the others failed")
    timed = [e for e in endings.values() if e.timed_out]
    if timed:
        times = [t for e in timed if (t := e.time or e.last_time) is not None]
        ref = min(times) if times else None
        first_timed_report = min((e.report_order for e in timed if e.report_order is not None),
                                 default=None)
        for e in endings.values():
            killed_first = (e.kind == "killed" and not e.from_event and not e.after_abort and (
                first_timed_report is None or (e.report_order or 0) < first_timed_report))
            if (_silent(e) and not killed_first and ref is not None and e.last_time is not None
                    and ref - e.last_time >= STUCK_MIN_GAP_S):
                e.gap_s = ref - e.last_time
                at = f"step {e.last_step}" if e.last_step is not None else (e.last_event or "-")
                e.kind, e.text = "stuck", (f"stuck: its last event ({at}) is {e.gap_s:.0f} s older "
                                           "than the others'")
                e.basis = "its events stopped while the others timed out in a collective" + (
                    f"; {e.basis}" if e.basis else "")
    for e in endings.values():
        if e.kind == "silent":
            e.kind, e.text, e.basis = "lost", "no end event", "events stopped first"


def _frozen(endings: dict[int, RankEnding], logs: RunFiles, restart: int) -> None:
    """A rank that wrote no watchdog stack before the others' collective timeouts, while they
    did, was frozen (SIGSTOP, a hang outside Python): ``stuck``, even when it wrote events later
    (Slurm sends SIGCONT before it ends a step, so a stopped rank wakes and fails too)."""
    timed = [e.time for e in endings.values() if e.timed_out and e.time is not None]
    if not timed or any(e.kind in ("vanished", "stuck") for e in endings.values()):
        return
    ref = min(timed)
    dumped = {r for r, s in logs.ranks.items()
              if any(ev.get("event") == "stack" and str(ev.get("reason", "")).startswith(("collective", "stalled"))
                     and float(ev.get("time") or 0) <= ref for ev in s.of_restart(restart))}
    frozen = [e for r, e in endings.items() if r not in dumped and e.kind in ("consequence", "lost", "silent")]
    if not dumped or not frozen or len(frozen) > len(endings) // 2:
        return
    for e in frozen:
        at = f"step {e.last_step}" if e.last_step is not None else "its start"
        e.kind, e.gap_s = "stuck", None
        e.text = (f"stuck after {at}: it wrote no stack before the others' collective timeout "
                  "while they did (frozen: stopped, or a hang outside Python)")
        e.basis = "the watchdog stacks of the others" + (f"; {e.basis}" if e.basis else "")
        e.last_time = min(e.last_time or ref, ref)


def _lost_nodes(endings: dict[int, RankEnding], node_fail: bool, named: list[str]) -> list[str]:
    hosts: dict[str, list[RankEnding]] = {}
    for e in endings.values():
        if e.host:
            hosts.setdefault(e.host, []).append(e)
    if node_fail and named:  # Slurm's node names may be the hosts' short names, or not at all
        match = [h for h in hosts if h in named or h.split(".")[0] in {n.split(".")[0] for n in named}]
        if match:
            return match
    silent = [h for h, es in hosts.items() if all(_silent(e) for e in es)]
    spoke = [e for h, es in hosts.items() if h not in silent for e in es if e.spoke]
    if node_fail:
        if silent and spoke:
            return silent
        cands = [e for e in endings.values() if _silent(e) and e.host and e.last_time is not None]
        return [min(cands, key=lambda e: (e.last_time, e.rank)).host] if cands else []
    # the others' failures must include more than timeouts: ranks that only timed out waited
    # for ranks that hung (stuck), not for ranks that are gone
    gone = [e for e in spoke if not e.timed_out]
    if len(hosts) < 2 or not gone or any(e.kind in CAUSES for e in spoke):
        return []  # a rank elsewhere failed on its own: the silent ones were stopped after it
    return [h for h in silent if len(hosts[h]) >= 2]


def primary(endings: dict[int, RankEnding], allow_lost: bool) -> list[RankEnding]:
    """The ranks blamed: a lost node's ranks, else the first cause (see the module docstring),
    else (``allow_lost``) the lost rank whose events stopped first, else the first consequence."""
    vanished = sorted((e for e in endings.values() if e.kind == "vanished"),
                      key=lambda e: (e.host or "", e.rank))
    if vanished:
        return [e for e in vanished if e.host == vanished[0].host]
    causes = [e for e in endings.values() if e.kind in CAUSES]
    if causes:
        if all(e.report_order is not None for e in causes) and not any(e.kind == "stuck" for e in causes):
            return [min(causes, key=lambda e: (e.report_order, _when(e), e.rank))]
        return [min(causes, key=lambda e: (_when(e), e.rank))]
    lost = [e for e in endings.values() if e.kind == "lost"] if allow_lost else []
    if lost:
        return [min(lost, key=lambda e: (_when(e), e.rank))]
    cons = [e for e in endings.values() if e.kind == "consequence"]
    return [min(cons, key=lambda e: (_when(e), e.rank))] if cons else []


def _when(e: RankEnding) -> float:
    t = e.last_time if e.kind in ("stuck", "lost") or not e.from_event else e.time
    return t if t is not None else float("inf")


def attribute(logs: RunFiles, restart: int | None = None, sched: SchedulerFacts | None = None,
              assume_failed: bool = False, evidence_only: bool = False,
              files: bool = True, live_since: float | None = None) -> tuple[Failure | None, dict[int, RankEnding]]:
    """(the primary cause, every rank's ending) of run ``restart`` (default: the newest).

    ``assume_failed``: the scheduler says the job broke, so a rank that only went silent is a
    suspect; ``evidence_only`` (the job still runs, or was stopped from outside): only what a
    rank wrote itself counts (an error event, a traceback), not srun's reports nor silence;
    ``live_since`` with it: the ranks that wrote events since then still run (`classify`)."""
    restart = logs.current_restart() if restart is None else restart
    ended = not evidence_only
    endings = classify(logs, restart, sched, ended=ended, files=files,
                       live_since=live_since if evidence_only else None)
    allow_lost = ended and (assume_failed or _failed(endings) or _some_ended(endings))
    if evidence_only:
        endings_cause = {r: e for r, e in endings.items() if e.from_event or e.kind == "raised"}
        blamed = primary(endings_cause, False)
        if blamed and blamed[0].kind == "consequence":  # ranks lost a peer: the run is breaking,
            endings = classify(logs, restart, sched, ended=True, files=files)  # silence counts
            blamed = primary(endings, True)
    else:
        blamed = primary(endings, allow_lost)
    if not blamed:
        return None, endings
    conseq.relabel(endings, blamed)
    return _failure(logs, endings, blamed, restart, sched or SchedulerFacts()), endings


def _failed(endings: dict[int, RankEnding]) -> bool:
    return any(e.kind in CAUSES + ("consequence", "vanished") for e in endings.values())


def _some_ended(endings: dict[int, RankEnding]) -> bool:
    ended = [e.from_event for e in endings.values()]
    return any(ended) and not all(ended)


def _failure(logs: RunFiles, endings: dict[int, RankEnding], blamed: list[RankEnding],
             restart: int, sched: SchedulerFacts) -> Failure:
    p = blamed[0]
    f = Failure(rank=p.rank, basis=p.basis, exc_type=p.exc_type, message=p.message,
                traceback_tail=tail_lines("\n".join(p.traceback or []), 12) if p.traceback else [],
                time=p.time if p.from_event else p.last_time, host=p.host, restart=restart,
                kind=p.kind, ranks=[e.rank for e in blamed], signal=p.signal)
    alone = len([e for e in endings.values() if e.kind == "lost"]) == 1
    if p.kind == "lost" and alone and sched.state == "OUT_OF_MEMORY":
        p.kind, f.kind, f.signal, p.text = "killed", "killed", 9, "killed by the OOM killer"
        f.basis = p.basis = "no end event; the scheduler says OUT_OF_MEMORY"
    elif p.kind == "lost" and alone and (sig := _sched_signal(sched)):
        p.kind, f.kind, f.signal = "killed", "killed", sig
        p.text = f"killed by {signal_text(sig)}"
        f.basis = p.basis = f"no end event; the scheduler's exit code names {signal_text(sig)}"
    if p.kind == "vanished":
        f.node = p.host
    f.summary = conseq.headline(p, blamed, restart)
    f.consequences = conseq.lines(endings, blamed)
    f.stack, f.peer_stacks = conseq.stacks(logs, restart, p, endings)
    return f


def _sched_signal(sched: SchedulerFacts) -> int | None:
    """The signal in a ``code:signal`` exit code (``0:9``), or in 128+N (``137:0``)."""
    for text in sched.exit_codes:
        code, _, sig = str(text or "").partition(":")
        if sig.strip().isdigit() and int(sig) > 0:
            return int(sig)
        if code.strip().isdigit() and int(code) > 128:
            return int(code) - 128
    return None

