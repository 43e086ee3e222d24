"""Render job statuses: the recent-jobs table, one job's detail page, rank-prefixed log tails.

Every view has a JSON twin (``--json``) with the same facts, so scripts never parse the table.
Pure functions return text; only :func:`follow_logs` and :func:`watch` loop and print.
"""
from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

from ddp_hpc import cli as ddp_cli
from ddp_hpc.runlogs.schema import LOG_RE, OUT_RE, RANK_FILE_ROLES, rank_out, text_log
from ddp_hpc.runlogs.srun import tail_file
from ddp_hpc.slurm.times import format_duration
from ddp_hpc.status.collect import JobStatus

COLUMNS = ("ID", "NAME", "BACKEND", "STATE", "NODESxGPUS", "ELAPSED/LIMIT", "RESTARTS",
           "PROGRESS", "LOSS", "SAMPLES/S", "ETA", "LOG DIR")


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def shape_text(st: JobStatus) -> str:
    """``2 nodes x 4 GPUs``, or ``1 node x 2 processes on CPU`` when the run says it used the CPU."""
    per = st.gpus_per_node
    if st.device == "cpu":
        return f"{ddp_cli.plural(st.nodes, 'node')} x {ddp_cli.plural(per, 'process')} on CPU"
    return f"{ddp_cli.plural(st.nodes, 'node')} x {ddp_cli.plural(per, 'GPU')}"


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
    per = "-" if st.gpus_per_node is None else str(st.gpus_per_node)
    return [
        st.id, st.name or "-", st.backend or "-", st.state,
        f"{st.nodes or '-'}x{per}" + ("cpu" if st.device == "cpu" else ""),
        f"{st.elapsed or '-'}/{st.time_limit or '-'}",
        str(st.restarts), progress_text(st),
        _num(p.loss if p else None, ".4g"), _num(p.samples_per_s if p else None, ".1f"),
        (format_duration(p.eta_s) if p and p.eta_s is not None else "-"),
        st.log_dir or "-",
    ]


def render_table(statuses: Iterable[JobStatus]) -> str:
    rows = [list(COLUMNS)] + [table_row(s) for s in statuses]
    if len(rows) == 1:
        return f"no ddp_hpc jobs recorded (submit one with {ddp_cli.prog('submit')})\n"
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines) + "\n"


def _ago(t, now) -> str:
    if t is None:
        return "-"
    return f"{format_duration(max(0.0, now - float(t)))} ago"


def _event_text(ev: dict) -> str:
    skip = {"time", "event", "rank", "job_id", "host", "traceback", "restart"}
    extras = " ".join(f"{k}={_short(v)}" for k, v in ev.items() if k not in skip)
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


def render_detail(st: JobStatus, now: float | None = None) -> str:
    now = time.time() if now is None else now
    out = _head_lines(st, now) + _exit_lines(st) + _failure_lines(st) + _event_lines(st, now)
    out += _history_lines(st) + [f"Note: {n}" for n in st.notes]
    return "\n".join(out) + "\n"


def _head_lines(st: JobStatus, now: float) -> list[str]:
    """Who the job is, its state and where that came from, time, progress, where its logs are."""
    out = [f"Job {st.id}" + (f" ({st.name})" if st.name else "")
           + (f", backend {st.backend}" if st.backend else "") + f", {shape_text(st)}",
           f"State:      {st.state}   [source: {st.source}]"
           + (f"   reason: {st.reason}" if st.reason and st.reason not in ("None",) else "")]
    out += [f"            ({t})" for t in st.tried]
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
            bits.append(f"ETA {format_duration(p.eta_s)}")
        bits.append(f"updated {_ago(p.updated, now)}")
        out.append("Progress:   " + ", ".join(bits))
    if st.command:
        out.append(f"Command:    {shlex.join(st.command)}")
    out.append(f"Log dir:    {st.log_dir or '-'}")
    if st.log_dir:
        out += [f"            {name:<12} {RANK_FILE_ROLES[kind]}"
                for kind, name in (("log", text_log("{R}")), ("out", rank_out("{R}")))]
    if st.node_list:
        out.append(f"Nodes:      {st.node_list}")
    return out


