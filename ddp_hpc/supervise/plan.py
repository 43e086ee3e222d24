"""What the supervisor does after a fault, as pure functions of what it saw: whether the fault is
restartable, and on which nodes the ranks start again.

Policy (docs/restarts.md):

- restartable by default: a node lost (it stopped answering, or all of its ranks vanished), a rank
  killed by a signal, a rank that hung (stuck, or the whole step stalled), a rank lost without a
  word; not restartable unless ``--restart-on-error``: an exception raised by the user's code or a
  non-zero exit of it (it would fail again the same way);
- nodes: a node that is down or lost is always excluded; the node of a killed or hung rank, and a
  draining node (an admin's drain or FAIL: no new work, running steps go on), is swapped for a
  spare that is not draining while one is left, else kept (it still answers); replacements come
  from the spare nodes first, in their order, draining spares last;
- fewer nodes than asked: only down to ``--min-nodes``, else the supervisor gives up.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Policy", "Verdict", "NodePlan", "verdict", "next_nodes", "USER_KINDS", "FAULT_KINDS"]

#: failure kinds (ddp_hpc.judge.attribution) that the user's own code caused
USER_KINDS = frozenset({"raised", "exited"})
#: failure kinds of a fault around the code: a node, a signal, a hang
FAULT_KINDS = frozenset({"killed", "vanished", "stuck", "lost", "consequence"})
#: why a step was stopped or ended, as the watcher names it
TRIGGERS = ("exited", "rank failed", "node down", "stalled")


@dataclass(frozen=True)
class Policy:
    """The options of one supervised job."""

    nodes: int                 # nodes the job trains on (--nodes)
    tasks_per_node: int
    max_restarts: int = 2
    spare_nodes: int = 0
    min_nodes: int | None = None   # None: --nodes (never fewer)
    restart_on_error: bool = False

    @property
    def floor(self) -> int:
        return self.nodes if self.min_nodes is None else self.min_nodes


@dataclass(frozen=True)
class Verdict:
    restart: bool
    reason: str


@dataclass
class NodePlan:
    """The nodes of the allocation: those the ranks run on, the spares standing by, the excluded."""

    active: list[str]
    spare: list[str]
    excluded: list[str] = field(default_factory=list)


def verdict(kind: str | None, trigger: str, policy: Policy, done: int) -> Verdict:
    """Restart after a fault of ``kind`` (None: no rank's evidence named one) seen as ``trigger``,
    with ``done`` in-allocation restarts behind?"""
    if done >= policy.max_restarts:
        return Verdict(False, f"no restart left (--max-restarts {policy.max_restarts})")
    if kind in USER_KINDS and not policy.restart_on_error:
        return Verdict(False, "the user's code failed by itself (an error it raised or its exit "
                              "status), which a restart would repeat; --restart-on-error restarts it")
    if kind in USER_KINDS or kind in FAULT_KINDS or trigger in ("node down", "stalled"):
        return Verdict(True, "restartable")
    return Verdict(False, "no rank's evidence says what failed, so a restart could fail the same way")


def next_nodes(plan: NodePlan, lost: list[str], suspect: list[str], policy: Policy,
               draining: tuple[str, ...] | list[str] = ()) -> tuple[NodePlan, str]:
    """The plan for the next start: ``lost`` nodes (down, or all ranks vanished) leave for good,
    ``suspect`` ones (a killed or hung rank's) and ``draining`` ones (an admin's drain: no new
    work, though a step goes on) are swapped for a spare that is not draining while one is left;
    a draining spare stands in last. Returns (the new plan, what changed in words); raises
    ValueError when fewer than the floor are left."""
    spare = [n for n in plan.spare if n not in lost]
    spare = [n for n in spare if n not in draining] + [n for n in spare if n in draining]
    healthy = sum(1 for n in spare if n not in draining)
    gone = [n for n in plan.active if n in lost]
    avoid = [n for n in plan.active if (n in suspect or n in draining) and n not in gone]
    swap = avoid[:max(0, healthy - len(gone))]
    keep = [n for n in plan.active if n not in gone and n not in swap]
    need = policy.nodes - len(keep)
    new = keep + spare[:need]
    spare = spare[need:] if need > 0 else spare
    if len(new) < policy.floor:
        raise ValueError(f"{len(new)} healthy node(s) left ({', '.join(new) or 'none'}), fewer than "
                         f"--min-nodes {policy.floor}")
    excluded = plan.excluded + [n for n in gone + swap if n not in plan.excluded]
    parts = [f"excluded {', '.join(gone + swap)}" if gone + swap else "no node excluded",
             f"{len(new)} node(s): {', '.join(new)}"]
    kept = [n for n in new if n in draining]
    parts += [f"draining, kept: {', '.join(kept)}"] if kept else []
    return NodePlan(active=new, spare=spare, excluded=excluded), "; ".join(parts)
