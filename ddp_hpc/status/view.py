"""Render job statuses: the recent-jobs table, one job's detail page, rank-prefixed log tails.

Every view has a JSON twin (``--json``) with the same facts, so scripts never parse the table.
Pure functions return text; only :func:`follow_logs` and :func:`watch` loop and print.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

from ddp_hpc.runlogs.srun import tail_file
from ddp_hpc.status.collect import JobStatus, fmt_duration

COLUMNS = ("ID", "NAME", "BACKEND", "STATE", "NODESxGPUS", "ELAPSED/LIMIT", "RESTARTS",
           "PROGRESS", "LOSS", "SAMPLES/S", "ETA", "LOG DIR")


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


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


def table_row(st: JobStatus) -> list[str]:
    p = st.progress
    gpus = "-" if st.gpus_per_node is None else str(st.gpus_per_node)
    return [
        st.id, st.name or "-", st.backend or "-", st.state,
        f"{st.nodes or '-'}x{gpus}",
        f"{st.elapsed or '-'}/{st.time_limit or '-'}",
        str(st.restarts), progress_text(st),
        _num(p.loss if p else None, ".4g"), _num(p.samples_per_s if p else None, ".1f"),
        (fmt_duration(p.eta_s) if p and p.eta_s is not None else "-"),
        st.log_dir or "-",
    ]


def render_table(statuses: Iterable[JobStatus]) -> str:
    rows = [list(COLUMNS)] + [table_row(s) for s in statuses]
    if len(rows) == 1:
        return "no ddp_hpc jobs recorded (submit one with python -m ddp_hpc.submit)\n"
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines) + "\n"


def _ago(t, now) -> str:
    if t is None:
        return "-"
    return f"{fmt_duration(max(0.0, now - float(t)))} ago"


def _event_text(ev: dict) -> str:
    skip = {"time", "event", "rank", "job_id", "host", "traceback", "restart"}
    extras = " ".join(f"{k}={_short(v)}" for k, v in ev.items() if k not in skip)
    return f"{ev.get('event')}" + (f" {extras}" if extras else "")


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    text = json.dumps(v) if isinstance(v, (dict, list)) else str(v)
    return text if len(text) <= 60 else text[:57] + "..."


def render_detail(st: JobStatus, now: float | None = None) -> str:
    now = time.time() if now is None else now
    out = []
    shape = f"{st.nodes or '?'} node(s) x {st.gpus_per_node if st.gpus_per_node is not None else '?'} GPU(s)"
    out.append(f"Job {st.id}" + (f" ({st.name})" if st.name else "")
               + (f", backend {st.backend}" if st.backend else "") + f", {shape}")
    out.append(f"State:      {st.state}   [source: {st.source}]"
               + (f"   reason: {st.reason}" if st.reason and st.reason not in ("None",) else ""))
    for t in st.tried:
        out.append(f"            ({t})")
    out.append(f"Elapsed:    {st.elapsed or '-'} / limit {st.time_limit or '-'}   "
               f"restarts: {st.restarts}")
    p = st.progress
    if p is not None:
        bits = [progress_text(st)]
        if p.loss is not None:
            bits.append(f"loss {p.loss:.4g}")
        if p.samples_per_s is not None:
            bits.append(f"{p.samples_per_s:.1f} samples/s")
        if p.eta_s is not None:
            bits.append(f"ETA {fmt_duration(p.eta_s)}")
        bits.append(f"updated {_ago(p.updated, now)}")
        out.append("Progress:   " + ", ".join(bits))
    out.append(f"Log dir:    {st.log_dir or '-'}")
    if st.node_list:
        out.append(f"Nodes:      {st.node_list}")
    if st.exit_code or st.steps or st.rank_exit_codes:
        out.append("Exit codes: " + (f"job {st.exit_code}" if st.exit_code else "job -"))
        for s in st.steps:
            out.append(f"            step {s['id']}: {s['state']} {s.get('exit_code') or ''}".rstrip())
        if st.rank_exit_codes:
            codes = ", ".join(f"rank {r}: {'killed' if c < 0 else c}"
                              for r, c in sorted(st.rank_exit_codes.items()))
            out.append(f"            srun: {codes}")
    f = st.failure
    if f is not None:
        where = f" on {f.host}" if f.host else ""
        what = ": ".join(x for x in (f.exc_type, f.message) if x)
        out.append(f"First failure: rank {f.rank}{where} (restart {f.restart}, from {f.basis})"
                   + (f": {what}" if what else ""))
        for ln in f.traceback_tail:
            out.append(f"    {ln}")
    if st.last_events:
        out.append("Last event per rank:")
        for r, ev in sorted(st.last_events.items()):
            out.append(f"  rank {r:<3} {str(ev.get('host') or '-'):<10} restart {ev.get('restart', 0)}  "
                       f"{_ago(ev.get('time'), now):<16} {_event_text(ev)}")
    if st.scheduler_history:
        out.append(f"Requeue history ({st.history_source}):")
        for i, h in enumerate(st.scheduler_history):
            out.append(f"  run {i}: {h['state']:<12} start {h.get('start') or '-'}  "
                       f"end {h.get('end') or '-'}  exit {h.get('exit_code') or '-'}")
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
                       + (f", {r['errors']} error event(s)" if r["errors"] else ""))
    for n in st.notes:
        out.append(f"Note: {n}")
    return "\n".join(out) + "\n"


def to_json(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n"


_RANK_FILE = re.compile(r"^rank(\d+)\.(log|out)$")


def rank_files(log_dir: str | Path, rank: int | None = None,
               kind: str = "log") -> list[tuple[int, str, Path]]:
    """(rank, kind, path) of the rank files to show, sorted by rank.

    ``kind="log"``: each rank's ``rank{R}.log`` (the training core's text log), or its
    ``rank{R}.out`` when it has no .log (a rank that died before logging anything);
    ``kind="out"``: the ``rank{R}.out`` files (the process's stdout/stderr: Python tracebacks,
    srun and NCCL messages); ``kind="all"``: both.
    """
    d = Path(log_dir)
    if not d.is_dir():
        return []
    found: dict[int, dict[str, Path]] = {}
    for p in d.iterdir():
        m = _RANK_FILE.match(p.name)
        if m and (rank is None or int(m.group(1)) == rank):
            found.setdefault(int(m.group(1)), {})[m.group(2)] = p
    out = []
    for r, files in sorted(found.items()):
        if kind == "all":
            kinds = sorted(files)
        elif kind in files:
            kinds = [kind]
        else:
            kinds = ["out"] if kind == "log" and "out" in files else []
        out.extend((r, k, files[k]) for k in kinds)
    return out


def prefix(rank: int, kind: str) -> str:
    return f"[rank {rank}]" if kind == "log" else f"[rank {rank} {kind}]"


def logs_tail(log_dir, rank: int | None, n: int, kind: str = "log") -> list[dict]:
    """The last ``n`` lines of each rank file, as records {rank, file, line}."""
    out = []
    for r, _, p in rank_files(log_dir, rank, kind):
        for ln in tail_file(p, n):
            out.append({"rank": r, "file": p.name, "line": ln})
    return out


def render_logs(records: list[dict]) -> str:
    return "".join(f"{prefix(x['rank'], x['file'].rsplit('.', 1)[-1])} {x['line']}\n"
                   for x in records)


def follow_logs(log_dir, rank: int | None, n: int, active: Callable[[], bool], as_json: bool,
                write=None, interval: float = 0.5, sleep=time.sleep, kind: str = "log") -> None:
    """Print the tails, then new lines as they arrive (files that appear later included), until
    the job is no longer active and everything written has been shown (or Ctrl-C)."""
    write = write or (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    emit = (lambda rec: write(json.dumps(rec) + "\n")) if as_json else (
        lambda rec: write(render_logs([rec])))
    for rec in logs_tail(log_dir, rank, n, kind):
        emit(rec)
    offsets = {p: p.stat().st_size for _, _, p in rank_files(log_dir, rank, kind)}
    partial: dict[Path, str] = {}
    try:
        while True:
            still = active()
            for r, _, p in rank_files(log_dir, rank, kind):
                pos = offsets.get(p, 0)
                try:
                    size = p.stat().st_size
                    if size < pos:  # truncated or replaced: start over
                        pos = 0
                    with open(p, "rb") as f:
                        f.seek(pos)
                        data = f.read()
                except OSError:
                    continue
                offsets[p] = pos + len(data)
                text = partial.pop(p, "") + data.decode("utf-8", errors="replace")
                lines = text.split("\n")
                if lines[-1]:
                    partial[p] = lines[-1]
                for ln in lines[:-1]:
                    emit({"rank": r, "file": p.name, "line": ln})
            if not still:
                for p, rest in partial.items():
                    m = _RANK_FILE.match(p.name)
                    emit({"rank": int(m.group(1)), "file": p.name, "line": rest})
                return
            sleep(interval)
    except KeyboardInterrupt:
        return


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
