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
from typing import Callable, Iterable

from ddp_hpc.judge.consequences import compress as compress_ranks
from ddp_hpc.judge.consequences import ranks_text
from ddp_hpc.judge.tails import follow_logs, log_line, logs_tail, rank_files, render_logs
from ddp_hpc.judge.timing import STALL_FACTOR, STALL_MIN_S
from ddp_hpc.runlogs.schema import RANK_FILE_ROLES, rank_out, text_log
from ddp_hpc.slurm.times import format_duration
from ddp_hpc.status.gpus import gpu_lines
from ddp_hpc.status.job import JobStatus
from ddp_hpc.status.restarts import restart_lines
from ddp_hpc.status.spark import spark_lines, unicode_ok
from ddp_hpc.status.staging import stage_lines
from ddp_hpc.text import fit_columns, plural, prog

__all__ = ["render_table", "render_detail", "failure_lines", "to_json", "files_guide", "watch", "compress_ranks",
           "follow_logs", "log_line", "logs_tail", "rank_files", "render_logs"]

COLUMNS = ("ID", "NAME", "BACKEND", "STATE", "NODESxGPUS", "ELAPSED/LIMIT", "RESTARTS",
           "PROGRESS", "LOSS", "SAMPLES/S", "ETA", "LOG DIR")
#: columns shown only when some job has them, before LOG DIR: final eval metrics, sweep overrides,
#: the mean GPU utilisation of the ranks' newest samples
OPTIONAL = ("EVAL", "OVERRIDES", "GPU%")
CELL_MAX = 40  # characters of an EVAL / OVERRIDES cell
#: shown where some job has it and the terminal has room for it beside the other columns
GOODPUT = "GOODPUT"
#: the parts of the time lost besides useful steps, as the detail view names them (judge.goodput.PARTS)
LOST_NAMES = {"restarts": "restarts", "redone": "steps trained twice", "checkpoint": "checkpoints",
              "data": "data wait", "stalls": "stalls", "eval": "eval", "other": "other"}
#: the columns that give way to fit the terminal, in that order, and their narrowest widths
SHRINK = (("LOG DIR", 16), ("OVERRIDES", 12), ("EVAL", 12), ("NAME", 8), ("STATE", 9))


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def shape_text(st: JobStatus) -> str:
    """``2 nodes x 4 GPUs``, or ``1 node x 2 processes on CPU`` when the run says it used the CPU;
    a node range: ``3 of 2-4 nodes x 4 GPUs`` (``2-4 nodes`` while the number is not known)."""
    per = st.gpus_per_node
    nodes = plural(st.nodes, "node") if not st.node_range else (
        f"{st.nodes} of {st.node_range} nodes" if st.nodes else f"{st.node_range} nodes")
    if st.device == "cpu":
        return f"{nodes} x {plural(per, 'process')} on CPU"
    return f"{nodes} x {plural(per, 'GPU')}"


def progress_text(st: JobStatus) -> str:
    p = st.progress
    if p is None:
        return "-"
    parts = []
    if p.epoch is not None:
        parts.append(f"e{p.epoch}")
    if p.step is not None:
        parts.append(f"s{p.step}" + (f"/{p.total_steps}" if p.total_steps else ""))
    if p.percent is not None:
        parts.append(f"{p.percent:.0f}%")
    return " ".join(parts) or "-"


def state_text(st: JobStatus) -> str:
    """The STATE cell: ``STALLED 00:02:10`` for a running job whose ranks went silent."""
    if st.stall:
        return f"STALLED {format_duration(st.stall['silent_for_s'])}"
    return st.state


def eval_text(st: JobStatus, limit: int = CELL_MAX) -> str:
    """``accuracy=0.91 loss=0.32``: the newest eval event's metrics, or ``-``."""
    m = st.eval_metrics or {}
    return _cut(" ".join(f"{k}={_short(v)}" for k, v in m.items()) or "-", limit)


def overrides_text(st: JobStatus, limit: int = CELL_MAX) -> str:
    return _cut(" ".join(st.overrides or []) or "-", limit)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def goodput_text(st: JobStatus) -> str:
    """``87.3%``: the GOODPUT cell, or ``-``."""
    g = st.goodput
    return f"{100 * g['goodput']:.1f}%" if g and g.get("goodput") is not None else "-"


def table_row(st: JobStatus, optional: tuple[str, ...] = (), goodput: bool = False) -> list[str]:
    p = st.progress
    per = "-" if st.gpus_per_node is None else str(st.gpus_per_node)
    extra = {"EVAL": eval_text, "OVERRIDES": overrides_text,
             "GPU%": lambda s: _num(s.gpu_percent, ".0f")}
    return [
        st.id, st.name or "-", st.backend or "-", state_text(st),
        f"{st.nodes or st.node_range or '-'}x{per}" + ("cpu" if st.device == "cpu" else ""),
        f"{st.elapsed or '-'}/{st.time_limit or '-'}",
        str(st.restarts), *([goodput_text(st)] if goodput else []), progress_text(st),
        _num(p.loss if p else None, ".4g"), _num(p.samples_per_s if p else None, ".1f"),
        (format_duration(p.eta_s) if p and p.eta_s is not None and not st.job_state.terminal else "-"),
    ] + [extra[c](st) for c in optional] + [st.log_dir or "-"]


