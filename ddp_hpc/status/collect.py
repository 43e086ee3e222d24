"""Put together one job's status: its record, the scheduler's (or processes') state, and its logs.

The result, :class:`JobStatus`, is a plain value that the views render as a table row, a detail
page or JSON; nothing here prints. A record of a job array becomes one status per array task
(each task has its own log directory).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddp_hpc import records
from ddp_hpc.judge import flightrec, kept, timing
from ddp_hpc.judge.consequences import compress as compress_ranks
from ddp_hpc.judge.consequences import ranks_text
from ddp_hpc.judge.reader import Failure, RunLogs, RunProgress
from ddp_hpc.judge.tails import HEAD_BYTES, TAIL_LINES
from ddp_hpc.slurm.query import SourceState, cluster_or_reason, query_slurm
from ddp_hpc.slurm.states import JobState
from ddp_hpc.slurm.times import format_duration, normalize_duration
from ddp_hpc.status import rowcache
from ddp_hpc.status import sources as src
from ddp_hpc.status.diagnose import diagnose, restart_base, run_causes
from ddp_hpc.status.restarts import alloc_restarts
from ddp_hpc.status.staging import stage_rows
from ddp_hpc.status.targets import StatusTarget
from ddp_hpc.text import plural


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
    nodes: int | None  # a node range's: the nodes it runs or ran on (None: not known yet)
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
    progress: RunProgress | None = None
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
    #: rank -> how it ended by the evidence (kind raised|exited|killed|vanished|stuck|consequence|
    #: stopped|lost|completed|preempted|running, text, basis, times): ddp_hpc.runlogs.attribution
    rank_classification: dict[str, dict] = field(default_factory=dict)
    stall: dict | None = None  # a running job's silent ranks (ddp_hpc.runlogs.timing.stall)
    timing: dict | None = None  # per-rank and per-node step times, stragglers (timing.stragglers)
    eval_metrics: dict | None = None  # the newest eval event's metrics
    eval_step: int | None = None
    overrides: list[str] | None = None  # an array task's overrides (the record's array[i])
    flight: list[str] = field(default_factory=list)  # the flight recorder's dumps (runlogs.flightrec)
    staging: list[dict] = field(default_factory=list)  # per node leader and source (status/staging.py)
    #: the in-allocation restarts (ddp_hpc.supervise), each with lost_s: status.restarts
    alloc_restarts: list[dict] = field(default_factory=list)
    node_range: str | None = None  # "2-4": submitted with --nodes MIN-MAX

    @property
    def job_state(self) -> JobState:
        return JobState[self.state_name]

    def to_dict(self) -> dict:
        """The fields as plain data for JSON: the nested dataclasses (progress, failure) become
        dicts, the rest is shared with this status rather than deep-copied (copying 8,192 ranks'
        events and classifications was most of ``status --json``'s time)."""
        d = dict(vars(self))
        if self.progress is not None:  # numbers only: a shallow copy is a copy
            d["progress"] = dict(vars(self.progress))
        if self.failure is not None:
            d["failure"] = dataclasses.asdict(self.failure)
        d["last_events"] = {str(k): v for k, v in self.last_events.items()}
        d["rank_exit_codes"] = {str(k): v for k, v in self.rank_exit_codes.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "JobStatus":
        """The status `to_dict` gave (after a JSON round trip): the job table's cached rows."""
        d = dict(d, progress=RunProgress(**d["progress"]) if d.get("progress") else None,
                 failure=Failure(**d["failure"]) if d.get("failure") else None)
        d["last_events"] = {int(k): v for k, v in (d.get("last_events") or {}).items()}
        d["rank_exit_codes"] = {int(k): v for k, v in (d.get("rank_exit_codes") or {}).items()}
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


def collect(targets: list[StatusTarget], cli=None, cli_note: str | None = None, history: bool = False,
            now: float | None = None, only: str | None = None, brief: bool = False) -> list[JobStatus]:
    """Status of every target; Slurm ones are queried in one batch per source (one squeue and
    one sacct call however many jobs and array tasks). ``only`` names the one source to ask
    (squeue | sacct | "sacct -c" | logs), for comparing them. A terminal state the scheduler
    reports is kept in the job's record (`records.store_finals`, all at once). ``brief``: only what the job
    table shows (no failure attribution, per-rank endings or step times), and an ended job's
    row is taken from the table's cache (`ddp_hpc.status.rowcache`) while its record, its logs
    and the scheduler's answer are unchanged."""
    now = time.time() if now is None else now
    cluster, down = (cluster_or_reason(cli) if cli is not None and any(not t.local for t in targets)
                     else (None, None))
    foreign = {t.id for t in targets if not t.local and cluster and t.record is not None
               and getattr(t.record, "cluster", None) not in (None, "", cluster)}
    slurm_ids = [t.id for t in targets if not t.local and t.id not in foreign]
    expect = {t.id: {"name": getattr(t.record, "name", None),
                     "submitted_at": getattr(t.record, "submitted_at", None)}
              for t in targets if t.record is not None}
    found: dict[str, SourceState] = {}
    tried: list[str] = [cli_note] if cli_note else []
    if only == src.LOGS:
        tried.append("logs: asked for with --source logs")
    elif slurm_ids and cli is not None:
        found, more = query_slurm(slurm_ids, cli, expect, history=history,
                                      controller_down=down, only=only)
        tried += more
    out, finals = [], {}
    with _no_cycle_collection():
        cache = rowcache.load() if brief else None
        for t in targets:
            st, final = _cached_or_one(t, found.get(t.id), tried, now, only, cache)
            if t.id in foreign:
                st.notes.append(f"submitted on cluster {t.record.cluster!r}, not this one ({cluster!r}): "
                                "the scheduler was not asked (job ids repeat across clusters)")
            if final is not None and getattr(t.record, "path", None):
                finals.setdefault(id(t.record), (t.record, {}))[1][_task_id(t)] = final
            out.append(st)
        try:
            records.store_finals(finals.values())
        except OSError:  # a read-only job store: status still answers
            pass
        if cache is not None:
            cache.save()
    return out


def _cached_or_one(t: StatusTarget, sched: SourceState | None, tried: list[str], now: float,
                   only: str | None, cache: rowcache.RowCache | None) -> tuple[JobStatus, dict | None]:
    """(the job's status, the final state to keep in its record): the table's row from what an
    ended job's record keeps of its logs, or kept while what it was made from is unchanged, else
    worked out (kept when the job ended, unless its record is to keep it)."""
    if (brief := cache is not None) and (logs := src.kept_logs(t.record, _task_id(t), t.log_dir, sched)):
        return _one(t, sched, tried, now, only, brief=True, logs=logs)
    if brief and src.keeps_final(t, sched):  # the next table takes the row from the record
        cache = None
    key = cache.key(t, sched, only) if cache is not None else None
    if (row := cache.get(key) if key is not None else None) is not None:
        return JobStatus.from_dict(row), None
    st, final = _one(t, sched, tried, now, only, brief=brief)
    if key is not None:
        cache.put(key, st.to_dict())
    return st, final


@contextlib.contextmanager
def _no_cycle_collection():
    """Python's cycle collector paused while jobs' logs are read and judged: the hundreds of
    thousands of event dicts of a big job (freed by reference counting, no cycles) made it scan
    the heap again and again, a third of the time of an 8,192-rank job's status; and over
    thousands of jobs the statuses and kept rows that pile up made every collection longer."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _task_id(t: StatusTarget) -> str | None:
    """The array task id of a target made from an array record (``123_4`` -> ``"4"``)."""
    return t.id.rsplit("_", 1)[-1] if getattr(t.record, "array", None) and "_" in t.id else None


def _state_of(t: StatusTarget, sched: SourceState | None, tried: list[str], logs: RunLogs,
              only: str | None) -> SourceState:
    """Where a Slurm job's state comes from: the scheduler, else the final state kept in the
    record, else the logs."""
    final = records.final_of(t.record, _task_id(t)) if only is None else None
    if final and (sched is None or sched.state.state is JobState.UNKNOWN):
        return src.from_final(final, sched.tried if sched else tried)
    return sched if sched is not None else src.from_logs(logs, tried)


def _nodes(rec, sched: SourceState, logs: RunLogs, cur) -> dict:
    """``nodes`` and ``node_range`` of the status. A job submitted with ``--nodes MIN-MAX`` (its
    record keeps MAX and ``min_nodes``) runs on as many nodes as its current run's start event
    says, else as the scheduler gave it once it started; before that the number is unknown."""
    nodes, low = getattr(rec, "nodes", None), getattr(rec, "min_nodes", None)
    if not low or not nodes:
        return {"nodes": nodes or sched.nodes}
    used = kept.start_nodes(logs, cur)
    got_nodes = sched.state.state is not JobState.PENDING and sched.node_list not in (None, "", "None assigned")
    return {"nodes": used if used is not None or not got_nodes else sched.nodes, "node_range": f"{low}-{nodes}"}


def _one(t: StatusTarget, sched: SourceState | None, tried: list[str], now: float,
         only: str | None = None, brief: bool = False, logs=None) -> tuple[JobStatus, dict | None]:
    """One job's status; ``logs``: the table's facts of an ended job's logs as its record keeps
    them (`sources.kept_logs`), else its logs are read."""
    rec = t.record
    # a running Slurm job's row needs every rank's recent steps (its stall): not only their ends
    running = brief and not t.local and sched is not None and sched.state.state is JobState.RUNNING
    logs = logs or RunLogs(t.log_dir, ends_only=brief and not running, window=running,
                           rank0_only=brief and src.ended_clean(t.local, rec, _task_id(t), sched, only))
    notes: list[str] = []
    if t.local:
        sched, keep = src.local_state(rec, _task_id(t), logs, notes, now)
    else:
        sched, keep = _state_of(t, sched, tried, logs, only), None
    state = sched.state
    if state.state is JobState.RUNNING:  # its stall is judged from every rank's recent steps
        logs.widen()
    base = restart_base(rec)
    inside = [] if brief else alloc_restarts(rec, t.log_dir, logs)
    failure, endings = (None, {}) if brief else diagnose(logs, sched, notes, base, inside)
    cur = logs.current_run()  # the newest run: the earlier ones are the detail view's (run_causes)
    restarts = max(base + (sched.restarts or 0), cur.restart if cur is not None else 0)
    progress = logs.progress(now)
    if progress is not None and not state.state.active:
        progress.eta_s = 0.0 if state.state is JobState.COMPLETED else None
    elapsed = sched.elapsed or _elapsed_of(cur, state.state.active, now)
    _read_notes(t, logs, notes, sched)
    # srun's "task R: Exited" lines stay in the appended batch output after a requeue: only
    # worth showing when the job did not complete
    codes = {} if state.state is JobState.COMPLETED or brief else logs.srun_exit_codes()
    if not codes and sched.source == "record" and not brief:
        codes = {int(r): c for r, c in (records.final_of(rec, _task_id(t)) or {}).get(
            "rank_exit_codes", {}).items()}
    ev = logs.last_eval()
    st = JobStatus(
        id=t.id, name=getattr(rec, "name", None), backend=getattr(rec, "backend", None),
        state=state.label, state_name=state.state.name, source=sched.source, tried=sched.tried,
        **_nodes(rec, sched, logs, cur),
        gpus_per_node=getattr(rec, "gpus_per_node", None), device=logs.device(),
        elapsed=elapsed, time_limit=sched.time_limit or normalize_duration(getattr(rec, "time_limit", None)),
        restarts=restarts, log_dir=t.log_dir, cwd=getattr(rec, "cwd", None),
        submitted_at=getattr(rec, "submitted_at", None), reason=sched.reason,
        node_list=sched.node_list, progress=progress, last_events={} if brief else logs.last_events(),
        failure=failure, exit_code=sched.exit_code, steps=sched.steps, rank_exit_codes=codes,
        scheduler_history=sched.history, history_source=sched.history_source,
        runs=[] if brief else run_causes(logs, logs.runs(), sched, base, inside), notes=notes,
        command=getattr(rec, "command", None), rank_endings={} if brief else rank_endings(logs),
        rank_classification={str(r): e.to_dict() for r, e in endings.items()},
        eval_metrics=ev.get("metrics") if ev else None, eval_step=ev.get("step") if ev else None,
        overrides=_overrides(t), staging=[] if brief else stage_rows(logs),
        alloc_restarts=inside)
    _timing(st, logs, now, brief)
    if not brief and t.log_dir:   # NCCL's flight recorder dumps of the current run
        since = cur.started if cur is not None else None
        st.flight = flightrec.summary(flightrec.dumps(Path(t.log_dir), since), ranks_text)
    if keep is not None and (summary := kept.summarize(logs)) is not None:  # a local job status saw end
        keep["logs"] = summary
    return st, keep if t.local else src.final_to_keep(sched, logs, now, records.final_of(rec, _task_id(t)))


def _read_notes(t: StatusTarget, logs: RunLogs, notes: list[str], sched: SourceState) -> None:
    """What kept status from reading the logs whole, or at all."""
    if (partial := logs.partial) and not logs.ends_only:  # the table reads the others' ends only
        notes.append(f"the event files of {plural(len(partial), 'rank')} ({compress_ranks(partial)}) are too big "
                     f"to read whole: status read their first {HEAD_BYTES >> 10} KiB and last {TAIL_LINES} lines "
                     "(step times and earlier runs are judged from those)")
    bad = sum(s.bad_lines for s in logs.ranks.values())
    if bad:
        notes.append(f"{plural(bad, 'unreadable line')} in the event streams skipped")
    if t.log_dir and not logs.listed:
        notes.append(f"log directory {t.log_dir} " + (
            "does not exist (yet)" if not sched.state.state.terminal else "is gone; final state from the record"
            if sched.source == src.RECORD else "is gone"))


def _timing(st: JobStatus, logs: RunLogs, now: float, brief: bool = False) -> None:
    """Stall (a running job) and straggler facts (not ``brief``) from the current run's step
    events."""
    if brief and st.job_state is not JobState.RUNNING:  # nothing to judge for the table
        return
    restart = logs.current_restart()
    per_rank = {r: s.of_restart(restart) for r, s in logs.ranks.items()}
    if not brief:
        hosts = {r: next((e.get("host") for e in reversed(evs) if e.get("host")), None)
                 for r, evs in per_rank.items()}
        st.timing = timing.stragglers(per_rank, hosts)
    if st.job_state is JobState.RUNNING and (stall := timing.stall(per_rank, now)) is not None:
        stacks, none = timing.silent_stacks(per_rank, stall["ranks"], now, stall["threshold_s"])
        st.stall = {**stall, "stacks": stacks, "no_stack": none, "hang": timing.hang(per_rank, stall["ranks"])}


def _overrides(t: StatusTarget) -> list[str] | None:
    task = _task_id(t)
    for entry in getattr(t.record, "array", None) or []:
        if task is not None and str(entry.get("task_id")) == task:
            return list(entry.get("overrides") or [])
    return None


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
        if end.get("teardown"):   # the script ended, then the interpreter's teardown crashed
            how = ", ".join(filter(None, [how, f"{end['teardown']} in native teardown"]))
        out[rank] = str(end.get("status") or "ended") + (f" ({how})" if how else "")
    return out


def _elapsed_of(run, active: bool, now: float) -> str | None:
    """How long the newest run (``run``, a RunSummary) has run or ran."""
    if run is None or run.started is None:
        return None
    end = now if active else (run.last_time or now)
    return format_duration(end - run.started)
