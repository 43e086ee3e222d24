"""The recent-jobs table (``ddp-hpc status``): one row per job, fitted to the terminal.

A table that wraps is unreadable, and a local job's id alone is 31 characters, so the columns
give way in one fixed order (`STEPS`) until the table fits: the log directory is cut in the
middle, then the columns a detail view tells just as well go (ETA, EVAL, GPU%, LOG DIR,
OVERRIDES, the limit, RESTARTS, BACKEND), then the cells take their short forms (``s57/300``
without its percent and epoch, ``CANCELLED`` without "by 1000"), then the shape, long names and
the loss give way; the ID is never cut (users copy it). ``width=None`` (``status --wide``)
shows every column whole. Which columns went, and which jobs were submitted from another
directory, is said under the table.
"""
from __future__ import annotations

import json
from typing import Callable, Iterable

from ddp_hpc.slurm.times import format_duration
from ddp_hpc.status.job import JobStatus
from ddp_hpc.status.targets import submitted_here
from ddp_hpc.text import cut_end, cut_middle, prog

__all__ = ["render_table", "progress_text", "state_text", "rate_text", "short", "shape_cell"]

COLUMNS = ("ID", "NAME", "BACKEND", "STATE", "NODESxGPUS", "ELAPSED/LIMIT", "RESTARTS",
           "PROGRESS", "LOSS", "RATE", "ETA", "LOG DIR")
#: columns shown only when some job has them, before LOG DIR: final eval metrics, sweep overrides,
#: the mean GPU utilisation of the ranks' newest samples
OPTIONAL = ("EVAL", "OVERRIDES", "GPU%")
CELL_MAX = 40  # characters of an EVAL / OVERRIDES cell
#: shown where some job has it and the terminal has room for it beside the other columns
GOODPUT = "GOODPUT"
GAP = 2
#: the mark after the NAME of a job submitted from another directory (`submitted_here`)
ELSEWHERE = "*"


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def progress_text(st: JobStatus, percent: bool = True, epoch: bool = True) -> str:
    """``e2 s57/300 19%``; without ``percent`` / ``epoch`` where the total is known (the step
    and total say it): ``s57/300``."""
    p = st.progress
    if p is None:
        return "-"
    parts = []
    if p.epoch is not None and (epoch or not p.total_steps):
        parts.append(f"e{p.epoch}")
    if p.step is not None:
        parts.append(f"s{p.step}" + (f"/{p.total_steps}" if p.total_steps else ""))
    if p.percent is not None and (percent or not p.total_steps):
        parts.append(f"{p.percent:.0f}%")
    return " ".join(parts) or "-"


def state_text(st: JobStatus) -> str:
    """The STATE cell: ``STALLED 00:02:10`` for a running job whose ranks went silent."""
    if st.stall is not None:
        return f"STALLED {format_duration(st.stall.silent_for_s)}"
    return st.state


def rate_text(st: JobStatus) -> str:
    """The RATE cell: ``25128 smp/s`` where the job reports samples/s (ddp_hpc's loop,
    ``report(samples_per_s=)``), else ``6.2 st/s`` (a script's optimizer steps), else ``-``."""
    p = st.progress
    if p is not None and p.samples_per_s is not None:
        return f"{_rate(p.samples_per_s)} smp/s"
    if p is not None and p.steps_per_s is not None:
        return f"{_rate(p.steps_per_s)} st/s"
    return "-"


