"""The picture of a run: the detail view's sparklines (golden files, Unicode and ASCII), the marks
and lanes drawn where the events say, and ``status JOB --html`` (one self-contained page; its
restart phases and goodput only when the status has them; a 1,024-rank job a lane per node).
The page in a real browser: tests/cluster/test_status_html_browser_cluster.py."""
from __future__ import annotations

import importlib.util
import io
import json
import os
import re
from html.parser import HTMLParser
from pathlib import Path

import picture_events as pe
import pytest

from ddp_hpc.judge import picture
from ddp_hpc.judge.goodput import Goodput
from ddp_hpc.status import cli as status_cli
from ddp_hpc.status import spark, view
from ddp_hpc.status.collect import collect
from ddp_hpc.status.html import render_html
from ddp_hpc.status.targets import StatusTarget

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("DDP_HPC_UPDATE_GOLDEN") == "1"
NOW = pe.T0 + 700.0


def _status(log_dir: Path, lanes: bool = False):
    return collect([StatusTarget(pe.JOB, None, str(log_dir))], None, None, history=True, now=NOW, lanes=lanes)[0]


@pytest.mark.parametrize("unicode", [True, False], ids=["utf8", "ascii"])
def test_detail_view_golden_with_sparklines(tmp_path, utc, unicode):
    log_dir = pe.write_run(tmp_path / "logs")
    text = view.render_detail(_status(log_dir), now=NOW, unicode=unicode).replace(str(log_dir), "<LOG_DIR>")
    path = GOLDEN / f"status_detail_picture_{'utf8' if unicode else 'ascii'}.txt"
    if UPDATE:
        path.write_text(text, encoding="utf-8")
    assert text == path.read_text(encoding="utf-8"), \
        "the detail view changed; review and rerun with DDP_HPC_UPDATE_GOLDEN=1"
    spark_block = [ln for ln in text.splitlines() if ln.startswith(("Samples/s:", "Loss:", "Marks:"))]
    assert len(spark_block) == 3
    if unicode:
        assert any(c in spark.BLOCKS for c in spark_block[0])
    else:
        assert all(ord(c) < 128 for c in text)


def test_marks_under_the_sparklines_sit_at_their_events_columns(tmp_path):
    pic = _status(pe.write_run(tmp_path / "logs")).picture
    marks = view.render_detail(_status(tmp_path / "logs"), now=NOW, unicode=True).split("Marks:")[1].splitlines()[0]
    cols = marks[12 - len("Marks:"):][:spark.WIDTH]
    span = pic.t1 - pic.t0
    for i, (kind, _) in enumerate(spark.MARKS):   # a column shows the first kind of MARKS it has
        for m in (m for m in pic.marks if m["kind"] == kind):
            col = min(spark.WIDTH - 1, int((m["time"] - pic.t0) / span * spark.WIDTH))
            assert cols[col] in [letter for _, letter in spark.MARKS[:i + 1]], (kind, col)
    assert "R" in cols and "S" in cols and "C" in cols


def test_ascii_where_stdout_is_not_utf8(tmp_path, monkeypatch):
    assert spark.unicode_ok(io.TextIOWrapper(io.BytesIO(), encoding="utf-8"))
    ascii_out = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    assert not spark.unicode_ok(ascii_out)
    monkeypatch.setattr("sys.stdout", ascii_out)
    text = view.render_detail(_status(pe.write_run(tmp_path / "logs")), now=NOW)
    ascii_out.write(text)   # an ASCII terminal takes it: no UnicodeEncodeError
    assert "Samples/s:" in text and all(ord(c) < 128 for c in text)


def test_picture_marks_restarts_stalls_checkpoints_and_the_failing_rank_where_the_events_say(tmp_path):
    st = _status(pe.write_run(tmp_path / "logs"), lanes=True)
    pic = st.picture
    by = lambda kind: [m for m in pic.marks if m["kind"] == kind]  # noqa: E731
    (restart,) = by("restart")
    assert restart["time"] == pe.RESTART_AT and restart["restart"] == 1 and restart["phases"] == pe.PHASES
    stalls = by("stall")
    assert [(s["time"], s["end"]) for s in stalls] == [(pe.T0 + 108.0, pe.T0 + 260.0)]
    assert [c["step"] for c in by("checkpoint")] == [100, 250] and by("checkpoint")[0]["blocking_s"] == 0.4
    assert {s["node"] for s in by("stage")} == {"n1", "n2"}
    assert pic.lane_kind == "rank" and [ln["ranks"] for ln in pic.lanes] == ["0", "1", "2", "3"]
    lane = pic.lanes[pe.FAIL_RANK]
    (err,) = [p for p in lane["points"] if p["kind"] == "error"]
    assert err["time"] == pe.ERROR_AT and err["rank"] == pe.FAIL_RANK and "bad batch 4711" in err["text"]
    # the lane's cells: stalled over the gap, waiting for data where data_s is 0.35 of 2 s / 5 steps
    cells = {picture.STATES[s] for _, _, s in lane["cells"]}
    assert {"step", "data", "stall", "run"} <= cells
    assert st.failure.rank == pe.FAIL_RANK


