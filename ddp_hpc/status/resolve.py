"""The one place that decides a job's state and its row, from its sources in one order.

A job's state can be told by five sources. They are asked in this order, and the first that
knows answers (``JobStatus.source`` names it):

1. **the scheduler** (`ddp_hpc.slurm.query`: squeue, else sacct, else ``sacct -c``), for a Slurm
   job it lists in any state but UNKNOWN: the one authority on a job that is queued or runs,
   and the freshest word on how it ended. A local job has no scheduler: its record (2) and its
   processes (3) take that part.
2. **the job's record**: the terminal state kept in it (`records.final_of`: what status last saw
   from the scheduler, what the local driver saw when the run ended, ``ddp-hpc cancel``). It
   answers once the scheduler forgot the job or cannot be reached (and not when the user asked
   for one source with ``--source``). For a local job it comes first: the driver wrote it when
   the run ended, and nothing newer can tell.
3. **the run logs** (their ``end`` events; a local job's recorded processes alive or gone): the
   only source left when neither a scheduler nor a record knows the job.

The row's facts (progress, loss, device, eval metrics, how the newest run ended) always come
from the logs. Two shortcuts stand in for reading them, for the job table only, and only where
they answer what 1-3 would:

4. **kept facts** (`ddp_hpc.judge.kept`, in the record's final state): what the table shows of
   an ended job's logs, while the files they were read from are unchanged (or gone);
5. **the row cache** (`ddp_hpc.status.rowcache`): an ended job's whole row, while everything it
   was made from (the record, the log directory's files, the scheduler's answer) is unchanged.

Why this order: a source lower in the list is older news. The scheduler's word is live; the
record keeps what a live source said when the job ended; the logs are what the ranks wrote, which
stops when a rank is killed; kept facts and cached rows are copies of what 1-3 gave, so they are
asked first (they are cheapest) but never tell anything 1-3 would not.

`resolve` gives one `Resolved` job; the table's row (`Resolved.row`) and the detail view
(`Resolved.detail`) are two views over it. A job whose end a Slurm source reported, or a local
job whose processes status found gone, also gives the final state to keep in its record
(`Resolved.final_to_keep`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

from ddp_hpc import records
from ddp_hpc.judge import flightrec, gpu, kept, picture, timing
from ddp_hpc.judge.compute import compute_stragglers, with_compute
from ddp_hpc.judge.consequences import compress as compress_ranks
from ddp_hpc.judge.consequences import ranks_text
from ddp_hpc.judge.goodput import goodput
from ddp_hpc.judge.kept import KeptLogs
from ddp_hpc.judge.reader import RunLogs, RunSummary
from ddp_hpc.judge.restarts import read_restarts
from ddp_hpc.judge.tails import HEAD_BYTES
from ddp_hpc.parsing import to_int
from ddp_hpc.records import JobRecord
from ddp_hpc.slurm.query import SourceState
from ddp_hpc.slurm.states import JobState, parse_state
from ddp_hpc.slurm.times import duration_seconds, format_duration, normalize_duration
from ddp_hpc.status import rowcache
from ddp_hpc.status import sources as src
from ddp_hpc.status.diagnose import diagnose, run_causes
from ddp_hpc.status.job import JobStatus
from ddp_hpc.status.restarts import alloc_restarts, current_restore
from ddp_hpc.status.snapshots import snapshot_notes
from ddp_hpc.status.staging import stage_rows
from ddp_hpc.status.targets import StatusTarget
from ddp_hpc.text import plural

__all__ = ["JobSources", "Resolved", "resolve", "table_row", "rank_endings"]


@dataclass(frozen=True)
class JobSources:
    """What one job is resolved from, before any log is read: its target (id, record, log
    directory), the scheduler's answer (None: not asked, or it does not list the job), the notes
    of the sources tried, ``now``, and ``only`` (the one source the user asked for)."""

    target: StatusTarget
    sched: SourceState | None
    tried: list[str]
    now: float
    only: str | None = None

    @property
    def record(self) -> JobRecord | None:
        return self.target.record

    @property
    def task_id(self) -> str | None:
        return self.target.task_id

    @functools.cached_property
    def final(self) -> dict | None:
        """The terminal state the record keeps of this job (or array task); read once."""
        return records.final_of(self.record, self.task_id)


def told_without_logs(s: JobSources) -> SourceState | None:
    """Sources 1 and 2: the state the scheduler or the record tells; None when the logs must."""
    if s.target.local:
        final = s.final
        return src.from_final(final, []) if final and parse_state(final.get("state")).state.terminal else None
    if s.sched is not None and s.sched.state.state is not JobState.UNKNOWN:
        return s.sched
    final = s.final if s.only is None else None
    if final:
        return src.from_final(final, s.sched.tried if s.sched else s.tried)
    return s.sched  # the scheduler lists it in a state it does not name: that, not the logs


def kept_facts(s: JobSources) -> KeptLogs | None:
    """Source 4: the table's facts of an ended job's logs as its record keeps them, while they
    hold; None: read the logs (a job that runs, no or stale facts)."""
    if s.sched is not None and s.sched.state.state.active:
        return None
    final = s.final
    if not final or "logs" not in final or not parse_state(final.get("state")).state.terminal:
        return None
    return kept.kept_logs(final["logs"], s.target.log_dir)


def _read_logs(s: JobSources, told: SourceState | None, table: bool) -> RunLogs:
    """The logs as the view needs them: the table reads the other ranks' endings only (a running
    Slurm job's recent steps too, for its stall), and rank 0's file alone of a job that completed
    with its elapsed time told (the others' endings tell nothing the row shows)."""
    known = told.state.state if told is not None else None
    running = table and not s.target.local and known is JobState.RUNNING
    clean = known is JobState.COMPLETED and bool(told.elapsed)
    return RunLogs(s.target.log_dir, ends_only=table and not running, window=running, rank0_only=table and clean)


def resolve(s: JobSources, table: bool = False, logs: RunLogs | KeptLogs | None = None) -> "Resolved":
    """The job resolved from its sources in the module's order. ``table``: read only what the
    table's row needs; ``logs``: the kept facts that stand in for the logs (source 4)."""
    told = told_without_logs(s)
    logs = logs or _read_logs(s, told, table)
    notes: list[str] = []
    keep = None
    if told is not None:
        state = told
    elif s.target.local:
        state, keep = src.local_state(s.record, s.task_id, logs, notes, s.now)
    else:
        state = src.from_logs(logs, s.tried, scheduled=True)
    if state.state.state is JobState.RUNNING:  # its stall is judged from every rank's recent steps
        logs.widen()
    return Resolved(s, state, logs, notes, keep)


def table_row(s: JobSources, cache: rowcache.RowCache) -> tuple[JobStatus, dict | None]:
    """(the table's row, the final state to keep in the record): from the kept facts of an
    ended job (4), else the row cache (5) while the row's inputs are unchanged, else resolved
    (and cached when the job ended, unless its record is to keep it: the next table then takes
    the row from the kept facts)."""
    facts = kept_facts(s)
    key = None
    keeps_final = not s.target.local and s.record is not None and bool(s.record.path) and src.scheduler_ended(s.sched)
    if facts is None and not keeps_final:
        key = cache.key(s.target, s.sched, s.only)
        if (row := cache.get(key)) is not None:
            return JobStatus.from_dict(row), None
    r = resolve(s, table=True, logs=facts)
    st = r.row()
    if key is not None:
        cache.put(key, st.to_dict())
    return st, r.final_to_keep()


@dataclass
class Resolved:
    """One job resolved: its sources, the state and the source that told it, its logs (or the
    kept facts standing in for them), the notes so far, and a local job's final state to keep."""

    sources: JobSources
    state: SourceState
    logs: RunLogs | KeptLogs
    notes: list[str] = field(default_factory=list)
    keep: dict | None = None

    def row(self) -> JobStatus:
        """The table's view: who, state, shape, time, progress, stall, and goodput where the row
        read every run of rank 0 (the table reads only the newest run of a job that has several)."""
        logs = self.logs
        g = logs.summary.get("goodput") if isinstance(logs, KeptLogs) else kept.table_goodput(logs)
        return self._status({"goodput": g} if g is not None else {}, self.notes)

    def detail(self, lanes: bool = False) -> JobStatus:
        """The detail view: the row's facts, then the failure, every rank's ending, exit codes,
        the scheduler's history, the runs, restarts, stragglers, staging, flight recorder, the
        picture of the run (with every rank's lane for the page, ``lanes``)."""
        s, logs, sched = self.sources, self.logs, self.state
        base = records.first_restart(s.record)
        inside = alloc_restarts(s.record, s.target.log_dir, logs)
        notes = list(self.notes)   # the judgement's notes are the detail view's
        failure, endings = diagnose(logs, sched, notes, base, inside, s.now)
        codes = {} if sched.state.state is JobState.COMPLETED else logs.srun_exit_codes()
        if not codes and sched.source == src.RECORD:
            codes = {int(r): c for r, c in (s.final or {}).get("rank_exit_codes", {}).items()}
        cur = logs.current_run()
        notes += snapshot_notes(logs)      # memory snapshots that stepped back (status/snapshots.py)
        per_hosts = self._per_rank_hosts()
        flight = []
        if s.target.log_dir:  # NCCL's flight recorder dumps of the current run
            since = cur.started if cur is not None else None
            flight = flightrec.summary(flightrec.dumps(Path(s.target.log_dir), since), ranks_text)
        return self._status(dict(
            last_events=logs.last_events(), failure=failure, exit_code=sched.exit_code, steps=sched.steps,
            rank_exit_codes=codes, scheduler_history=sched.history, history_source=sched.history_source,
            runs=run_causes(logs, logs.runs(), sched, base, inside), rank_endings=rank_endings(logs),
            rank_classification={str(r): e.to_dict() for r, e in endings.items()},
            timing=with_compute(timing.stragglers(*per_hosts), compute_stragglers(*per_hosts)),
            flight=flight, staging=stage_rows(logs), alloc_restarts=inside, tensorboard=logs.tensorboard,
            goodput=_goodput(logs, inside, s.now if sched.state.state.active else None), gpus=gpu.gpus(*per_hosts),
            picture=picture.build(logs, inside, lanes), restored=current_restore(logs, cur)), notes)

    def _status(self, detail: dict, notes: list[str]) -> JobStatus:
        s, logs, sched = self.sources, self.logs, self.state
        rec, cur = s.record, logs.current_run()
        progress = logs.progress(s.now)
        if progress is not None and not sched.state.state.active:
            progress.eta_s = 0.0 if sched.state.state is JobState.COMPLETED else None
        ev = logs.last_eval()
        st = JobStatus(
            id=s.target.id, state=sched.state.label, state_name=sched.state.state.name, source=sched.source,
            tried=sched.tried, **_from_record(rec), **self._shape(cur), device=logs.device(),
            elapsed=self._elapsed(cur),
            time_limit=sched.time_limit or normalize_duration(rec.time_limit if rec is not None else None),
            restarts=max(records.first_restart(rec) + (sched.restarts or 0), cur.restart if cur is not None else 0),
            log_dir=s.target.log_dir, reason=sched.reason, node_list=sched.node_list, progress=progress,
            notes=notes + _read_notes(s.target, logs, sched), overrides=_overrides(s.target),
            eval_metrics=ev.get("metrics") if ev else None, eval_step=ev.get("step") if ev else None,
            **detail)
        if sched.state.state is JobState.RUNNING:
            per_rank, _ = self._per_rank_hosts()
            st.gpu_percent = gpu.gpu_percent(per_rank)   # the GPUs' use now: running jobs only
            if (stall := timing.stall(per_rank, s.now)) is not None:
                stacks, none = timing.silent_stacks(per_rank, stall["ranks"], s.now, stall["threshold_s"])
                st.stall = {**stall, "stacks": stacks, "no_stack": none,
                            "hang": timing.hang(per_rank, stall["ranks"])}
        return st

    def _elapsed(self, cur: RunSummary | None) -> str | None:
        """How long the job has run or ran: the scheduler's (or the record's) word; without one,
        or when the current run was started by an in-allocation restart and the scheduler counts
        less than the allocation's runs took (its clock restarts on a ``--no-kill`` job's
        resize), from the start of the allocation's first run in the logs."""
        sched, active, now = self.state, self.state.state.state.active, self.sources.now
        if cur is None or cur.started is None:
            return sched.elapsed
        first = self._allocation_start(cur)
        if sched.elapsed and first is cur:
            return sched.elapsed
        span = (now if active else (cur.last_time or now)) - first.started
        if sched.elapsed and (duration_seconds(sched.elapsed) or 0) >= span:
            return sched.elapsed
        return format_duration(span)

    def _allocation_start(self, cur: RunSummary) -> RunSummary:
        """The first run of the current allocation: ``cur``, or an earlier run when ``cur`` (and
        the runs before it) were started by in-allocation restarts (restarts.jsonl)."""
        rec, log_dir = self.sources.record, self.sources.target.log_dir
        if isinstance(self.logs, KeptLogs) or cur.restart <= records.first_restart(rec):  # a job's first run
            return cur
        rows = read_restarts(log_dir) or ((rec.alloc_restarts if rec is not None else None) or [])
        inside = {to_int(e.get("restart")) for e in rows}
        if cur.restart not in inside:
            return cur
        runs = {r.restart: r for r in self.logs.runs()}
        first = cur
        while first.restart in inside and (earlier := runs.get(first.restart - 1)) is not None \
                and earlier.started is not None:
            first = earlier
        return first

    def _per_rank_hosts(self) -> tuple[dict[int, list[dict]], dict[int, str | None]]:
        """(rank -> its events of the current run, rank -> its newest host)."""
        restart = self.logs.current_restart()
        per_rank = {r: st.of_restart(restart) for r, st in self.logs.ranks.items()}
        hosts = {r: next((e.get("host") for e in reversed(evs) if e.get("host")), None)
                 for r, evs in per_rank.items()}
        return per_rank, hosts

    def _shape(self, cur: RunSummary | None) -> dict:
        """``nodes``, ``node_range`` and ``gpus_per_node``. A job runs on as many nodes as its
        current run's start event says (an in-allocation restart may have left a node out), else
        as its record asked for (else the scheduler's count). A job submitted with ``--nodes
        MIN-MAX`` (its record keeps MAX and ``min_nodes``) without that event: as the scheduler
        gave it once it started; before that the number is unknown."""
        rec, sched = self.sources.record, self.state
        per = rec.gpus_per_node if rec is not None else None
        nodes, low = (rec.nodes, rec.min_nodes) if rec is not None else (None, None)
        used = kept.start_nodes(self.logs, cur)
        if not low or not nodes:
            return {"nodes": used or nodes or sched.nodes, "gpus_per_node": per}
        got = sched.state.state is not JobState.PENDING and sched.node_list not in (None, "", "None assigned")
        return {"nodes": used if used is not None or not got else sched.nodes, "node_range": f"{low}-{nodes}",
                "gpus_per_node": per}

    def final_to_keep(self) -> dict | None:
        """The final state to keep in the record: a local job's that status saw end (with the
        table's facts of its logs), or the end a Slurm source reported; None: nothing new."""
        s = self.sources
        if s.target.local:
            if self.keep is not None and (summary := kept.summarize(self.logs)) is not None:
                self.keep["logs"] = summary
            return self.keep
        return src.final_to_keep(self.state, self.logs, s.now, s.final)


def _goodput(logs: RunLogs | KeptLogs, restarts: list[dict], end: float | None = None) -> dict | None:
    """The job's goodput from its logs (`judge.goodput`, the restarts' phases where recorded)
    up to ``end`` (a running job: now, so a silence that goes on counts; else its last event);
    None from kept facts, or before a step."""
    g = None if isinstance(logs, KeptLogs) else goodput(logs.ranks, restarts, end=end)
    return g.to_dict() if g is not None else None


def _from_record(rec: JobRecord | None) -> dict:
    """The row's facts that only the record tells (None without a record)."""
    if rec is None:
        return {"name": None, "backend": None, "cwd": None, "submitted_at": None, "command": None}
    return {"name": rec.name, "backend": rec.backend, "cwd": rec.cwd, "submitted_at": rec.submitted_at,
            "command": rec.command}


def _read_notes(t: StatusTarget, logs: RunLogs | KeptLogs, sched: SourceState) -> list[str]:
    """What kept status from reading the logs whole, or at all."""
    notes = []
    if (partial := logs.partial) and not logs.ends_only:  # the table reads the others' ends only
        notes.append(f"the event files of {plural(len(partial), 'rank')} ({compress_ranks(partial)}) are too big "
                     f"to read whole: status read their first {HEAD_BYTES >> 10} KiB and last {logs.tail} lines "
                     "(step times and earlier runs are judged from those)")
    bad = sum(s.bad_lines for s in logs.ranks.values())
    if bad:
        notes.append(f"{plural(bad, 'unreadable line')} in the event streams skipped")
    if t.log_dir and not logs.listed:
        notes.append(f"log directory {t.log_dir} " + (
            "does not exist (yet)" if not sched.state.state.terminal else "is gone; final state from the record"
            if sched.source == src.RECORD else "is gone"))
    return notes


def _overrides(t: StatusTarget) -> list[str] | None:
    """An array task's overrides (its entry in the record's array)."""
    task = t.task_id
    for entry in (t.record.array or []) if task is not None and t.record is not None else []:
        if str(entry.get("task_id")) == task:
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
