"""A job resolved from its sources (`resolve`) and put together as the views show it: the
table's row (`Resolved.row`) and the detail view (`Resolved.detail`: the failure and every rank's
ending, exit codes, the scheduler's history, the runs, restarts, stragglers, staging, the flight
recorder, goodput, GPUs, the picture).

The state itself is decided by `ddp_hpc.judge.decide`, the one place that does, in the order it
documents (the backend's description, the record's final state, the run logs); `resolve` reads
the logs as the view needs them and asks it. The row's facts (progress, loss, device, eval
metrics, how the newest run ended) always come from the logs, or for the table from the kept
facts standing in for them (`ddp_hpc.status.rowcache`); what is assembled here decides nothing
about the state. A job whose end a Slurm source reported, or a job without a scheduler whose
processes status found gone, also gives the final state to keep in its record
(`Resolved.final_to_keep`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from ddp_hpc import records
from ddp_hpc.judge import decide, flightrec, gpu, kept, picture, timing
from ddp_hpc.judge.compute import compute_stragglers, with_compute
from ddp_hpc.judge.consequences import compress as compress_ranks
from ddp_hpc.judge.consequences import ranks_text
from ddp_hpc.judge.goodput import Goodput, goodput
from ddp_hpc.judge.kept import KeptLogs
from ddp_hpc.judge.reader import RunLogs, RunSummary
from ddp_hpc.judge.restarts import alloc_restarts, current_restore, read_restarts, standby_lines
from ddp_hpc.judge.tails import HEAD_BYTES
from ddp_hpc.parsing import to_int
from ddp_hpc.records import JobRecord
from ddp_hpc.slurm.query import SourceState
from ddp_hpc.slurm.states import JobState
from ddp_hpc.slurm.times import duration_seconds, format_duration, normalize_duration
from ddp_hpc.status.diagnose import diagnose, run_causes
from ddp_hpc.status.job import JobStatus
from ddp_hpc.status.snapshots import snapshot_notes
from ddp_hpc.status.staging import stage_rows
from ddp_hpc.status.targets import JobSources, StatusTarget
from ddp_hpc.text import plural

__all__ = ["Resolved", "resolve", "told_without_logs", "rank_endings"]


def told_without_logs(s: JobSources) -> SourceState | None:
    """Sources 1 and 2 (`decide.told`): the state the scheduler or the record tells; None when
    the logs must."""
    return decide.told(s.described, s.final, s.only)


def _read_logs(s: JobSources, told: SourceState | None, table: bool) -> RunLogs:
    """The logs as the view needs them: the table reads the other ranks' endings only (a running
    Slurm job's recent steps too, for its stall), and rank 0's file alone of a job that completed
    with its elapsed time told (the others' endings tell nothing the row shows)."""
    known = told.info.job_state if told is not None else None
    running = table and s.described.scheduled and known is JobState.RUNNING
    clean = known is JobState.COMPLETED and bool(told.elapsed)
    return RunLogs(s.target.log_dir, ends_only=table and not running, window=running, rank0_only=table and clean)


def resolve(s: JobSources, table: bool = False, logs: RunLogs | KeptLogs | None = None) -> Resolved:
    """The job resolved from its sources in the module's order. ``table``: read only what the
    table's row needs; ``logs``: the kept facts that stand in for the logs (source 4)."""
    told = told_without_logs(s)
    logs = logs or _read_logs(s, told, table)
    rec = s.record
    decision = decide.decide(s.described, s.final, logs, only=s.only, task_id=s.task_id,
                             submitted_at=rec.submitted_at if rec is not None else None, now=s.now)
    state = decision.state
    if state.info.job_state is JobState.RUNNING:  # its stall is judged from every rank's recent steps
        logs.widen()
    return Resolved(s, state, logs, list(s.described.notes), decision.keep)


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
        if isinstance(logs, KeptLogs):   # the record keeps it as status --json shows it
            g = Goodput.from_dict(d) if (d := logs.summary.get("goodput")) is not None else None
        else:
            g = kept.table_goodput(logs)
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
        codes = {} if sched.info.job_state is JobState.COMPLETED else logs.srun_exit_codes()
        if not codes and sched.source == decide.RECORD:
            codes = {int(r): c for r, c in (s.final or {}).get("rank_exit_codes", {}).items()}
        cur = logs.current_run()
        notes += snapshot_notes(logs)      # memory snapshots that stepped back (status/snapshots.py)
        notes += standby_lines(s.target.log_dir)   # a warm standby that stepped back (judge/restarts.py)
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
            goodput=_goodput(logs, inside, s.now if sched.info.job_state.active else None), gpus=gpu.gpus(*per_hosts),
            picture=picture.build(logs, inside, lanes), restored=current_restore(logs, cur)), notes)

    def _status(self, detail: dict, notes: list[str]) -> JobStatus:
        s, logs, sched = self.sources, self.logs, self.state
        rec, cur = s.record, logs.current_run()
        progress = logs.progress(s.now)
        if progress is not None and not sched.info.job_state.active:
            progress.eta_s = 0.0 if sched.info.job_state is JobState.COMPLETED else None
        ev = logs.last_eval()
        st = JobStatus(
            id=s.target.id, state=sched.info.label, state_name=sched.info.job_state.name, source=sched.source,
            tried=sched.tried, **_from_record(rec), **self._shape(cur), device=logs.device(),
            elapsed=self._elapsed(cur),
            time_limit=sched.time_limit or normalize_duration(rec.time_limit if rec is not None else None),
            restarts=max(records.first_restart(rec) + (sched.restarts or 0), cur.restart if cur is not None else 0),
            log_dir=s.target.log_dir, reason=sched.reason, node_list=sched.node_list, progress=progress,
            notes=notes + _read_notes(s.target, logs, sched), overrides=_overrides(s.target),
            eval_metrics=ev.get("metrics") if ev else None, eval_step=ev.get("step") if ev else None,
            **detail)
        if sched.info.job_state is JobState.RUNNING:
            per_rank, _ = self._per_rank_hosts()
            st.gpu_percent = gpu.gpu_percent(per_rank)   # the GPUs' use now: running jobs only
            if (stall := timing.stall(per_rank, s.now)) is not None:
                stacks, none = timing.silent_stacks(per_rank, stall.ranks, s.now, stall.threshold_s)
                st.stall = dataclasses.replace(stall, stacks=stacks, no_stack=none,
                                               hang=timing.hang(per_rank, stall.ranks))
        return st

    def _elapsed(self, cur: RunSummary | None) -> str | None:
        """How long the job has run or ran: the scheduler's (or the record's) word; without one,
        or when the current run was started by an in-allocation restart and the scheduler counts
        less than the allocation's runs took (its clock restarts on a ``--no-kill`` job's
        resize), from the start of the allocation's first run in the logs."""
        sched, active, now = self.state, self.state.info.job_state.active, self.sources.now
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
        got = sched.info.job_state is not JobState.PENDING and sched.node_list not in (None, "", "None assigned")
        return {"nodes": used if used is not None or not got else sched.nodes, "node_range": f"{low}-{nodes}",
                "gpus_per_node": per}

    def final_to_keep(self) -> dict | None:
        """The final state to keep in the record: a local job's that status saw end (with the
        table's facts of its logs), or the end a Slurm source reported; None: nothing new."""
        s = self.sources
        if not s.described.scheduled:
            if self.keep is not None and (summary := kept.summarize(self.logs)) is not None:
                self.keep["logs"] = summary
            return self.keep
        return kept.final_to_keep(self.state, self.logs, s.now, s.final)


def _goodput(logs: RunLogs | KeptLogs, restarts: list[dict], end: float | None = None) -> Goodput | None:
    """The job's goodput from its logs (`judge.goodput`, the restarts' phases where recorded)
    up to ``end`` (a running job: now, so a silence that goes on counts; else its last event),
    rounded as ``status --json`` shows it; None from kept facts, or before a step."""
    g = None if isinstance(logs, KeptLogs) else goodput(logs.ranks, restarts, end=end)
    return g.rounded() if g is not None else None


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
            "does not exist (yet)" if not sched.info.job_state.terminal else "is gone; final state from the record"
            if sched.source == decide.RECORD else "is gone"))
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
