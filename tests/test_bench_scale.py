"""bench/scale.py --quick runs and prints every section, the growth factors and the verdict.

Only the shape of the report is checked, never a time: the machine may be shared."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

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
    doc = json.loads(out_json.read_text())
    assert {r["size"] for r in doc["rows"] if r["section"] == "status detail"} == set(scale.QUICK_SIZES)
    assert set(doc["summary"]["sections"]) == set(scale.SECTIONS)
    assert list(tmp_path.iterdir()) == [out_json]  # the synthetic logs and records are removed
