"""Render job statuses: the recent-jobs table, one job's detail page, rank-prefixed log tails.

Every view has a JSON twin (``--json``) with the same facts, so scripts never parse the table.
Pure functions return text; only :func:`follow_logs` (``ddp_hpc.judge.tails``) and
:func:`watch` loop and print.
"""
from __future__ import annotations

import json
import os
import shlex
import sys
import time
from typing import Callable

from ddp_hpc.exits import signal_name, signal_of_exit_status, signal_text
from ddp_hpc.judge.consequences import compress as compress_ranks
from ddp_hpc.judge.consequences import failure_lines as judge_failure_lines
from ddp_hpc.judge.consequences import ranks_text
from ddp_hpc.judge.goodput import PART_NAMES
from ddp_hpc.judge.gpu import gpu_lines
from ddp_hpc.judge.restarts import restart_lines
from ddp_hpc.judge.tails import follow_logs, log_line, logs_tail, rank_files, render_logs
from ddp_hpc.judge.timing import STALL_FACTOR, STALL_MIN_S
from ddp_hpc.runlogs.schema import RANK_FILE_ROLES, rank_out, text_log
from ddp_hpc.slurm.times import format_duration
from ddp_hpc.status.job import JobStatus
from ddp_hpc.status.spark import spark_lines, unicode_ok
from ddp_hpc.status.staging import stage_lines
from ddp_hpc.status.table import progress_text, render_table, short, state_text
from ddp_hpc.text import plural

__all__ = ["render_table", "render_detail", "failure_lines", "to_json", "files_guide", "watch", "compress_ranks",
           "follow_logs", "log_line", "logs_tail", "rank_files", "render_logs", "exit_words", "progress_text",
           "state_text"]

def shape_text(st: JobStatus) -> str:
    """``2 nodes x 4 GPUs``, or ``1 node x 2 processes on CPU`` when the run says it used the CPU;
    a node range: ``3 of 2-4 nodes x 4 GPUs`` (``2-4 nodes`` while the number is not known)."""
    per = st.gpus_per_node
    nodes = plural(st.nodes, "node") if not st.node_range else (
        f"{st.nodes} of {st.node_range} nodes" if st.nodes else f"{st.node_range} nodes")
    if st.device == "cpu":
        return f"{nodes} x {plural(per, 'process')} on CPU"
    return f"{nodes} x {plural(per, 'GPU')}"


def _ago(t, now) -> str:
    if t is None:
        return "-"
    return f"{format_duration(max(0.0, now - float(t)))} ago"


def _event_text(ev: dict) -> str:
    skip = {"time", "event", "rank", "job_id", "host", "traceback", "restart", "stack"}
    # a field the event leaves unknown (an end event's step or exit code) is left out, not "None"
    extras = " ".join(f"{k}={short(v)}" for k, v in ev.items() if k not in skip and v is not None)
    return f"{ev.get('event')}" + (f" {extras}" if extras else "")


#: a script job's rank files (`JobStatus.script`): the prints and tracebacks are in rank*.out,
#: the log holds only the exec wrapper's start and end lines
SCRIPT_FILE_ROLES = {"out": "your script's output: prints and tracebacks, read it first",
                     "log": "ddp_hpc's notes (exec: lines)"}


def file_roles(script: bool = False) -> list[tuple[str, str]]:
    """(file name, what it holds) of a rank's text files, the one to read first first: the
    training log of ddp_hpc's own loop, a script's own output (``rank{R}.out``) for a script."""
    if script:
        return [(rank_out("{R}"), SCRIPT_FILE_ROLES["out"]), (text_log("{R}"), SCRIPT_FILE_ROLES["log"])]
    return [(text_log("{R}"), RANK_FILE_ROLES["log"]), (rank_out("{R}"), RANK_FILE_ROLES["out"])]


def files_guide(script: bool = False) -> str:
    """Which rank file is which, in one line (printed above ``--logs``)."""
    return "; ".join(f"{name} = {role}" for name, role in file_roles(script))