def render_table(statuses: Iterable[JobStatus], width: int | None = None) -> str:
    """The jobs as a table within ``width`` columns (None: as wide as its cells): the log
    directory gives way first (its middle cut), then overrides, eval metrics, names and states.
    A GOODPUT column (after RESTARTS) where some job has a goodput and the table has room for it
    without cutting any other cell further."""
    statuses = list(statuses)
    optional = tuple(c for c, have in zip(OPTIONAL, (any(s.eval_metrics for s in statuses),
                                                     any(s.overrides for s in statuses),
                                                     any(s.gpu_percent is not None for s in statuses))) if have)
    if any(s.goodput for s in statuses):
        wider = _table(statuses, optional, None, goodput=True)
        if width is None or max(map(len, wider.splitlines())) <= width:
            return wider
    return _table(statuses, optional, width)


def _table(statuses: list[JobStatus], optional: tuple[str, ...], width: int | None, goodput: bool = False) -> str:
    at_restarts = COLUMNS.index("RESTARTS") + 1
    columns = (list(COLUMNS[:at_restarts]) + ([GOODPUT] if goodput else []) + list(COLUMNS[at_restarts:-1])
               + list(optional) + [COLUMNS[-1]])
    rows = [columns] + [table_row(s, optional, goodput) for s in statuses]
    if len(rows) == 1:
        return f"no ddp_hpc jobs recorded (submit one with {prog('submit')})\n"
    at = {c: i for i, c in enumerate(columns)}
    rows = fit_columns(rows, width, [(at[c], n, c == "LOG DIR") for c, n in SHRINK if c in at])
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines) + "\n"


def _ago(t, now) -> str:
    if t is None:
        return "-"
    return f"{format_duration(max(0.0, now - float(t)))} ago"


def _event_text(ev: dict) -> str:
    skip = {"time", "event", "rank", "job_id", "host", "traceback", "restart", "stack"}
    # a field the event leaves unknown (an end event's step or exit code) is left out, not "None"
    extras = " ".join(f"{k}={_short(v)}" for k, v in ev.items() if k not in skip and v is not None)
    return f"{ev.get('event')}" + (f" {extras}" if extras else "")


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    text = json.dumps(v) if isinstance(v, (dict, list)) else str(v)
    return text if len(text) <= 60 else text[:57] + "..."


def files_guide() -> str:
    """Which rank file is which, in one line (printed above ``--logs``)."""
    return "; ".join(f"{name} = {RANK_FILE_ROLES[kind]}"
                     for kind, name in (("log", text_log("{R}")), ("out", rank_out("{R}"))))


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
        out.append("Eval:       " + ", ".join(f"{k}={_short(v)}" for k, v in st.eval_metrics.items()) + at)
    if st.command:
        out.append(f"Command:    {shlex.join(st.command)}")
    if st.overrides:
        out.append(f"Overrides:  {shlex.join(st.overrides)}")
    out.append(f"Log dir:    {st.log_dir or '-'}")
    if st.log_dir:
        out += [f"            {name:<12} {RANK_FILE_ROLES[kind]}"
                for kind, name in (("log", text_log("{R}")), ("out", rank_out("{R}")))]
        if st.tensorboard:
            out.append(f"TensorBoard: tensorboard --logdir {shlex.quote(st.log_dir)}")
    if st.node_list:
        out.append(f"Nodes:      {st.node_list}")
    return out


def goodput_lines(st: JobStatus) -> list[str]:
    """``Goodput:   87.3% of 6 min 52 s since the first step`` and where the rest went."""
    g = st.goodput
    if not g:
        return []
    lost = g.get("lost_s") or {}
    out = [f"Goodput:    {100 * g['goodput']:.1f}% of {g['wall_s']:.1f} s since the first step were useful steps "
           f"({g['useful_s']:.1f} s)"]
    parts = []
    for key, name in LOST_NAMES.items():
        secs = lost.get(key) or 0.0
        if secs < 0.05:
            continue
        text = f"{name} {secs:.1f} s"
        if key == "restarts" and g.get("restart_phases"):
            text += " (" + " + ".join(f"{k} {v:.1f}" for k, v in g["restart_phases"].items()) + ")"
        if key == "redone" and g.get("steps_redone"):
            text += f" ({plural(g['steps_redone'], 'step')})"
        parts.append(text)
    out.append("            lost: " + (", ".join(parts) if parts else "nothing"))
    if g.get("estimated"):
        out.append(f"            estimated: {', '.join(g['estimated'])}")
    return out


