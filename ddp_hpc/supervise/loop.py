"""The supervisor's loop in the batch step: start the ranks as one srun step, watch it, and after
a fault stop every rank, judge what failed from the run logs (the evidence ``ddp-hpc status``
uses: ``ddp_hpc.runlogs.attribution``), exclude what failed and start the ranks again, up to
``--max-restarts`` times. Every restart is appended to ``restarts.jsonl`` in the log directory and
to the job's record, and each new step gets ``DDP_HPC_ALLOC_RESTARTS`` (so its ranks' restart
number, ``job_facts().restart_count``, is a new one); every step gets ``TORCHELASTIC_MAX_RESTARTS``
(``--max-restarts``, as torchrun's agent would set it) unless the user set it.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
from dataclasses import dataclass
from typing import Mapping

from ddp_hpc import records
from ddp_hpc.env.job import ALLOC_RESTARTS_VAR, job_facts
from ddp_hpc.exits import EX_TEMPFAIL, exit_status_of_returncode
from ddp_hpc.runlogs.attribution import Failure, SchedulerFacts, attribute
from ddp_hpc.runlogs.reader import RunLogs
from ddp_hpc.runlogs.restarts import append_restart, read_restarts
from ddp_hpc.runlogs.schema import rank_out
from ddp_hpc.slurm.cli import SlurmCLI
from ddp_hpc.slurm.hostlist import compress, expand
from ddp_hpc.supervise.plan import NodePlan, Policy, next_nodes, verdict
from ddp_hpc.supervise.watch import EventTail, StepEnd, Watch, down_nodes, stop_step, watch_step

__all__ = ["Settings", "supervise", "step_env", "step_args"]

PREFIX = "ddp_hpc supervise:"


@dataclass(frozen=True)
class Settings:
    policy: Policy
    log_dir: str
    command: tuple[str, ...]
    srun_args: tuple[str, ...] = ()     # the user's srun options, one word each
    stall_timeout_s: float = 0.0


def _say(text: str) -> None:
    print(f"{PREFIX} {text}", file=sys.stderr, flush=True)


def step_env(s: Settings, environ: Mapping[str, str], restarts: int) -> dict[str, str]:
    """The step's environment: the batch step's, with ``DDP_HPC_ALLOC_RESTARTS`` (the restarts so
    far) and torchrun's ``TORCHELASTIC_MAX_RESTARTS`` (``--max-restarts``) unless the user set it."""
    return {"TORCHELASTIC_MAX_RESTARTS": str(s.policy.max_restarts), **environ, ALLOC_RESTARTS_VAR: str(restarts)}


def step_args(s: Settings, nodes: list[str], again: bool = False) -> list[str]:
    """srun's arguments for a step on ``nodes``: --no-kill (a lost node does not end the job),
    one task per GPU, every rank's output in the log directory. ``again`` (a restart): --overlap,
    since Slurm keeps the stopped step, and the resources it held, while a lost node of it does
    not answer (the new step would wait "Requested nodes are busy" until then)."""
    g = s.policy.tasks_per_node
    return ["--no-kill", *(["--overlap"] if again else []), "--kill-on-bad-exit=1", "--open-mode=append",
            f"--output={s.log_dir}/{rank_out('%t')}", f"--nodes={len(nodes)}",
            f"--ntasks={len(nodes) * g}", f"--ntasks-per-node={g}", f"--nodelist={compress(nodes)}",
            *s.srun_args, *s.command]


class _Stop:
    """SIGTERM / SIGINT to the batch step (scancel, the time limit): end without restarting."""

    def __init__(self) -> None:
        self.asked = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on)

    def _on(self, signum, frame) -> None:
        self.asked = True