def _rate(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def eval_text(st: JobStatus, limit: int = CELL_MAX) -> str:
    """``accuracy=0.91 loss=0.32``: the newest eval event's metrics, or ``-``."""
    m = st.eval_metrics or {}
    return cut_end(" ".join(f"{k}={short(v)}" for k, v in m.items()) or "-", limit)


def overrides_text(st: JobStatus, limit: int = CELL_MAX) -> str:
    return cut_end(" ".join(st.overrides or []) or "-", limit)


def short(v) -> str:
    """A value in a line: ``0.9123`` for a float, JSON for a dict or list, at most 60 characters."""
    if isinstance(v, float):
        return f"{v:.4g}"
    text = json.dumps(v) if isinstance(v, (dict, list)) else str(v)
    return cut_end(text, 60)


def goodput_text(st: JobStatus) -> str:
    """``87.3%``: the GOODPUT cell, or ``-``."""
    return f"{100 * st.goodput.goodput:.1f}%" if st.goodput is not None else "-"


def shape_cell(st: JobStatus) -> str:
    per = "-" if st.gpus_per_node is None else str(st.gpus_per_node)
    return f"{st.nodes or st.node_range or '-'}x{per}" + ("cpu" if st.device == "cpu" else "")


#: each column's cell of a job; a name ending in ``-`` is that column's short form
CELLS: dict[str, Callable[[JobStatus], str]] = {
    "ID": lambda s: s.id, "NAME": lambda s: s.name or "-", "BACKEND": lambda s: s.backend or "-",
    "STATE": state_text, "STATE-": lambda s: "STALLED" if s.stall is not None else s.state.split()[0],
    "NODESxGPUS": shape_cell,
    "ELAPSED/LIMIT": lambda s: f"{s.elapsed or '-'}/{s.time_limit or '-'}",
    "ELAPSED": lambda s: s.elapsed or "-", "RESTARTS": lambda s: str(s.restarts), GOODPUT: goodput_text,
    "PROGRESS": progress_text, "PROGRESS-": lambda s: progress_text(s, percent=False),
    "PROGRESS--": lambda s: progress_text(s, percent=False, epoch=False),
    "LOSS": lambda s: _num(s.progress.loss if s.progress else None, ".4g"), "RATE": rate_text,
    "ETA": lambda s: (format_duration(s.progress.eta_s) if s.progress and s.progress.eta_s is not None
                      and not s.job_state.terminal else "-"),
    "EVAL": eval_text, "OVERRIDES": overrides_text, "GPU%": lambda s: _num(s.gpu_percent, ".0f"),
    "LOG DIR": lambda s: s.log_dir or "-",
}
#: what gives way, in this order, until the table fits: ("cut", column, narrowest) cuts its
#: cells (the log directory in the middle, the rest at the end) no more than needed;
#: ("drop", column) leaves it out; ("form", column, short form, its header) shortens its cells
STEPS = (("cut", "LOG DIR", 24), ("cut", "OVERRIDES", 16), ("cut", "EVAL", 16),
         ("drop", "ETA"), ("drop", "EVAL"), ("drop", "GPU%"), ("drop", "LOG DIR"), ("drop", "OVERRIDES"),
         ("form", "ELAPSED/LIMIT", "ELAPSED", "ELAPSED"), ("drop", "RESTARTS"), ("drop", "BACKEND"),
         ("form", "PROGRESS", "PROGRESS-", "PROGRESS"), ("form", "NODESxGPUS", "NODESxGPUS", "NxG"),
         ("form", "STATE", "STATE-", "STATE"), ("form", "PROGRESS", "PROGRESS--", "PROGRESS"),
         ("drop", "NODESxGPUS"), ("cut", "NAME", 8), ("drop", "LOSS"), ("cut", "STATE", 9))


def _columns(optional: tuple[str, ...], goodput: bool) -> list[str]:
    at = COLUMNS.index("RESTARTS") + 1
    return (list(COLUMNS[:at]) + ([GOODPUT] if goodput else []) + list(COLUMNS[at:-1])
            + list(optional) + [COLUMNS[-1]])


class _Table:
    """The columns shown (each with its header, cell form and cut width) over the jobs' cells."""

    def __init__(self, statuses: list[JobStatus], columns: list[str], marked: list[bool]):
        self.statuses, self.marked = statuses, marked
        self.columns = list(columns)
        self.head = {c: c for c in columns}
        self.form = {c: c for c in columns}
        self.cut: dict[str, int] = {}
        self.gone: list[str] = []  # left out although some job had something to show in it
        self.cells = {c: self._cells(c) for c in columns}

    def _cells(self, column: str) -> list[str]:
        cells = [CELLS[self.form[column]](s) for s in self.statuses]
        if column == "NAME":
            cells = [c + ELSEWHERE if m else c for c, m in zip(cells, self.marked)]
        if column in self.cut:
            n = self.cut[column]
            cells = [_cut(column, c, n) for c in cells]
        return cells

    def widths(self) -> dict[str, int]:
        return {c: max([len(_cut(c, self.head[c], self.cut.get(c, 999)))] + [len(x) for x in self.cells[c]])
                for c in self.columns}

    def width(self) -> int:
        w = self.widths()
        return sum(w.values()) + GAP * (len(w) - 1)

    def fit(self, width: int) -> None:
        """Take `STEPS` in order until the table is no wider than ``width`` (or nothing is left to give)."""
        for step in STEPS:
            excess = self.width() - width
            if excess <= 0:
                return
            column = step[1]
            if column not in self.columns:
                continue
            if step[0] == "drop":
                self.columns.remove(column)
                if any(c != "-" for c in self.cells[column]):
                    self.gone.append(column)
            elif step[0] == "cut":
                now = self.widths()[column]
                target = max(step[2], now - excess)
                if target < now:
                    self.cut[column] = target
                    self.cells[column] = self._cells(column)
            else:
                if column == "ELAPSED/LIMIT" and any(s.time_limit for s in self.statuses):
                    self.gone.append("LIMIT")
                self.form[column], self.head[column] = step[2], step[3]
                self.cells[column] = self._cells(column)

    def lines(self) -> list[str]:
        w = self.widths()
        rows = [[_cut(c, self.head[c], self.cut.get(c, 999)) for c in self.columns]]
        rows += [[self.cells[c][i] for c in self.columns] for i in range(len(self.statuses))]
        return [(" " * GAP).join(x.ljust(w[c]) for x, c in zip(r, self.columns)).rstrip() for r in rows]


def _cut(column: str, text: str, width: int) -> str:
    if len(text) <= width:
        return text
    if column == "LOG DIR":
        return cut_middle(text, width)
    if column == "NAME" and text.endswith(ELSEWHERE):  # the mark stays
        return cut_end(text[:-1], width - 1) + ELSEWHERE
    return cut_end(text, width)


def render_table(statuses: Iterable[JobStatus], width: int | None = None, here: str | None = None) -> str:
    """The jobs as a table within ``width`` columns (None: every column whole, as wide as its
    cells), the columns giving way in the order of `STEPS`. A GOODPUT column (after RESTARTS)
    where some job has a goodput and the table has room for it without giving up anything else.
    ``here``: the directory the user asks from; a job submitted from another one gets a ``*``
    after its name, explained under the table."""
    statuses = list(statuses)
    if not statuses:
        return f"no ddp_hpc jobs recorded (submit one with {prog('submit')})\n"
    optional = tuple(c for c, have in zip(OPTIONAL, (any(s.eval_metrics for s in statuses),
                                                     any(s.overrides for s in statuses),
                                                     any(s.gpu_percent is not None for s in statuses))) if have)
    marked = [not submitted_here(s.cwd, here) for s in statuses]
    table = _Table(statuses, _columns(optional, True), marked) if any(s.goodput is not None for s in statuses) else None
    if table is None or (width is not None and table.width() > width):
        table = _Table(statuses, _columns(optional, False), marked)
        if width is not None:
            table.fit(width)
    out = table.lines()
    if any(marked):
        out.append(f"{ELSEWHERE} submitted from another directory ({prog('status')} --here: only the jobs of this one)")
    if table.gone:
        out.append(cut_end(f"more with --wide: {', '.join(table.gone)}", width or 999))
    return "\n".join(out) + "\n"