def _ending_lines(st: JobStatus) -> list[str]:
    """``Ranks:`` how each rank ended, grouped: ``0-2 killed (SIGTERM); 3 failed (exit 1)``."""
    if not st.rank_endings:
        return []
    groups: dict[str, list[int]] = {}
    for rank, how in sorted(st.rank_endings.items()):
        groups.setdefault(how, []).append(rank)
    return ["Ranks:      " + "; ".join(f"{compress_ranks(r)} {how}" for how, r in groups.items())]


def _exit_lines(st: JobStatus) -> list[str]:
    if not (st.exit_code or st.steps or st.rank_exit_codes):
        return _ending_lines(st)
    out = ["Exit codes: " + (f"job {st.exit_code}" if st.exit_code else "job -")]
    out += [f"            step {s['id']}: {s['state']} {s.get('exit_code') or ''}".rstrip()
            for s in st.steps]
    if st.rank_exit_codes:
        codes = ", ".join(f"rank {r}: {'killed' if c < 0 else c}"
                          for r, c in sorted(st.rank_exit_codes.items()))
        out.append(f"            srun: {codes}")
    return out + _ending_lines(st)


def _stall_lines(st: JobStatus) -> list[str]:
    """Which ranks went silent, for how long, and where they were if they wrote a stack."""
    sl = st.stall
    if not sl:
        return []
    who = ranks_text(sl["ranks"])
    line = f"Stalled:    {who} silent for {format_duration(sl['silent_for_s'])}"
    if sl.get("others_last_s") is not None:
        line += f"; the others last wrote {format_duration(sl['others_last_s'])} ago"
    elif sl.get("behind"):
        steps = {k: v for k, v in sl.get("last_steps", {}).items() if v is not None}
        line += (f"; {ranks_text(sl['behind'])} stopped first (last step "
                 f"{', '.join(str(steps.get(str(r), '-')) for r in sl['behind'])}, the others' "
                 f"{max(steps.values(), default='-')})")
    out = [line, f"            (no event for > {format_duration(sl['threshold_s'])}: max({STALL_FACTOR:g} x "
                 f"the median interval between step events, {sl['median_interval_s']:.3g} s, "
                 f"{STALL_MIN_S:g} s))"]
    if sl.get("hang"):
        out.append(f"            hang: {sl['hang']}")
    out += [f"            rank {r} was in {where}" for r, where in sorted(sl.get("stacks", {}).items(),
                                                                   key=lambda kv: int(kv[0]))]
    if sl.get("no_stack"):
        out.append(f"            {ranks_text(sl['no_stack'])} wrote no stack while the others did: "
                   "frozen (stopped, a hang in the kernel) or gone")
    return out


def failure_lines(st: JobStatus) -> list[str]:
    f = st.failure
    if f is None:
        return []
    head = f.summary
    if not head:  # a Failure made elsewhere (no attribution): today's words
        where = f" on {f.host}" if f.host else ""
        what = f.message if f.exc_type in ("Exited", "Signal") and f.message else \
            ": ".join(x for x in (f.exc_type, f.message) if x)
        head = f"rank {f.rank}{where} (restart {f.restart}, from {f.basis})" + (f": {what}" if what else "")
    out = [f"First failure: {head}"]
    out += [f"    {ranks_text(c['ranks'])}: {c['text']}" for c in f.consequences]
    if f.kind in ("killed", "vanished", "stuck"):
        out.append(f"    how we know: {f.basis} (restart {f.restart})")
    if f.stack and f.stack.get("summary"):
        why = f" ({f.stack['reason']})" if f.stack.get("reason") else ""
        out.append(f"    rank {f.rank} was in {f.stack['summary']}{why}:")
        out += [f"        {ln}" for ln in f.stack.get("lines", [])]
    out += [f"    {ranks_text(p['ranks'])} {'was' if len(p['ranks']) == 1 else 'were'} in {p['summary']}"
            for p in f.peer_stacks]
    return out + [f"    {ln}" for ln in f.traceback_tail]


def _timing_lines(st: JobStatus) -> list[str]:
    lines = (st.timing or {}).get("lines") or []
    return [("Stragglers: " if i == 0 else "            ") + ln for i, ln in enumerate(lines)]


def _event_lines(st: JobStatus, now: float) -> list[str]:
    if not st.last_events:
        return []
    return ["Last event per rank:"] + [
        f"  rank {r:<3} {str(ev.get('host') or '-'):<10} restart {ev.get('restart', 0)}  "
        f"{_ago(ev.get('time'), now):<16} {_event_text(ev)}" for r, ev in sorted(st.last_events.items())]


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
