"""Put together one job's status: its record, the scheduler's (or processes') state, and its logs.

The result, :class:`JobStatus`, is a plain value that the views render as a table row, a detail
page or JSON; nothing here prints. A record of a job array becomes one status per array task
(each task has its own log directory).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddp_hpc.cli import plural
from ddp_hpc.runlogs.reader import Failure, Progress, RunLogs
from ddp_hpc.slurm.states import JobState
from ddp_hpc.slurm.times import format_duration, normalize_duration
from ddp_hpc.status import sources as src
from ddp_hpc.status.targets import Target


#: terminal states in which the job itself broke (rather than being stopped from outside): here
#: the rank whose events stopped first is a suspect even without an error event
CRASHED = frozenset({JobState.FAILED, JobState.NODE_FAIL, JobState.OUT_OF_MEMORY,
                     JobState.BOOT_FAIL, JobState.LAUNCH_FAILED})


@dataclass
class JobStatus:
    """Everything the status command knows about one job (or array task)."""

    id: str
    name: str | None
    backend: str | None
    state: str  # label shown to the user, e.g. "CANCELLED by 0" or "UNKNOWN(FOO)"
    state_name: str  # JobState member name
    source: str  # which source gave the state
    tried: list[str]
    nodes: int | None
    gpus_per_node: int | None
    device: str | None  # "cpu", "cuda", ... as the run's start events tell it; None: not told
    elapsed: str | None
    time_limit: str | None
    restarts: int
    log_dir: str | None
    cwd: str | None = None
    submitted_at: float | None = None
    reason: str | None = None
    node_list: str | None = None
    progress: Progress | None = None
    last_events: dict[int, dict] = field(default_factory=dict)
    failure: Failure | None = None
    exit_code: str | None = None
    steps: list[dict] = field(default_factory=list)
    rank_exit_codes: dict[int, int] = field(default_factory=dict)
    scheduler_history: list[dict] = field(default_factory=list)
    history_source: str | None = None
    runs: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    command: list[str] | None = None  # a script/module/function job: what every rank ran
    rank_endings: dict[int, str] = field(default_factory=dict)  # from the current run's end events

    @property
    def job_state(self) -> JobState:
        return JobState[self.state_name]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["last_events"] = {str(k): v for k, v in self.last_events.items()}
        d["rank_exit_codes"] = {str(k): v for k, v in self.rank_exit_codes.items()}
        return d


def collect(targets: list[Target], cli=None, cli_note: str | None = None, history: bool = False,
            now: float | None = None, only: str | None = None) -> list[JobStatus]:
    """Status of every target; Slurm ones are queried in one batch per source. ``only`` names
    the one source to ask (squeue | sacct | "sacct -c" | logs), for comparing them."""
    now = time.time() if now is None else now
    cluster, down = (src.cluster_or_reason(cli) if cli is not None and any(not t.local for t in targets)
                     else (None, None))
    foreign = {t.id for t in targets if not t.local and cluster and t.record is not None
               and getattr(t.record, "cluster", None) not in (None, "", cluster)}
    slurm_ids = [t.id for t in targets if not t.local and t.id not in foreign]
    expect = {t.id: {"name": getattr(t.record, "name", None),
                     "submitted_at": getattr(t.record, "submitted_at", None)}
              for t in targets if t.record is not None}
    found: dict[str, src.SourceState] = {}
    tried: list[str] = [cli_note] if cli_note else []
    if only == src.LOGS:
        tried.append("logs: asked for with --source logs")
    elif slurm_ids and cli is not None:
        found, more = src.query_slurm(slurm_ids, cli, expect, history=history,
                                      controller_down=down, only=only)
        tried += more
    out = []
    for t in targets:
        st = _one(t, found.get(t.id), tried, now)
        if t.id in foreign:
            st.notes.append(f"submitted on cluster {t.record.cluster!r}, not this one ({cluster!r}): "
                            "the scheduler was not asked (job ids repeat across clusters)")
        out.append(st)
    return out


def _one(t: Target, sched: src.SourceState | None, tried: list[str], now: float) -> JobStatus:
    rec = t.record
    logs = RunLogs(t.log_dir)
    notes: list[str] = []
    if t.local:
        alive = src.pids_alive(getattr(rec, "pids", None), getattr(rec, "submitted_at", None),
                               getattr(rec, "cluster", None))
        if alive is None and getattr(rec, "pids", None):
            notes.append("pids recorded on another host; state from the logs")
        sched = src.from_logs(logs, [], src.PROCESSES if alive is not None else src.LOGS, alive)
    elif sched is None:
        sched = src.from_logs(logs, tried)
    state = sched.state
    failure = None
    if state.state in CRASHED or logs.outcome() == "failed":
        failure = logs.first_failure(assume_failed=state.state in CRASHED)
    elif state.state.terminal or state.state is JobState.UNKNOWN:
        # cancelled, timed out, preempted: every rank was stopped from outside, so only a rank
        # that raised on its own (an error event, a traceback) counts as a failure
        failure = logs.first_failure(evidence_only=True)
    elif state.state.active:
        failure = logs.first_failure(evidence_only=True)
        if failure is not None:
            notes.append(f"the scheduler says {state.label} but rank {failure.rank} failed "
                         f"({failure.basis}); the job should end soon (kill-on-bad-exit)")
    runs = logs.runs()
    restarts = max([sched.restarts or 0] + [r.restart for r in runs])
    progress = logs.progress(now)
    if progress is not None and not state.state.active:
        progress.eta_s = 0.0 if state.state is JobState.COMPLETED else None
    elapsed = sched.elapsed or _elapsed_from_runs(runs, state.state.active, now)
    bad = sum(s.bad_lines for s in logs.ranks.values())
    if bad:
        notes.append(f"{plural(bad, 'unreadable line')} in the event streams skipped")
    if t.log_dir and not Path(t.log_dir).is_dir():
        notes.append(f"log directory {t.log_dir} does not exist (yet)")
    return JobStatus(
        id=t.id, name=getattr(rec, "name", None), backend=getattr(rec, "backend", None),
        state=state.label, state_name=state.state.name, source=sched.source, tried=sched.tried,
        nodes=getattr(rec, "nodes", None) or sched.nodes,
        gpus_per_node=getattr(rec, "gpus_per_node", None), device=logs.device(),
        elapsed=elapsed, time_limit=sched.time_limit or normalize_duration(getattr(rec, "time_limit", None)),
        restarts=restarts, log_dir=t.log_dir, cwd=getattr(rec, "cwd", None),
        submitted_at=getattr(rec, "submitted_at", None), reason=sched.reason,
        node_list=sched.node_list, progress=progress, last_events=logs.last_events(),
        failure=failure, exit_code=sched.exit_code, steps=sched.steps,
        # srun's "task R: Exited" lines stay in the appended batch output after a requeue: only
        # worth showing when the job did not complete
        rank_exit_codes={} if state.state is JobState.COMPLETED else logs.srun_exit_codes(),
        scheduler_history=sched.history,
        history_source=sched.history_source, runs=[dataclasses.asdict(r) for r in runs],
        notes=notes, command=getattr(rec, "command", None), rank_endings=rank_endings(logs))


def rank_endings(logs: RunLogs) -> dict[int, str]:
    """rank -> how it ended in the current run, from its ``end`` event: ``completed``,
    ``failed (exit 1)``, ``killed (SIGKILL)``...; ranks without an end event are left out."""
    restart = logs.current_restart()
    out: dict[int, str] = {}
    for rank, stream in sorted(logs.ranks.items()):
        end = next((e for e in reversed(stream.of_restart(restart)) if e.get("event") == "end"), None)
        if end is None:
            continue
        how = end.get("signal") or (f"exit {end['exit_code']}" if end.get("exit_code") else None)
        out[rank] = f"{end.get('status')}" + (f" ({how})" if how else "")
    return out


def _elapsed_from_runs(runs, active: bool, now: float) -> str | None:
    if not runs or runs[-1].started is None:
        return None
    end = now if active else (runs[-1].last_time or now)
    return format_duration(end - runs[-1].started)
