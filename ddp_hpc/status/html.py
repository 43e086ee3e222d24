"""``ddp-hpc status JOB --html report.html``: one self-contained HTML page of a job (inline CSS, SVG
and a few lines of JS; no server, CDN or network), drawn from its detail status and the picture of
the run (`ddp_hpc.judge.picture`, with its lanes). From the top: the failure diagnosis, samples/s
and loss over time, the restart phases and goodput when the status has them, every rank's (or
node's) timeline, and the detail view's text.

What is drawn carries data attributes, so a browser (tests/test_status_html_browser.py) can
find it: ``data-kind`` (restart | stall | checkpoint | preempt | stage | error | end | phase),
``data-time`` (unix seconds), ``data-rank`` / ``data-ranks``, a lane's ``data-lane`` (its index)
and ``data-state`` of its cells (`ddp_hpc.judge.picture.STATES`).
"""
from __future__ import annotations

import html
import json
import statistics
import time

from ddp_hpc.judge.goodput import PART_NAMES
from ddp_hpc.judge.picture import STATES, Picture
from ddp_hpc.judge.timing import STALL_FACTOR
from ddp_hpc.slurm.times import format_duration
from ddp_hpc.status.job import JobStatus
from ddp_hpc.status.view import failure_lines, render_detail, shape_text

__all__ = ["render_html"]

LEFT, WIDTH, RIGHT = 170, 900, 40   # px: lane labels, the time axis, margin
CHART_H = 120
COLORS = {"idle": "#ffffff", "run": "#d9e2ec", "step": "#4c9f70", "data": "#e0a030", "stall": "#d64545",
          "stage": "#7a5cc7", "restart": "#c01c28", "checkpoint": "#1c71d8", "preempt": "#986a44",
          "error": "#c01c28", "end": "#5e5c64"}
#: the goodput object's other keys, as the detail view words them (its parts: judge.goodput.PART_NAMES)
GOODPUT_NAMES = {"goodput": "goodput", "wall_s": "since the first step (s)", "useful_s": "useful steps (s)",
                 "steps_redone": "steps trained twice", "step_s": "seconds per step"}
PHASE_COLORS = ("#1c71d8", "#26a269", "#e5a50a", "#c64600", "#813d9c", "#865e3c", "#3d3846")
CSS = """body{font:13px/1.4 system-ui,sans-serif;margin:16px;color:#222}h1{font-size:18px;margin:0 0 4px}
h2{font-size:15px;margin:18px 0 6px}.fail{border-left:4px solid #c01c28;background:#fdf0f0;padding:6px 10px;
white-space:pre-wrap;font-family:monospace}.ok{border-left:4px solid #26a269;background:#f0fdf4;padding:6px 10px}
svg text{font:11px sans-serif}.legend span{display:inline-block;margin-right:12px}.legend i{display:inline-block;
width:10px;height:10px;margin-right:4px;vertical-align:middle}pre{background:#f6f6f6;padding:8px;overflow:auto}
#readout{font-family:monospace;color:#555;min-height:1.4em}"""
#: the time under the mouse, over any chart (every svg with data-t0/t1 shares the axis)
JS = """document.querySelectorAll('svg[data-t0]').forEach(function(svg){svg.addEventListener('mousemove',
function(ev){var r=svg.getBoundingClientRect(),t0=+svg.dataset.t0,t1=+svg.dataset.t1,left=+svg.dataset.left,
w=+svg.dataset.width,x=(ev.clientX-r.left)*svg.viewBox.baseVal.width/r.width;if(x<left||x>left+w)return;
var s=(x-left)/w*(t1-t0);document.getElementById('readout').textContent='+'+s.toFixed(1)+' s  '+
new Date((t0+s)*1000).toISOString().replace('T',' ').slice(0,19)+' UTC';});});"""


def _e(v) -> str:
    return html.escape(str(v), quote=True)


def _attrs(**kw) -> str:
    return "".join(f' {k.replace("_", "-")}="{_e(v)}"' for k, v in kw.items() if v is not None)