def _ending_lines(st: JobStatus) -> list[str]:
    """``Ranks:`` how each rank ended, grouped: ``0-2 killed (SIGTERM); 3 failed (exit 1)``."""
    if not st.rank_endings:
        return []
    groups: dict[str, list[int]] = {}
    for rank, how in sorted(st.rank_endings.items()):
        groups.setdefault(how, []).append(rank)
    return ["Ranks:      " + "; ".join(f"{compress_ranks(r)} {how}" for how, r in groups.items())]


def compress_ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    out, start = [], None
    for i, r in enumerate(ranks):
        start = r if start is None else start
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(r) if start == r else f"{start}-{r}")
            start = None
    return ",".join(out)


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


def _failure_lines(st: JobStatus) -> list[str]:
    f = st.failure
    if f is None:
        return []
    where = f" on {f.host}" if f.host else ""
    what = ": ".join(x for x in (f.exc_type, f.message) if x)
    return [f"First failure: rank {f.rank}{where} (restart {f.restart}, from {f.basis})"
            + (f": {what}" if what else "")] + [f"    {ln}" for ln in f.traceback_tail]


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
                       + (f", {ddp_cli.plural(r['errors'], 'error event')}" if r["errors"] else ""))
    return out


def to_json(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n"


def _rank_kind(name: str) -> tuple[int, str] | None:
    """(rank, "log" | "out") for a rank's text log or raw output file name, else None."""
    for kind, pattern in (("log", LOG_RE), ("out", OUT_RE)):
        if m := pattern.match(name):
            return int(m.group(1)), kind
    return None


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
        rk = _rank_kind(p.name)
        if rk and (rank is None or rk[0] == rank):
            found.setdefault(rk[0], {})[rk[1]] = p
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


def logs_tail(log_dir, rank: int | None, n: int, kind: str = "log") -> list[dict]:
    """The last ``n`` lines of each rank file, as records {rank, file, line}."""
    out = []
    for r, _, p in rank_files(log_dir, rank, kind):
        for ln in tail_file(p, n):
            out.append({"rank": r, "file": p.name, "line": ln})
    return out


def log_line(rec: dict) -> str:
    """One record as ``[rank R] line`` (``[rank R out] line`` for raw output). The training log's
    own lines already name their rank after the time stamp: that tag is dropped, not repeated."""
    r, line = rec["rank"], rec["line"]
    if (_rank_kind(rec["file"]) or (r, "out"))[1] == "out":
        return f"[rank {r} out] {line}"
    return f"[rank {r}] " + line.replace(f"[rank {r}] ", "", 1)


def render_logs(records: list[dict]) -> str:
    return "".join(log_line(x) + "\n" for x in records)


def follow_logs(log_dir, rank: int | None, n: int, active: Callable[[], bool], as_json: bool,
                write=None, interval: float = 0.5, sleep=time.sleep, kind: str = "log") -> None:
    """Print the tails, then new lines as they arrive (files that appear later included), until
    the job is no longer active and everything written has been shown (or Ctrl-C)."""
    write = write or (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    emit = (lambda rec: write(json.dumps(rec) + "\n")) if as_json else (
        lambda rec: write(log_line(rec) + "\n"))
    for rec in logs_tail(log_dir, rank, n, kind):
        emit(rec)
    offsets = {p: p.stat().st_size for _, _, p in rank_files(log_dir, rank, kind)}
    partial: dict[Path, tuple[int, str]] = {}  # path -> (rank, its unfinished last line)
    try:
        while True:
            still = active()
            for r, _, p in rank_files(log_dir, rank, kind):
                data = _read_from(p, offsets)
                if data is None:
                    continue
                lines = (partial.pop(p, (r, ""))[1] + data).split("\n")
                if lines[-1]:
                    partial[p] = (r, lines[-1])
                for ln in lines[:-1]:
                    emit({"rank": r, "file": p.name, "line": ln})
            if not still:
                for p, (r, rest) in partial.items():
                    emit({"rank": r, "file": p.name, "line": rest})
                return
            sleep(interval)
    except KeyboardInterrupt:
        return


def _read_from(p: Path, offsets: dict[Path, int]) -> str | None:
    """What was appended to ``p`` since ``offsets[p]`` (from the start when it shrank), and move
    the offset; None when it cannot be read."""
    pos = offsets.get(p, 0)
    try:
        if p.stat().st_size < pos:  # truncated or replaced: start over
            pos = 0
        with open(p, "rb") as f:
            f.seek(pos)
            data = f.read()
    except OSError:
        return None
    offsets[p] = pos + len(data)
    return data.decode("utf-8", errors="replace")


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
