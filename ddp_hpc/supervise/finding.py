"""What ended a supervised step and what to do about it: `find` reads the run logs (the
attribution ``ddp-hpc status`` uses: ``ddp_hpc.judge.attribution``) and the nodes' states into a
`Finding`; `judge` turns it into a `Judgement` (restart on which nodes, or why not);
`restart_row` / `stop_row` are its lines of ``restarts.jsonl``. `all_completed` tells a step whose
every rank wrote that it completed, whatever srun's exit status says (a signal in their teardown).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ddp_hpc.judge.attribution import Failure, SchedulerFacts, attribute
from ddp_hpc.judge.reader import RunLogs
from ddp_hpc.supervise.hang import Hang
from ddp_hpc.supervise.plan import NodePlan, Policy, next_nodes, verdict
from ddp_hpc.supervise.watch import StepEnd, node_health

__all__ = ["Finding", "Judgement", "find", "judge", "restart_row", "stop_row", "all_completed"]


class StepSettings(Protocol):
    """What the judging reads of the supervisor's ``loop.Settings``."""

    policy: Policy
    log_dir: str
    stall_timeout_s: float


@dataclass(frozen=True)
class Finding:
    """What ended a step and what failed, as the evidence tells: the trigger (`plan.TRIGGERS`),
    ``why`` in words, ``stop`` (why the supervisor stopped the step; None: it ended by itself), the
    blamed rank's failure kind, rank and node, how we know (``basis``), when the fault happened and
    when it was seen, and the nodes that are lost, suspect (a killed or hung rank's) or draining."""

    trigger: str
    why: str
    stop: str | None
    kind: str | None
    rank: int | None
    node: str | None
    basis: str
    fault_at: float
    detected_at: float
    lost: tuple[str, ...] = ()
    suspect: tuple[str, ...] = ()
    draining: tuple[str, ...] = ()


@dataclass(frozen=True)
class Judgement:
    """The supervisor's conclusion after a step ended: the `Finding`, and either the next start's
    ``plan`` (a restart; ``change`` says what changed) or no plan (``change`` says why not)."""

    finding: Finding
    plan: NodePlan | None
    change: str


def _stop_reason(end: StepEnd, down: list[str], stall_timeout_s: float) -> str | None:
    """Why the supervisor stopped the step, in words (None: srun ended it by itself)."""
    return {"node down": f"node(s) {', '.join(down)} stopped answering (sinfo: down or not responding)",
            "stalled": f"no rank showed a sign of life (a step, an eval, a checkpoint) for "
                       f"{end.stall_s or stall_timeout_s:g} s",
            "rank failed": f"a rank lost a peer and srun had not ended the step {end.grace_s:g} s later",
            }.get(end.trigger)


def find(s: StepSettings, cli, plan: NodePlan, end: StepEnd, restart: int, hang: Hang | None = None) -> Finding:
    """What ended run ``restart``'s step on ``plan.active``, from the run logs (the attribution
    ``ddp-hpc status`` uses) and the nodes' states now; for a stalled step whose stacks named the
    hung rank (``hang``), that rank."""
    health = node_health(cli, plan.active + plan.spare)
    down = sorted(set(end.down) | {n for n in health.lost if n in plan.active})
    logs = RunLogs(s.log_dir)
    failure, endings = attribute(logs, restart=restart, assume_failed=True,
                                 sched=SchedulerFacts("NODE_FAIL" if down else None))
    stop = _stop_reason(end, down, s.stall_timeout_s)
    if hang is not None and not down:
        return Finding(trigger=end.trigger, why=hang.why, stop=stop, kind="stuck", rank=hang.rank,
                       node=hang.host, basis=hang.basis, fault_at=_fault_at(None, end),
                       detected_at=round(end.detected_at, 3), suspect=(hang.host,) if hang.host else (),
                       draining=health.draining)
    kind = failure.kind if failure else None
    why = failure.summary if failure else {"stalled": f"no training step for {s.stall_timeout_s:g} s",
                                          "node down": f"node(s) {', '.join(down)} down"}.get(
                                              end.trigger, f"the step ended ({end.trigger}; {_seen(logs, endings)})")
    lost = down + ([failure.node] if failure and kind == "vanished" and failure.node else [])
    suspect = [failure.host] if failure and failure.host and kind in ("killed", "stuck", "lost") else []
    return Finding(
        trigger=end.trigger, why=why, stop=stop, kind=kind, rank=failure.rank if failure else None,
        node=(failure.node or failure.host) if failure else (down[0] if down else None),
        basis=failure.basis if failure else end.trigger, fault_at=_fault_at(failure, end),
        detected_at=round(end.detected_at, 3), lost=tuple(dict.fromkeys(lost)), suspect=tuple(suspect),
        draining=health.draining)


