"""Keep a requeued job off the nodes that failed its earlier runs (``preempt.exclude_failed_nodes``,
on by default; docs/status.md, "A node that fails").

What Slurm does on its own: a node whose slurmd stops answering is marked NOT_RESPONDING, then
DOWN after ``SlurmdTimeout``; the job gets NODE_FAIL and, when it may be requeued (``--requeue``
or ``JobRequeue=1``), goes back to the queue and runs on nodes that are up. Slurm keeps a DOWN
node out of every job, but once the node's slurmd registers again (``ReturnToService``) it is
back in service and a later run of the same job may land on it again.

What this adds, from the job's own evidence (the run logs name the node whose ranks vanished, or
srun's "Node failure on n2"; ``sacct -D`` says which runs ended NODE_FAIL):

- the nodes the supervisor's health check excluded before a start count as failed too;
- every requeue ddp_hpc makes (preemption, and the check below) adds those nodes to the job's
  ``ExcNodeList`` (``scontrol update`` right after ``scontrol requeue``, while the job pends);
- at the start of each restart, the batch script runs ``python -m ddp_hpc.supervise.avoid LOG_DIR``:
  a run placed again on a node that failed an earlier run requeues itself at once, excluding it
  (exit 75; the batch script then ends quietly). Nothing else changes when no node failed.
"""
from __future__ import annotations

import contextlib
import signal
import sys
from pathlib import Path

from ddp_hpc.env import job_facts
from ddp_hpc.exits import EX_TEMPFAIL
from ddp_hpc.judge.attribution import SchedulerFacts, attribute
from ddp_hpc.judge.reader import RunLogs
from ddp_hpc.judge.restarts import read_health, read_restarts, sched_index
from ddp_hpc.slurm.cli import SlurmCLI
from ddp_hpc.slurm.hostlist import expand
from ddp_hpc.slurm.query import query_slurm
from ddp_hpc.slurm.states import parse_state
from ddp_hpc.text import ArgumentParser

__all__ = ["failed_nodes", "requeue_avoiding", "check_placement", "main"]

#: exit status when the run requeued itself to leave a failed node
REQUEUED = EX_TEMPFAIL


@contextlib.contextmanager
def _term_held():
    """SIGTERM and SIGINT held back (delivered afterwards): requeueing its own job gets this
    process signalled at once, and the ``scontrol update`` that must follow the requeue would
    never run (seen on Slurm 22.05: a batch script died between the two commands)."""
    held = {signal.SIGTERM, signal.SIGINT}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _requeue(cli, job_id: str, nodes: list[str]) -> None:
    with _term_held():
        cli.requeue(job_id, exclude=nodes)


def _history(job_id: str, cli) -> list[str]:
    """The state name of every run of the job (``sacct -D``), oldest first; [] when unknown."""
    try:
        found, _ = query_slurm([job_id], cli, history=True)
    except Exception:  # noqa: BLE001 - no accounting: the run logs alone decide
        return []
    st = found.get(job_id)
    return [parse_state(h.get("state")).job_state.name for h in (st.history if st else [])]


def failed_nodes(log_dir: str | Path | None, job_id: str | None = None, before: int | None = None,
                 cli=None, base: int = 0) -> list[str]:
    """Nodes whose failure ended an earlier run of this job (restarts < ``before``; default all):
    the node named by the runs' attribution (its ranks vanished) and srun's "Node failure on",
    and every node the supervisor's health check excluded (``supervise.health``).
    ``base``: the restart number of ``job_id``'s first run (a job that resumed a stopped run in
    the same log directory); the scheduler's history of ``job_id`` is matched to the runs from
    there, and the runs before it (another job's) are judged by their logs alone."""
    # nodes the supervisor's health check excluded (a full scratch, a GPU that does not answer):
    # known before any rank logged, so read first
    nodes: set[str] = {n for h in read_health(log_dir, job_id) for n in (h.get("excluded") or {})}
    logs = RunLogs(log_dir)
    if not logs.ranks:
        return sorted(nodes)
    nodes.update(logs.node_failures()[1])
    inside = read_restarts(log_dir, job_id)   # lost nodes the supervisor left behind count too
    nodes.update(e["node"] for e in inside if e.get("node") and (e.get("kind") == "vanished"
                                                                 or e.get("trigger") == "node down"))
    runs = [r for r in logs.runs() if (before is None or r.restart < before)
            and r.end_status not in ("completed", "preempted")]
    states = _history(job_id, cli) if runs and job_id and cli is not None else []
    for run in runs:
        i = sched_index(run.restart, base, inside)
        state = states[i] if 0 <= i < len(states) else None
        failure, _ = attribute(logs, restart=run.restart, sched=SchedulerFacts(state), files=False,
                               assume_failed=state == "NODE_FAIL")
        if failure is not None and failure.kind == "vanished" and failure.node:
            nodes.add(failure.node)
    return sorted(nodes)


def requeue_avoiding(job_id: str, log_dir: str | Path | None, *, exclude: bool = True,
                     restart: int | None = None, base: int = 0, cli=None) -> list[str]:
    """``scontrol requeue`` the job; with ``exclude``, also keep it off the nodes that failed its
    earlier runs (returned; ``restart`` and ``base`` as in `failed_nodes`). Raises SlurmError
    when the requeue itself fails."""
    cli = cli or SlurmCLI()
    nodes = []
    if exclude:
        try:
            nodes = failed_nodes(log_dir, job_id, restart, cli, base)
        except Exception as e:  # noqa: BLE001 - never let the check stop a requeue
            print(f"ddp_hpc: failed nodes unknown ({type(e).__name__}: {e})", file=sys.stderr)
    _requeue(cli, job_id, nodes)
    return nodes


def check_placement(log_dir: str | Path, facts, cli=None, out=sys.stdout) -> int:
    """At a restart's start: 0 to go on, `REQUEUED` when this run landed on a node that failed an
    earlier one and was requeued to avoid it. Only a requeue checks (``facts.requeues``: the
    scheduler's restarts of this job, not a resumed run's restart numbers)."""
    if not facts.job_id or facts.requeues < 1:
        return 0
    cli = cli or SlurmCLI()
    bad = failed_nodes(log_dir, facts.key or facts.job_id, facts.restart_count, cli,
                       facts.restart_base)
    if not bad:
        return 0
    here = set(expand(facts.node_list)) if facts.node_list else set()
    again = sorted(here & set(bad))
    if not again:
        print(f"ddp_hpc: node(s) {', '.join(bad)} failed an earlier run; this run is elsewhere",
              file=out)
        return 0
    print(f"ddp_hpc: restart {facts.restart_count} landed on {', '.join(again)}, which failed an "
          f"earlier run: requeueing job {facts.key or facts.job_id} with ExcNodeList += "
          f"{', '.join(bad)}", file=out, flush=True)
    _requeue(cli, facts.key or facts.job_id, bad)
    return REQUEUED


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m ddp_hpc.supervise.avoid", description=__doc__.split("\n")[0])
    p.add_argument("log_dir", help="the run's log directory (the batch script's $LOG_DIR)")
    a = p.parse_args(argv)
    facts = job_facts()
    if not facts.exclude_failed_nodes:
        return 0
    try:
        return check_placement(a.log_dir, facts)
    except Exception as e:  # noqa: BLE001 - a failed check must not stop the restart
        print(f"ddp_hpc: could not check for failed nodes ({type(e).__name__}: {e}); going on",
              file=sys.stderr)
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