class _Axis:
    """Time to x: the run's time from t0 to t1 over WIDTH px after LEFT."""

    def __init__(self, t0: float, t1: float):
        self.t0, self.span = t0, max(t1 - t0, 1e-9)
        self.t1 = t0 + self.span

    def x(self, t: float) -> float:
        return round(LEFT + (t - self.t0) / self.span * WIDTH, 2)

    def svg(self, height: int, body: str, label: str) -> str:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {LEFT + WIDTH + RIGHT} {height}" '
                f'width="{LEFT + WIDTH + RIGHT}" height="{height}" role="img" aria-label="{_e(label)}"'
                f'{_attrs(data_t0=self.t0, data_t1=self.t1, data_left=LEFT, data_width=WIDTH)}>{body}</svg>')

    def ticks(self, y: int) -> str:
        out = []
        for i in range(6):
            x = LEFT + WIDTH * i / 5
            out.append(f'<line x1="{x}" x2="{x}" y1="{y - 4}" y2="{y}" stroke="#888"/>'
                       f'<text x="{x}" y="{y + 12}" text-anchor="middle">+{format_duration(self.span * i / 5)}</text>')
        return "".join(out)


def _marks_svg(ax: _Axis, marks: list[dict], top: int, bottom: int) -> str:
    """Vertical lines at restarts and stalls (a stall's band to its end) across a chart."""
    out = []
    for m in marks:
        if m["kind"] not in ("restart", "stall"):
            continue
        x, color = ax.x(m["time"]), COLORS[m["kind"]]
        a = _attrs(data_kind=m["kind"], data_time=m["time"], data_restart=m.get("restart"), data_rank=m.get("rank"))
        tip = f"{m['kind']} +{format_duration(m['time'] - ax.t0)}" + (f": {m['why']}" if m.get("why") else "")
        if m["kind"] == "stall" and m.get("end"):
            out.append(f'<rect{a} x="{x}" y="{top}" width="{max(ax.x(m["end"]) - x, 1)}" height="{bottom - top}" '
                       f'fill="{color}" fill-opacity="0.15"><title>{_e(tip)}</title></rect>')
        else:
            dash = "5,3" if m["kind"] == "restart" else "2,2"
            out.append(f'<line{a} x1="{x}" x2="{x}" y1="{top}" y2="{bottom}" stroke="{color}" stroke-width="2" '
                       f'stroke-dasharray="{dash}"><title>{_e(tip)}</title></line>')
    return "".join(out)


def _chart(ax: _Axis, series: list, i: int, name: str, marks: list[dict]) -> str:
    """One value of the series over time, a line per run, with the marks and the ends' values."""
    pts = [(p[0], p[i], p[3]) for p in series if p[i] is not None]
    if not pts:
        return ""
    lo, hi = min(v for _, v, _ in pts), max(v for _, v, _ in pts)
    y = lambda v: round(CHART_H - 15 - (v - lo) / ((hi - lo) or 1) * (CHART_H - 25), 2)  # noqa: E731
    lines = []
    for run, piece in _pieces(pts):
        xy = " ".join(f"{ax.x(t)},{y(v)}" for t, v in piece)
        lines.append(f'<polyline data-kind="series" data-restart="{run}" points="{xy}" fill="none" '
                     f'stroke="#1c71d8" stroke-width="1.5"/>')
    for m in marks:
        if m["kind"] == "checkpoint":
            lines.append(f'<circle{_attrs(data_kind="checkpoint", data_time=m["time"], data_step=m.get("step"))} '
                         f'cx="{ax.x(m["time"])}" cy="{CHART_H - 10}" r="3" fill="{COLORS["checkpoint"]}">'
                         f'<title>checkpoint at step {_e(m.get("step"))}</title></circle>')
    labels = (f'<text x="{LEFT - 6}" y="14" text-anchor="end">{_e(f"{hi:.4g}")}</text>'
              f'<text x="{LEFT - 6}" y="{CHART_H - 14}" text-anchor="end">{_e(f"{lo:.4g}")}</text>'
              f'<text x="4" y="{CHART_H / 2}">{_e(name)}</text>')
    body = labels + _marks_svg(ax, marks, 2, CHART_H - 10) + "".join(lines) + ax.ticks(CHART_H + 2)
    return f'<div data-chart="{_e(name)}">' + ax.svg(CHART_H + 18, body, f"{name} over time") + "</div>"


