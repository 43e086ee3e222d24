"""bench/scale.py --quick runs and prints every section, the growth factors and the verdict.

Only the shape of the report is checked, never a time: the machine may be shared."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "scale.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_scale", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_prints_every_section(tmp_path, capsys):
    scale = _load_bench()
    out_json = tmp_path / "scale.json"
    assert scale.main(["--quick", "--json", str(out_json), "--workdir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    for section in scale.SECTIONS:
        assert f"\n{section} " in text, section
    assert "cost per unit (us) by ranks:" in text and "cost per unit (us) by job records:" in text
    assert "growth" in text and "verdict:" in text and "linear or better:" in text
    assert "status of 64 ranks under 5 s:" in text
    assert "status --html, 64 ranks (64 lanes," in text and "of the text detail view's" in text
    # the cold table (no row kept yet) against the goal, with the Slurm calls of a refresh
    assert "first status --limit 0 over 64 records, no scheduler within 5 s:" in text
    assert "first status --limit 0 over 40 array tasks, 1 in 5 running within 5 s:" in text
    assert "Slurm calls per refresh: sacct 1, scontrol 1, squeue 1" in text
    doc = json.loads(out_json.read_text())
    assert {r["size"] for r in doc["rows"] if r["section"] == "status detail"} == set(scale.QUICK_SIZES)
    assert set(doc["summary"]["sections"]) == set(scale.SECTIONS)
    assert list(tmp_path.iterdir()) == [out_json]  # the synthetic logs and records are removed


@pytest.mark.parametrize("layout", ["node", "rank"])
def test_big_event_files_are_read_in_windows_with_the_same_verdict(tmp_path, monkeypatch, layout):
    """Beyond the read budget status reads rank 0 whole and the others' first KiB and last lines
    (a node's file: 8 times that, rank 0's lines on node 0 whole): the failing rank, every rank's
    last event and both runs stay what a full read gives; in either layout of the event files."""
    from ddp_hpc.judge import reader, tails
    scale = _load_bench()
    scale.LAYOUT[0] = layout              # a module of its own (_load_bench): nothing to undo
    bad = scale.write_logs(tmp_path / "logs", 16, 300)
    full = reader.RunLogs(tmp_path / "logs")
    assert not full.partial
    monkeypatch.setattr(tails, "FULL_READ_BYTES", 256 << 10)
    monkeypatch.setattr(reader, "FULL_READ_BYTES", 256 << 10)
    part = reader.RunLogs(tmp_path / "logs")
    assert part.partial == list(range(1, 16))
    assert len(part.ranks[0].events) == len(full.ranks[0].events)
    assert all(len(s.events) <= tails.TAIL_LINES + 4 for r, s in part.ranks.items() if r)
    assert part.last_events() == full.last_events()
    assert part.first_failure().rank == full.first_failure().rank == bad
    assert [r.restart for r in part.runs()] == [r.restart for r in full.runs()] == [0, 1]
    assert part.outcome() == full.outcome() == "failed"
    assert part.progress() == full.progress()


def test_read_window_reads_a_small_file_whole_and_a_big_one_at_its_ends(tmp_path):
    from ddp_hpc.judge.tails import read_window
    p = tmp_path / "f.txt"
    p.write_text("".join(f"line {i}\n" for i in range(1000)))
    assert read_window(p, 1 << 20, 10, 64, 1 << 10) == (p.read_text(), "", 0)
    head, tail, skipped = read_window(p, 20, 10, 64, 1 << 10)
    assert head == "line 0\nline 1\n"   # complete lines only
    assert tail.splitlines()[-10:] == [f"line {i}" for i in range(990, 1000)]
    assert len(head) + skipped + len(tail) == len(p.read_text())


def test_a_job_of_thousands_of_ranks_reads_shorter_tails_and_still_names_its_straggler(tmp_path, monkeypatch):
    """Beyond 1,024 ranks a windowed read takes fewer lines of each rank's tail (the job's total
    stays about what 1,024 ranks' take), never fewer than a rank's ending: status of a synthetic
    2,048-rank job (bench/pollcost.py's, one rank slow at its data) still names that straggler,
    and its detail view puts the ranks that are alike on one line."""
    from ddp_hpc.judge import reader, tails
    pollcost = _load_pollcost()
    assert (tails.tail_budget(64), tails.tail_budget(1024), tails.tail_budget(2048), tails.tail_budget(8192)) == (
        tails.TAIL_LINES, tails.TAIL_LINES, 12, tails.MIN_TAIL_LINES) and tails.MIN_TAIL_LINES >= tails.END_LINES
    pollcost.make_run(tmp_path / "logs", 2048, 256, steps=40, slow=1234)
    monkeypatch.setattr(tails, "FULL_READ_BYTES", 1 << 20)
    monkeypatch.setattr(reader, "FULL_READ_BYTES", 1 << 20)
    logs = reader.RunLogs(tmp_path / "logs")
    assert logs.tail == 12 and len(logs.partial) == 2048 - 8   # node 0's file is read whole
    assert max(len(s.events) for r, s in logs.ranks.items() if r >= 8) <= 12 + 4   # its tail, its head's few
    scale = _load_bench()
    home = tmp_path / "home"
    scale.write_record(home, pollcost.JOB_ID, tmp_path / "logs", 256, 0.0)
    with scale.status_home(home):
        doc = json.loads(scale.run_status([pollcost.JOB_ID, "--json"]))
        text = scale.run_status([pollcost.JOB_ID])
    assert doc["timing"]["slow_ranks"] == [1234], doc["timing"]["lines"]
    assert "rank 1234 on gpu0155 is" in text and "slower waiting for data" in text
    assert "Last event per rank (2048 ranks, alike ones on one line):" in text
    assert "  ranks 0-2047 (2048) on 256 hosts  restart 0  " in text and text.count("\n  rank ") == 0


def _load_pollcost():
    path = BENCH.parent / "pollcost.py"
    spec = importlib.util.spec_from_file_location("bench_pollcost", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_last_events_of_many_ranks_are_grouped_the_odd_ones_first():
    from ddp_hpc.status import view
    now = 1000.0
    last = {r: {"time": 990.0, "event": "step", "rank": r, "restart": 0, "host": f"n{r // 8}", "step": 10}
            for r in range(100)}
    for r in range(50, 100):
        last[r]["step"] = 9
    last[7] = {"time": 900.0, "event": "error", "rank": 7, "restart": 0, "host": "n0", "type": "ValueError"}
    lines = view._grouped_event_lines(last, now)
    assert lines[0] == "Last event per rank (100 ranks, alike ones on one line):"
    assert lines[1].startswith("  rank 7   n0         restart 0  00:01:40 ago") and "error type=ValueError" in lines[1]
    assert lines[2] == "  ranks 0-6,8-49 (49) on 7 hosts  restart 0  00:00:10 ago  step 10"
    assert lines[3] == "  ranks 50-99 (50) on 7 hosts  restart 0  00:00:10 ago  step 9"
    assert len(lines) == 4