def supervise(s: Settings, cli: SlurmCLI | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Run the job's ranks until they end, restarting them after restartable faults; returns
    the exit status for the batch script."""
    environ = dict(os.environ if environ is None else environ)
    cli, stop = cli or SlurmCLI(), _Stop()
    facts = job_facts(environ)
    hosts = expand(facts.node_list or "")
    plan = NodePlan(active=hosts[:s.policy.nodes], spare=hosts[s.policy.nodes:])
    key = facts.key or facts.job_id
    before = len(read_restarts(s.log_dir, key))   # earlier runs' restarts (a requeued job)
    done, restart = 0, facts.restart_count + before
    while True:
        proc = cli.start_step(step_args(s, plan.active, again=done > 0), step_env(s, environ, before + done))
        end = watch_step(proc, EventTail(s.log_dir, restart), cli,
                         Watch(tuple(plan.active), s.stall_timeout_s), lambda: stop.asked)
        if stop.asked:
            return exit_status_of_returncode(_wait(proc))
        if end.trigger == "exited" and end.returncode in (0, EX_TEMPFAIL):
            return end.returncode
        rc = exit_status_of_returncode(stop_step(proc))
        entry = _judge(s, cli, plan, end, restart, done, key)
        if entry is None:
            return rc or 1
        append_restart(s.log_dir, entry)
        _to_record(key, entry)
        done, restart = done + 1, restart + 1
        plan = entry.pop("_plan")


def _wait(proc, timeout: float = 60.0) -> int | None:
    try:
        return proc.wait(timeout)
    except Exception:  # noqa: BLE001 - srun did not end on the job's own signal: end it
        return stop_step(proc, 5.0)


def _judge(s: Settings, cli, plan: NodePlan, end: StepEnd, restart: int, done: int, key) -> dict | None:
    """The restart's record (with the next plan under ``_plan``), or None to give up (said why)."""
    down = sorted(set(end.down) | set(down_nodes(cli, plan.active)))
    failure, _ = attribute(RunLogs(s.log_dir), restart=restart, assume_failed=True,
                           sched=SchedulerFacts("NODE_FAIL" if down else None))
    kind = failure.kind if failure else None
    why = failure.summary if failure else {"stalled": f"no training step for {s.stall_timeout_s:g} s",
                                          "node down": f"node(s) {', '.join(down)} down"}.get(
                                              end.trigger, f"the step ended ({end.trigger})")
    v = verdict(kind, end.trigger, s.policy, done)
    if not v.restart:
        _say(f"not restarting: {why}: {v.reason}")
        return None
    lost = down + ([failure.node] if failure and failure.kind == "vanished" and failure.node else [])
    suspect = [failure.host] if failure and failure.host and kind in ("killed", "stuck", "lost") else []
    try:
        new, words = next_nodes(plan, lost, suspect, s.policy)
    except ValueError as exc:
        _say(f"not restarting: {why}: {exc}")
        return None
    g = s.policy.tasks_per_node
    entry = {"restart": restart + 1, "job_id": key, "fault_at": _fault_at(failure, end),
             "detected_at": round(end.detected_at, 3), "trigger": end.trigger, "why": why,
             "kind": kind, "rank": failure.rank if failure else None,
             "node": (failure.node or failure.host) if failure else (down[0] if down else None),
             "basis": failure.basis if failure else end.trigger, "excluded": new.excluded[len(plan.excluded):],
             "nodes_before": plan.active, "nodes_after": new.active,
             "world_before": len(plan.active) * g, "world_after": len(new.active) * g, "_plan": new}
    _say(f"restart {done + 1} of at most {s.policy.max_restarts} (restart number {restart + 1}): "
         f"{why}; {words}; world size {entry['world_before']} -> {entry['world_after']}")
    return entry


def _fault_at(failure: Failure | None, end: StepEnd) -> float:
    """When the fault happened, as well as the evidence tells: the blamed rank's failure time (a
    silent rank's last event), the first failed rank's event, the newest step of a stalled run."""
    seen = [t for t in (failure.time if failure else None, end.first_bad_at) if t]
    if end.trigger == "stalled" and end.last_step_at:
        seen.append(end.last_step_at)
    return round(min(seen) if seen else end.detected_at, 3)


def _to_record(key, entry: dict) -> None:
    """Add the restart to the job's record (``alloc_restarts``); a job without one is fine."""
    if not key:
        return
    try:
        rec = records.load_record(str(key))
        rows = [*(rec.alloc_restarts or []), {k: v for k, v in entry.items() if not k.startswith("_")}]
        records.update_record(dataclasses.replace(rec, alloc_restarts=rows))
    except (records.JobRecordError, OSError) as exc:
        _say(f"warning: restart not added to the job record: {exc}")