def _pieces(pts: list[tuple[float, float, int]]) -> list[tuple[int, list[tuple[float, float]]]]:
    """The points cut into lines: one per run, cut again where the steps stopped for longer than
    `STALL_FACTOR` x the run's median interval (no line drawn across a stall)."""
    out = []
    for run in sorted({r for _, _, r in pts}):
        mine = [(t, v) for t, v, r in pts if r == run]
        gaps = [b[0] - a[0] for a, b in zip(mine, mine[1:])]
        limit = STALL_FACTOR * statistics.median(gaps) if gaps else 0.0
        piece = mine[:1]
        for a, b in zip(mine, mine[1:]):
            if b[0] - a[0] > limit > 0:
                out.append((run, piece))
                piece = []
            piece.append(b)
        out.append((run, piece))
    return out


def _phases(marks: list[dict]) -> str:
    """Each restart's phases as one stacked bar (seconds), when the restarts have them."""
    rows = [m for m in marks if m["kind"] == "restart" and isinstance(m.get("phases"), dict) and m["phases"]]
    if not rows:
        return ""
    names = list(dict.fromkeys(k for m in rows for k in m["phases"]))
    totals = [sum(float(v) for v in m["phases"].values() if isinstance(v, (int, float))) for m in rows]
    longest = max(totals) or 1.0
    bars = []
    for j, m in enumerate(rows):
        x, y = LEFT, 6 + 24 * j
        bars.append(f'<text x="{LEFT - 6}" y="{y + 13}" text-anchor="end">restart {_e(m.get("restart"))}</text>')
        for k in names:
            v = m["phases"].get(k)
            if not isinstance(v, (int, float)):
                continue
            w = v / longest * WIDTH
            color = PHASE_COLORS[names.index(k) % len(PHASE_COLORS)]
            a = _attrs(data_kind="phase", data_phase=k, data_restart=m.get("restart"), data_seconds=v)
            bars.append(f'<rect{a} x="{x:.2f}" y="{y}" width="{w:.2f}" height="18" fill="{color}">'
                        f'<title>{_e(k)}: {v:.1f} s</title></rect>')
            x += w
        bars.append(f'<text x="{x + 4:.2f}" y="{y + 13}">{totals[j]:.1f} s</text>')
    legend = "".join(f'<span><i style="background:{PHASE_COLORS[i % len(PHASE_COLORS)]}"></i>{_e(k)}</span>'
                     for i, k in enumerate(names))
    svg = (f'<svg viewBox="0 0 {LEFT + WIDTH + RIGHT + 60} {12 + 24 * len(rows)}" width="{LEFT + WIDTH + RIGHT + 60}" '
           f'height="{12 + 24 * len(rows)}">{"".join(bars)}</svg>')
    return f'<h2>Restart phases</h2><div class="legend">{legend}</div>{svg}'


def _goodput_label(key: str) -> str:
    """A goodput key (``lost_s.redone``) in the words of the detail view (``lost: steps trained
    twice (s)``): the page is read by people, its ``data-key`` keeps the key for scripts."""
    head, _, sub = key.partition(".")
    if head == "lost_s":
        return f"lost: {PART_NAMES.get(sub, sub)} (s)"
    if head == "restart_phases":
        return f"restart phase: {sub} (s)"
    return GOODPUT_NAMES.get(key, key)


def _goodput(doc: dict | None) -> str:
    """The goodput's numbers as ``--json`` has them (`Goodput.to_dict`: each row keyed by its JSON
    key, for scripts; a fraction as a percentage), when the status has one."""
    if not isinstance(doc, dict) or not doc:
        return ""
    flat = {}
    for k, v in doc.items():
        if isinstance(v, dict):
            flat.update({f"{k}.{kk}": vv for kk, vv in v.items() if isinstance(vv, (int, float))})
        elif isinstance(v, (int, float)):
            flat[k] = v
    rows = "".join(f'<tr data-kind="goodput" data-key="{_e(k)}"><td>{_e(_goodput_label(k))}</td><td>'
                   f'{_e(f"{v:.1%}" if 0 <= v <= 1 and not k.endswith("_s") else f"{v:.4g}")}</td></tr>'
                   for k, v in flat.items())
    return f'<h2>Goodput</h2><table>{rows}</table>'


def _point(ax: _Axis, p: dict, y: float, h: int) -> str:
    """An error, failed ending or checkpoint in a lane: a bar at its time (``data-rank``: the
    first rank that had it there, ``data-ranks``: all of the lane's)."""
    a = _attrs(data_kind=p["kind"], data_rank=p["rank"], data_ranks=p.get("ranks"), data_time=p["time"],
               data_restart=p["restart"])
    who = f"ranks {p['ranks']}" if p.get("ranks") != str(p["rank"]) else f"rank {p['rank']}"
    return (f'<rect{a} x="{ax.x(p["time"]) - 2}" y="{y - 1}" width="4" height="{h}" '
            f'fill="{COLORS.get(p["kind"], "#000")}"><title>{_e(who)}: {_e(p["text"])} at '
            f'+{format_duration(p["time"] - ax.t0)}</title></rect>')