def render_detail(st: JobStatus, now: float | None = None, unicode: bool | None = None) -> str:
    """One job's detail page; ``unicode``: draw the sparklines in Unicode blocks (None: if stdout
    takes UTF-8)."""
    now = time.time() if now is None else now
    out = _head_lines(st, now) + spark_lines(st.picture, unicode_ok() if unicode is None else unicode)
    out += goodput_lines(st) + stage_lines(st.staging) + _exit_lines(st) + failure_lines(st)
    out += restart_lines(st.alloc_restarts) + ([f"Restored:   {st.restored.removeprefix('restored ')}"]
                                               if st.restored else [])
    out += _timing_lines(st) + gpu_lines(st.gpus)
    out += [("Flight rec: " if i == 0 else "            ") + ln for i, ln in enumerate(st.flight)]
    out += _event_lines(st, now) + _history_lines(st) + [f"Note: {n}" for n in st.notes]
    return "\n".join(out) + "\n"


def _head_lines(st: JobStatus, now: float) -> list[str]:
    """Who the job is, its state and where that came from, time, progress, where its logs are."""
    out = [f"Job {st.id}" + (f" ({st.name})" if st.name else "")
           + (f", backend {st.backend}" if st.backend else "") + f", {shape_text(st)}",
           f"State:      {st.state}" + (f", {state_text(st)}" if st.stall else "") + f"   [source: {st.source}]"
           + (f"   reason: {st.reason}" if st.reason and st.reason not in ("None",) else "")]
    out += [f"            ({t})" for t in st.tried]
    out += _stall_lines(st)
    out.append(f"Elapsed:    {st.elapsed or '-'} / limit {st.time_limit or '-'}   "
               f"restarts: {st.restarts}")
    p = st.progress
    if p is not None:
        bits = [progress_text(st)]
        if p.loss is not None:
            bits.append(f"loss {p.loss:.4g}")
        if p.samples_per_s is not None:
            bits.append(f"{p.samples_per_s:.1f} samples/s")
        if p.steps_per_s is not None:
            bits.append(f"{p.steps_per_s:.3g} steps/s")
        if p.eta_s is not None and not st.job_state.terminal:  # an ended job has none left
            bits.append(f"ETA {format_duration(p.eta_s)}")
        bits.append(f"updated {_ago(p.updated, now)}")
        out.append("Progress:   " + ", ".join(bits))
    if st.eval_metrics:
        at = f" (step {st.eval_step})" if st.eval_step is not None else ""
        out.append("Eval:       " + ", ".join(f"{k}={short(v)}" for k, v in st.eval_metrics.items()) + at)
    if st.command:
        out.append(f"Command:    {shlex.join(st.command)}")
    if st.overrides:
        out.append(f"Overrides:  {shlex.join(st.overrides)}")
    out.append(f"Log dir:    {st.log_dir or '-'}")
    if st.log_dir:
        out += [f"            {name:<12} {role}" for name, role in file_roles(st.script)]
        if st.tensorboard:
            out.append(f"TensorBoard: tensorboard --logdir {shlex.quote(st.log_dir)}")
    if st.node_list:
        out.append(f"Nodes:      {st.node_list}")
    return out


def goodput_lines(st: JobStatus) -> list[str]:
    """``Goodput:   87.3% of 6 min 52 s since the first step`` and where the rest went."""
    g = st.goodput
    if g is None:
        return []
    out = [f"Goodput:    {100 * g.goodput:.1f}% of {g.wall_s:.1f} s since the first step were useful steps "
           f"({g.useful_s:.1f} s)"]
    parts = []
    for key, name in PART_NAMES.items():
        secs = g.lost_s.get(key) or 0.0
        if secs < 0.05:
            continue
        text = f"{name} {secs:.1f} s"
        if key == "restarts" and g.restart_phases:
            text += " (" + " + ".join(f"{k} {v:.1f}" for k, v in g.restart_phases.items()) + ")"
        if key == "redone" and g.steps_redone:
            text += f" ({plural(g.steps_redone, 'step')})"
        parts.append(text)
    out.append("            lost: " + (", ".join(parts) if parts else "nothing"))
    if g.estimated:
        out.append(f"            estimated: {', '.join(g.estimated)}")
    return out