def _seen(logs: RunLogs, endings: dict) -> str:
    """What the evidence held when it named no cause: each rank's ending and srun's reports, so a
    user (and a test's log) can tell a step that left no trace from evidence that was misread."""
    ranks = ", ".join(f"{r} {e.kind}" for r, e in sorted(endings.items())) or "none"
    reports = ", ".join(f"{t} " + (f"code {rep.exit_code}" if rep.exit_code is not None else f"signal {rep.signal}")
                        for t, rep in sorted(logs.task_reports().items())) or "none"
    return f"ranks' endings: {ranks}; srun's task reports: {reports}"


def judge(s: StepSettings, cli, plan: NodePlan, end: StepEnd, restart: int, done: int,
          hang: Hang | None = None) -> Judgement:
    """Restart after the step of run ``restart`` ended (``done`` restarts behind), and on which
    nodes, or give up (`Judgement.plan` None, ``change`` says why)."""
    f = find(s, cli, plan, end, restart, hang)
    v = verdict(f.kind, f.trigger, s.policy, done)
    if not v.restart:
        return Judgement(f, None, v.reason)
    try:
        new, words = next_nodes(plan, list(f.lost), list(f.suspect), s.policy, f.draining)
    except ValueError as exc:
        return Judgement(f, None, str(exc))
    return Judgement(f, new, words)


def restart_row(f: Finding, before: NodePlan, after: NodePlan, restart: int, key, tasks_per_node: int) -> dict:
    """The restart's line of restarts.jsonl (`ALLOC_RESTART_KEYS`): the new run ``restart`` on
    ``after.active``, after the step on ``before.active`` ended as `Finding` ``f`` says."""
    return {"restart": restart, "job_id": key, "fault_at": f.fault_at, "detected_at": f.detected_at,
            "trigger": f.trigger, "stop": f.stop, "why": f.why, "kind": f.kind, "rank": f.rank,
            "node": f.node, "basis": f.basis, "excluded": after.excluded[len(before.excluded):],
            "nodes_before": list(before.active), "nodes_after": list(after.active),
            "world_before": len(before.active) * tasks_per_node,
            "world_after": len(after.active) * tasks_per_node}


def stop_row(j: Judgement, run: int, key) -> dict:
    """The line of restarts.jsonl for run ``run``'s step, stopped and not restarted (`ALLOC_STOP_KEYS`)."""
    f = j.finding
    return {"stopped_run": run, "job_id": key, "fault_at": f.fault_at, "detected_at": f.detected_at,
            "trigger": f.trigger, "stop": f.stop, "why": f.why, "kind": f.kind, "rank": f.rank,
            "node": f.node, "basis": f.basis, "not_restarted": j.change}


def _fault_at(failure: Failure | None, end: StepEnd) -> float:
    """When the fault happened, as well as the evidence tells: the blamed rank's failure time (a
    silent rank's last event), the first failed rank's event, the newest step of a stalled run."""
    seen = [t for t in (failure.time if failure else None, end.first_bad_at) if t]
    if end.trigger == "stalled" and end.last_step_at:
        seen.append(end.last_step_at)
    return round(min(seen) if seen else end.detected_at, 3)


def all_completed(log_dir: str, restart: int, ranks: int) -> str | None:
    """When each of the step's ``ranks`` ranks wrote an ``end`` event of status completed in run
    ``restart``, that in words with srun's reports (a signal that reached them after their end,
    such as a preemption notice in their teardown); None otherwise."""
    logs = RunLogs(log_dir)
    _, endings = attribute(logs, restart=restart)
    if len(endings) != ranks or any(e.kind != "completed" for e in endings.values()):
        return None
    return f"every rank completed; srun's exit status came after their end ({_seen(logs, endings)})"