def _lane_svg(ax: _Axis, pic: Picture) -> str:
    lanes, bins = pic.lanes or [], pic.bins or 1
    h = 14 if len(lanes) <= 64 else 8
    top, cell_w = 4, WIDTH / bins
    body = []
    for i, lane in enumerate(lanes):
        y = top + i * h
        tip = f"{lane['label']}: ranks {lane['ranks']}" + (" (events read in part)" if lane.get("partial") else "")
        cells = "".join(f'<rect data-state="{STATES[s]}" x="{LEFT + a * cell_w:.2f}" y="{y}" width="{n * cell_w:.2f}" '
                        f'height="{h - 2}" fill="{COLORS[STATES[s]]}"/>' for a, n, s in lane["cells"])
        # errors drawn last, on top of an ending or checkpoint in the same place
        points = "".join(_point(ax, p, y, h) for p in sorted(lane["points"], key=lambda p: p["kind"] == "error"))
        a = _attrs(data_lane=i, data_ranks=lane["ranks"], data_label=lane["label"], data_y=y, data_h=h)
        # narrow lanes (beyond 64): every 4th labelled, the others by their tooltip
        label = "" if h < 14 and i % 4 else (f'<text x="{LEFT - 6}" y="{y + h - 2}" text-anchor="end" '
                                             f'style="font-size:{min(11, h + 1)}px">{_e(lane["label"])}</text>')
        body.append(f'<g class="lane"{a}><title>{_e(tip)}</title>{label}{cells}{points}</g>')
    bottom = top + len(lanes) * h
    body.append(_marks_svg(ax, pic.marks, 0, bottom) + ax.ticks(bottom + 6))
    legend = "".join(f'<span><i style="background:{COLORS[s]}"></i>{s}</span>' for s in STATES[1:]) + "".join(
        f'<span><i style="background:{COLORS[k]}"></i>{k}</span>' for k in ("error", "end", "checkpoint", "restart"))
    what = {"rank": "a lane per rank", "node": "a lane per node", "nodes": "a lane per block of nodes"}
    return (f'<h2>Timeline ({_e(what.get(pic.lane_kind, ""))}, {len(lanes)} lanes)</h2>'
            f'<div class="legend">{legend}</div><div id="readout"></div>'
            + ax.svg(bottom + 24, "".join(body), "per-rank timeline"))


def render_html(st: JobStatus, now: float | None = None) -> str:
    """The page of one job (``st``: its detail status, the picture with its lanes)."""
    now = time.time() if now is None else now
    pic = st.picture
    head = f"Job {st.id}" + (f" ({st.name})" if st.name else "") + f": {st.state}, {shape_text(st)}"
    fail = failure_lines(st)
    parts = [f"<h1>{_e(head)}</h1>",
             f'<div class="fail" data-kind="diagnosis">{_e(chr(10).join(fail))}</div>' if fail else
             f'<div class="ok" data-kind="diagnosis">No failure found ({_e(st.state)}).</div>']
    if pic is not None:
        ax = _Axis(pic.t0, pic.t1)
        marks = pic.marks
        parts.append("<h2>Throughput and loss</h2>" + _chart(ax, pic.series, 1, "samples/s", marks)
                     + _chart(ax, pic.series, 2, "loss", marks))
        parts.append(_phases(marks))
        parts.append(_goodput(st.goodput.to_dict() if st.goodput is not None else None))
        parts.append(_lane_svg(ax, pic))
    else:
        parts.append("<p>No timed events in the run logs: nothing to draw.</p>")
    parts.append(f"<h2>Detail</h2><pre>{_e(render_detail(st, now, unicode=True))}</pre>")
    data = json.dumps({"id": st.id, "state": st.state, "failure_rank": st.failure.rank if st.failure else None,
                       "t0": pic.t0 if pic else None, "t1": pic.t1 if pic else None}).replace("</", "<\\/")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(head)}</title><style>{CSS}</style></head><body>{''.join(parts)}"
            f'<script type="application/json" id="job">{data}</script><script>{JS}</script></body></html>\n')