def _ending_lines(st: JobStatus) -> list[str]:
    """``Ranks:`` how each rank ended, grouped: ``0-2 killed (SIGTERM); 3 failed (exit 1)``."""
    if not st.rank_endings:
        return []
    groups: dict[str, list[int]] = {}
    for rank, how in sorted(st.rank_endings.items()):
        groups.setdefault(how, []).append(rank)
    return ["Ranks:      " + "; ".join(f"{compress_ranks(r)} {how}" for how, r in groups.items())]


def exit_words(code: str | None) -> str:
    """Slurm's ``N:S`` (exit status : the signal that ended it) in words: ``1:0`` -> ``exit
    status 1``, ``0:9`` -> ``killed by signal 9 (SIGKILL)``, ``137:0`` -> ``exit status 137
    (128 + 9: killed by SIGKILL)``; anything else as it is (``--json`` keeps the raw form)."""
    try:
        status, sig = (int(x) for x in str(code).split(":"))
    except ValueError:
        return str(code or "-")
    if sig:
        return f"killed by {signal_text(sig)}"
    by = signal_of_exit_status(status)
    return f"exit status {status}" + (f" (128 + {by}: killed by {signal_name(by)})" if by and by < 65 else "")


def _exit_lines(st: JobStatus) -> list[str]:
    if not (st.exit_code or st.steps or st.rank_exit_codes):
        return _ending_lines(st)
    out = ["Exit:       " + (exit_words(st.exit_code) if st.exit_code else "-")]
    out += [f"            step {s['id']}: {s['state']}"
            + (f", {exit_words(s['exit_code'])}" if s.get("exit_code") else "") for s in st.steps]
    if st.rank_exit_codes:
        codes = ", ".join(f"rank {r}: {'killed' if c < 0 else c}"
                          for r, c in sorted(st.rank_exit_codes.items()))
        out.append(f"            srun: {codes}")
    return out + _ending_lines(st)


def _stall_lines(st: JobStatus) -> list[str]:
    """Which ranks went silent, for how long, and where they were if they wrote a stack."""
    sl = st.stall
    if sl is None:
        return []
    who = ranks_text(sl.ranks)
    line = f"Stalled:    {who} silent for {format_duration(sl.silent_for_s)}"
    if sl.others_last_s is not None:
        line += f"; the others last wrote {format_duration(sl.others_last_s)} ago"
    elif sl.behind:
        steps = {k: v for k, v in sl.last_steps.items() if v is not None}
        line += (f"; {ranks_text(sl.behind)} stopped first (last step "
                 f"{', '.join(str(steps.get(str(r), '-')) for r in sl.behind)}, the others' "
                 f"{max(steps.values(), default='-')})")
    out = [line, f"            (no event for > {format_duration(sl.threshold_s)}: max({STALL_FACTOR:g} x "
                 f"the median interval between step events, {sl.median_interval_s:.3g} s, "
                 f"{STALL_MIN_S:g} s))"]
    if sl.hang:
        out.append(f"            hang: {sl.hang}")
    out += [f"            rank {r} was in {where}" for r, where in sorted(sl.stacks.items(), key=lambda kv: int(kv[0]))]
    if sl.no_stack:
        out.append(f"            {ranks_text(sl.no_stack)} wrote no stack while the others did: "
                   "frozen (stopped, a hang in the kernel) or gone")
    return out


def failure_lines(st: JobStatus) -> list[str]:
    """The first failure in words (`ddp_hpc.judge.consequences.failure_lines`, which
    ``submit --wait`` prints too)."""
    return [] if st.failure is None else judge_failure_lines(st.failure)


def _timing_lines(st: JobStatus) -> list[str]:
    lines = st.timing.lines if st.timing is not None else []
    return [("Stragglers: " if i == 0 else "            ") + ln for i, ln in enumerate(lines)]


#: beyond this many ranks the last events are grouped: ranks at the same restart, event and step
#: share a line (the odd ones out first), at most EVENT_GROUPS lines; ``--json`` keeps every rank's
EVENT_RANKS = 64
EVENT_GROUPS = 24