class _Page(HTMLParser):
    """Every element's attributes, and the end tags that close no open element (the SVG shapes,
    written ``<rect .../>`` or with a ``<title>`` inside, are left out of the nesting check)."""
    SHAPES = ("meta", "line", "circle", "rect", "polyline")

    def __init__(self):
        super().__init__()
        self.attrs, self.stack, self.errors = [], [], []

    def handle_starttag(self, tag, attrs):
        self.attrs.append((tag, dict(attrs)))
        if tag not in self.SHAPES:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if tag not in self.SHAPES and (not self.stack or self.stack.pop() != tag):
            self.errors.append(tag)


def _page_via_cli(tmp_path, log_dir, capsys) -> tuple[str, _Page]:
    out = tmp_path / "report.html"
    assert status_cli.main([pe.JOB, "--log-dir", str(log_dir), "--html", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    text = out.read_text(encoding="utf-8")
    page = _Page()
    page.feed(text)
    return text, page


def test_html_page_is_self_contained_with_diagnosis_first_and_phases_when_present(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DDP_HPC_HOME", str(tmp_path / "home"))
    text, page = _page_via_cli(tmp_path, pe.write_run(tmp_path / "logs"), capsys)
    assert text.startswith("<!DOCTYPE html>") and not page.errors
    # nothing fetched: no src / href attributes, no URL but the SVG namespace
    assert not [a for _, a in page.attrs if "src" in a or "href" in a]
    assert set(re.findall(r"https?://[^\s\"'<>]+", text)) == {"http://www.w3.org/2000/svg"}
    assert text.index('data-kind="diagnosis"') < text.index("Throughput and loss") < text.index("Timeline")
    assert "First failure: rank 3 on n2" in text
    phases = [a for t, a in page.attrs if a.get("data-kind") == "phase"]
    assert [p["data-phase"] for p in phases] == list(pe.PHASES)
    lanes = [a for t, a in page.attrs if t == "g" and "data-lane" in a]
    assert [ln["data-ranks"] for ln in lanes] == ["0", "1", "2", "3"]
    errs = [a for _, a in page.attrs if a.get("data-kind") == "error" and a.get("data-rank") == str(pe.FAIL_RANK)]
    assert len(errs) == 1 and float(errs[0]["data-time"]) == pe.ERROR_AT
    restarts = [a for _, a in page.attrs if a.get("data-kind") == "restart"]
    assert restarts and {float(a["data-time"]) for a in restarts} == {pe.RESTART_AT}
    job = json.loads(re.search(r'<script type="application/json" id="job">(.*?)</script>', text).group(1))
    assert job["failure_rank"] == pe.FAIL_RANK
    assert "<h2>Goodput</h2>" in text   # judge.goodput reads it from the same events


def test_html_without_the_marks_draws_only_the_phases_read_and_goodput_when_the_status_has_it(tmp_path):
    st = _status(pe.write_run(tmp_path / "logs", phases=False), lanes=True)
    drawn = _Page()
    drawn.feed(render_html(st, NOW))   # no stopped_at, rendezvous or restored marks: their time is the step's
    assert [a["data-phase"] for _, a in drawn.attrs if a.get("data-kind") == "phase"] == ["detect", "first_step"]
    st.goodput = Goodput.from_dict(pe.GOODPUT)   # the health work's object, as JobStatus.to_dict will carry it
    page = render_html(st, NOW)
    assert "<h2>Goodput</h2>" in page and 'data-key="goodput"' in page and "71.0%" in page
    assert 'data-key="lost_s.restarts"' in page


def test_html_of_1024_ranks_draws_a_lane_per_node_with_the_failing_rank_in_its_node(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_scale", Path(__file__).parents[1] / "bench" / "scale.py")
    scale = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scale)
    bad = scale.write_logs(tmp_path / "logs", 1024, 12)
    st = collect([StatusTarget(scale.JOB_ID, None, str(tmp_path / "logs"))], None, None, history=True, lanes=True)[0]
    pic = st.picture
    assert pic.lane_kind == "node" and len(pic.lanes) == 1024 // scale.PER_NODE
    lane = next(ln for ln in pic.lanes if scale.host(bad // scale.PER_NODE) in ln["hosts"])
    first = lane["points"][0]
    assert first["kind"] == "error" and first["rank"] == bad
    assert st.failure.rank == bad
    assert render_html(st).count('class="lane"') == 128


def test_html_refuses_a_missing_folder_and_other_views(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        status_cli.main(["4242", "--html", str(tmp_path / "no" / "such" / "r.html")])
    assert exc.value.code == 2 and "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        status_cli.main(["--html", str(tmp_path / "r.html")])
    assert "--html FILE needs a job id" in capsys.readouterr().err
