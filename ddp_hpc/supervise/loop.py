"""The supervisor's loop in the batch step: start the ranks as one srun step, watch it, and after
a fault stop every rank, judge what failed from the run logs (``supervise.finding``: the evidence
``ddp-hpc status`` uses), exclude what failed and start the ranks again, up to
``--max-restarts`` times. A step whose every rank wrote that it completed ended well, whatever
srun's exit status (a signal that reached the ranks in their teardown). Before every start
(``Settings.health_check``, on in the command line) the step's nodes are checked
(``supervise.health``) and a failing one excluded.

Every restart is appended to ``restarts.jsonl`` in the log directory and to the job's record; a
step the supervisor stopped and did not restart is a line of ``restarts.jsonl`` too (`stop_row`),
so status says who stopped it and why. Each new step gets ``DDP_HPC_ALLOC_RESTARTS`` (so its
ranks' restart number, ``job_facts().restart_count``, is a new one); every step gets
``TORCHELASTIC_MAX_RESTARTS`` (``--max-restarts``, as torchrun's agent would set it) unless the
user set it.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Mapping

from ddp_hpc import records
from ddp_hpc.env.job import ALLOC_RESTARTS_VAR, job_facts
from ddp_hpc.exits import EX_TEMPFAIL, exit_status_of_returncode
from ddp_hpc.judge.restarts import read_restarts
from ddp_hpc.judge.srun import SUPERVISOR_PREFIX, starting_line, stopping_line
from ddp_hpc.runlogs.restarts import append_health, append_hold, append_restart, append_stop
from ddp_hpc.runlogs.schema import ALLOC_RESTARTS_FILE, RUN_MARK, rank_out
from ddp_hpc.slurm.cli import SlurmCLI, SlurmError
from ddp_hpc.slurm.hostlist import compress, expand
from ddp_hpc.supervise.finding import Finding, Judgement, all_completed, find, judge, restart_row, stop_row
from ddp_hpc.supervise.hang import DEFAULT_HANG_S, Hang, StepClock, ask_stacks, find_culprit, hold_row, no_hang
from ddp_hpc.supervise.health import check_nodes, health_row
from ddp_hpc.supervise.plan import NodePlan, Policy
from ddp_hpc.supervise.warm import Warm
from ddp_hpc.supervise.watch import EventTail, StepEnd, Watch, stop_step, watch_step

__all__ = ["Settings", "Finding", "Judgement", "supervise", "find", "judge", "restart_row", "stop_row",
           "step_env", "step_args"]   # the judging ones from supervise.finding

PREFIX = SUPERVISOR_PREFIX   # the judge reads our start and stop lines in the batch output
#: how long srun gets to end a step after its abort when the supervisor stopped it (a lost node,
#: a rank that lost a peer, a hang): its tasks were already SIGKILLed (`_stop`), and what srun
#: still waits for is a node that does not answer (KillWait + 2 s: 8.6 s of the bench's lost-node
#: restart) or the step's end from the controller (2 s of the killed-rank restart); the next step
#: overlaps this one, so srun is killed sooner
QUICK_STOP_S = 1.0
#: how long after the stop a restart waits for the kill of the old step's tasks (``scancel``) to
#: be delivered before it starts new ranks (the judgement and the health check run meanwhile)
KILL_WAIT_S = 1.0


@dataclass(frozen=True)
class Settings:
    policy: Policy
    log_dir: str
    command: tuple[str, ...]
    srun_args: tuple[str, ...] = ()     # the user's srun options, one word each
    stall_timeout_s: float = 0.0
    health_check: bool = False          # check the step's nodes before each start (supervise.health)
    hang_timeout_s: float = DEFAULT_HANG_S   # the hang limit's floor (hang.StepClock); 0: off
    warm_standby: bool = False          # keep a warm standby step for restarts (supervise.warm); the CLI's default


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
    cli = cli or SlurmCLI()
    warm = (Warm(cli, s.command, s.log_dir, s.policy.tasks_per_node, s.srun_args, _say)
            if s.warm_standby and Warm.serves(s.command) else None)
    try:
        return _supervise(s, cli, environ, warm)
    finally:
        if warm is not None:
            warm.drop()


def _supervise(s: Settings, cli, environ: dict, warm: Warm | None) -> int:
    stop = _Stop()
    facts = job_facts(environ)
    hosts = expand(facts.node_list or "")
    plan = NodePlan(active=hosts[:s.policy.nodes], spare=hosts[s.policy.nodes:])
    key = facts.key or facts.job_id
    before = len(read_restarts(s.log_dir, key))   # earlier runs' restarts (a requeued job)
    done, restart = 0, facts.restart_count + before
    decided = None   # a restart decided: recorded once the health check settled its nodes
    killer = stopped_at = None   # the kill of the old step's tasks (`_stop`), and when it began
    while True:
        env = step_env(s, environ, before + done)
        if s.health_check:
            plan = _healthy(s, cli, plan, env, done, restart, key)
        lost: tuple[str, ...] = ()
        if decided is not None:
            finding, old, new, stopped_at = decided
            _record_restart(s, key, {**restart_row(finding, old, plan or new, restart, key, s.policy.tasks_per_node),
                                     "stopped_at": stopped_at})
            decided, lost = None, finding.lost
        if plan is None:
            return 1
        _mark_outputs(s, len(plan.active) * s.policy.tasks_per_node, restart)
        if killer is not None:   # the old ranks gone before new ones start on their nodes and GPUs
            killer.join(max(0.0, stopped_at + KILL_WAIT_S - time.time()))
        _say(starting_line(restart))   # srun's reports after it are of this run's step
        proc = warm.take(plan.active, {ALLOC_RESTARTS_VAR: env[ALLOC_RESTARTS_VAR]}, lost) if warm and done else None
        if proc is None:
            proc = cli.start_step(step_args(s, plan.active, again=done > 0), env)
        standby = (lambda nodes=plan.active + plan.spare, env=env: warm.start(nodes, env)) if warm else None
        end, hang = _watch(s, proc, cli, plan, restart, facts.job_id, lambda: stop.asked, standby)
        if stop.asked:
            return exit_status_of_returncode(_wait(proc))
        if end.trigger == "exited" and end.returncode in (0, EX_TEMPFAIL):
            return end.returncode
        if end.trigger == "exited" and (done_words := all_completed(s.log_dir, restart, len(plan.active)
                                                                    * s.policy.tasks_per_node)):
            _say(done_words)   # e.g. a preemption notice that reached the ranks in their teardown
            return 0
        rc, killer = _stop(cli, proc, end, facts.job_id, restart)
        rc = exit_status_of_returncode(rc)
        stopped_at = round(time.time(), 3)
        j = judge(s, cli, plan, end, restart, done, hang)
        if j.plan is None:
            _say(f"not restarting: {j.finding.why}: {j.change}")
            if j.finding.stop:   # the supervisor ended the step: status says so, and blames no rank for it
                _keep(append_stop, s.log_dir, stop_row(j, restart, key))
            return rc or 1
        g = s.policy.tasks_per_node
        _say(f"restart {done + 1} of at most {s.policy.max_restarts} (restart number {restart + 1}): "
             f"{j.finding.why}; {j.change}; world size {len(plan.active) * g} -> {len(j.plan.active) * g}")
        decided = (j.finding, plan, j.plan, stopped_at)
        done, restart, plan = done + 1, restart + 1, j.plan


def _record_restart(s: Settings, key, row: dict) -> None:
    """The restart's line of restarts.jsonl and the job record's restarts."""
    _keep(append_restart, s.log_dir, row)
    _to_record(key, row)


def _mark_outputs(s: Settings, ranks: int, run: int) -> None:
    """Append `RUN_MARK` to each rank's output file before run ``run`` starts: srun appends every
    run's output to the same ``rank{R}.out``, and a reader takes a rank's traceback from after the
    newest mark only (a traceback of an earlier run is no evidence about this one)."""
    for r in range(ranks):
        try:
            with open(os.path.join(s.log_dir, rank_out(r)), "a", encoding="utf-8") as f:
                f.write(RUN_MARK.format(restart=run) + "\n")
        except OSError as exc:
            _say(f"warning: could not mark {rank_out(r)} for run {run}: {exc}; going on")
            return


def _healthy(s: Settings, cli, plan: NodePlan, env: dict, done: int, run: int, key) -> NodePlan | None:
    """The plan after the health check of its nodes (`supervise.health`); None: too few healthy."""
    c = check_nodes(cli, plan, s.policy, env, done > 0, s.log_dir)
    why = "; ".join(f"{n} excluded: {w}" for n, w in c.failed.items())
    when = f"restart {done} (restart number {run})" if done else "the first start"
    _say(f"health check of {len(plan.active)} node(s) before {when}: {c.seconds:.1f} s, {c.rounds} round(s); "
         + (f"{why}; {c.change}" if c.failed else c.change or "all passed"))
    if c.failed or c.notes:
        _keep(append_health, s.log_dir, health_row(c, run, key))
    return c.plan


def _watch(s: Settings, proc, cli, plan: NodePlan, restart: int, job_id, stopping,
           on_training=None) -> tuple[StepEnd, Hang | None]:
    """Watch the step until it ends or needs stopping (``on_training``: called once its first
    training step is seen). A stalled one: its ranks' stacks are asked first (so the evidence
    survives the stop) and name the hung rank; when the hang limit called it and ranks answered
    working outside a collective (``hang.busy_ranks``), or every rank outside one, it is no hang:
    the watch goes on and asks again after twice the wait (the stall timeout still applies)."""
    tail = EventTail(s.log_dir, restart)
    w = Watch(tuple(plan.active), s.stall_timeout_s, hang_floor_s=s.hang_timeout_s,
              clock=StepClock(s.hang_timeout_s))
    while True:
        end = watch_step(proc, tail, cli, w, stopping, on_training)
        if end.trigger != "stalled" or not job_id:
            return end, None
        answers, hosts = ask_stacks(cli, job_id, EventTail(s.log_dir, restart))
        busy = no_hang(answers, hosts)
        if busy is not None and end.stall_s != s.stall_timeout_s:   # the hang limit's call
            who = f"rank(s) {', '.join(map(str, busy))} work" if busy else "every rank works"
            hold = 2 * (end.stall_s or s.hang_timeout_s)
            _say(f"no hang: after {end.stall_s:g} s without a step {who} outside a collective; "
                 f"asking again in {hold:g} s")
            _keep(append_hold, s.log_dir, hold_row(restart, job_id, end, busy, answers, hold))
            w = dataclasses.replace(w, last_step_at=end.last_step_at, busy_at=end.detected_at, hold_s=hold)
            continue
        hang = find_culprit(answers, hosts)
        _say(f"hang: rank {hang.rank} {hang.why} ({hang.basis})" if hang else "hang: the ranks' stacks name no rank")
        return end, hang


def _stop(cli, proc, end: StepEnd, job_id, restart: int) -> tuple[int | None, threading.Thread | None]:
    """End a step that needs stopping: one the supervisor stopped is broken for certain (a rank
    lost a peer, a node is lost, a hang whose stacks were taken), so its tasks are killed at once
    (``scancel --signal=KILL JOB.STEP``, the step named by the ranks' rendezvous events: srun's
    abort would let each survivor tear down, about 2-3 s of Python and torch finalisation), then
    srun's own abort. Returns srun's exit status and the thread that kills the tasks (None: no
    kill needed), which a restart waits for before it starts new ranks. A line in the batch output
    says so first: srun then reports the tasks it killed ("task 1: Killed"), and the judge must not
    take the supervisor's kill for a rank's own fault (`ddp_hpc.judge.srun.SUPERVISOR_RE`)."""
    if end.trigger != "exited" and proc.poll() is None:
        _say(stopping_line(restart, end.trigger))
    killer = None
    if end.trigger != "exited" and end.step_id and job_id and proc.poll() is None:
        # in the background: scancel waits for the nodes' answers, 10 s and more for a lost one
        killer = threading.Thread(target=_kill_step, args=(cli, job_id, end.step_id), daemon=True)
        killer.start()
    return stop_step(proc, QUICK_STOP_S if end.trigger != "exited" else 8.0), killer


def _kill_step(cli, job_id, step_id) -> None:
    try:
        cli.kill_step(job_id, step_id)
    except (SlurmError, ValueError) as exc:
        _say(f"could not kill step {job_id}.{step_id} at once ({exc}); srun's abort ends it")


def _wait(proc, timeout: float = 60.0) -> int | None:
    try:
        return proc.wait(timeout)
    except Exception:  # noqa: BLE001 - srun did not end on the job's own signal: end it
        return stop_step(proc, 5.0)


def _keep(append, log_dir: str, row: dict) -> None:
    """Write a line of restarts.jsonl; a failed write (a full disk) is reported, and the supervisor
    goes on: the restart matters more than its record."""
    try:
        append(log_dir, row)
    except OSError as exc:
        _say(f"warning: could not write to {log_dir}/{ALLOC_RESTARTS_FILE}: {exc}; going on")


def _to_record(key, row: dict) -> None:
    """Add the restart to the job's record (``alloc_restarts``); a job without one is fine."""
    if not key:
        return
    try:
        records.add_alloc_restart(str(key), row)
    except (records.JobRecordError, OSError) as exc:
        _say(f"warning: restart not added to the job record: {exc}")