def _event_lines(st: JobStatus, now: float) -> list[str]:
    if not st.last_events:
        return []
    if len(st.last_events) > EVENT_RANKS:
        return _grouped_event_lines(st.last_events, now)
    return ["Last event per rank:"] + [_rank_event_line(r, ev, now) for r, ev in sorted(st.last_events.items())]


def _rank_event_line(rank: int, ev: dict, now: float) -> str:
    return (f"  rank {rank:<3} {str(ev.get('host') or '-'):<10} restart {ev.get('restart', 0)}  "
            f"{_ago(ev.get('time'), now):<16} {_event_text(ev)}")


def _grouped_event_lines(last: dict[int, dict], now: float) -> list[str]:
    """The last events of many ranks, one line per (restart, event, step), the smallest groups
    (the ranks that differ) first."""
    groups: dict[tuple, list[int]] = {}
    for r, ev in last.items():
        groups.setdefault((ev.get("restart", 0), str(ev.get("event")), ev.get("step")), []).append(r)
    order = sorted(groups.items(), key=lambda kv: (len(kv[1]), min(kv[1])))
    out = [f"Last event per rank ({plural(len(last), 'rank')}, alike ones on one line):"]
    for (restart, event, step), ranks in order[:EVENT_GROUPS]:
        times = [t for r in ranks if (t := last[r].get("time")) is not None]
        hosts = {last[r].get("host") for r in ranks}
        if len(ranks) == 1:
            out.append(_rank_event_line(ranks[0], last[ranks[0]], now))
            continue
        ago = _ago(max(times), now) if times else "-"
        if times and format_duration(now - min(times)) != format_duration(now - max(times)):
            ago = f"{format_duration(max(0.0, now - max(times)))}-{_ago(min(times), now)}"
        out.append(f"  ranks {compress_ranks(sorted(ranks))} ({len(ranks)}) on {plural(len(hosts), 'host')}  "
                   f"restart {restart}  {ago}  " + (f"step {step}" if event == "step" else event + (
                       f" at step {step}" if step is not None else "")))
    if len(order) > EVENT_GROUPS:
        rest = sum(len(r) for _, r in order[EVENT_GROUPS:])
        out.append(f"  ... {plural(rest, 'more rank')} in {len(order) - EVENT_GROUPS} more groups "
                   "(status --json has every rank's)")
    return out


def _history_lines(st: JobStatus) -> list[str]:
    """The scheduler's runs of a requeued job, then what each run did by its events."""
    out = []
    if st.scheduler_history:
        out.append(f"Requeue history ({st.history_source}):")
        out += [f"  run {i}: {h['state']:<12} start {h.get('start') or '-'}  "
                f"end {h.get('end') or '-'}  exit {h.get('exit_code') or '-'}"
                for i, h in enumerate(st.scheduler_history)]
    if st.runs and (len(st.runs) > 1 or st.restarts):
        out.append("Runs in the event logs:")
        for r in st.runs:
            how = r["end_status"] or "no end event"
            if r["preempt_reason"]:
                how += f" ({r['preempt_reason']})"
            if r["requeued"]:
                how += ", requeue requested"
            out.append(f"  restart {r['restart']}: ranks {len(r['ranks'])}, last step "
                       f"{r['last_step'] if r['last_step'] is not None else '-'}, {how}"
                       + (f", {plural(r['errors'], 'error event')}" if r["errors"] else "")
                       + (f"; first failure: {r['cause']}" if r.get("cause") else ""))
    return out


def to_json(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n"


def watch(render: Callable[[], str], interval: float, count: int | None, write=None,
          sleep=time.sleep, header: bool = True) -> None:
    """Redraw ``render()`` every ``interval`` seconds (clearing a terminal), ``count`` times or
    until Ctrl-C. Without ``header`` (JSON) each refresh is just the document."""
    write = write or (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    tty = sys.stdout.isatty() and os.environ.get("TERM") != "dumb"
    i = 0
    try:
        while count is None or i < count:
            text = render()
            if tty and header:
                write("\033[H\033[2J")
            if header:
                text = f"-- {time.strftime('%H:%M:%S')} (every {interval:g}s, Ctrl-C to stop)\n" + text
            write(text)
            i += 1
            if count is None or i < count:
                sleep(interval)
    except KeyboardInterrupt:
        return
