"""Write the seconds the test scheduler orders by, from a full run's ``--durations=0`` report.

    .venv/bin/python -m pytest -n 3 --dist loadfile --durations=0 tests --ignore=tests/cluster > unit.log
    .venv/bin/python -m pytest -n 4 --dist loadgroup --durations=0 tests/cluster > cluster.log
    python3 scripts/durations.py unit.log cluster.log

tests/durations.json gets each unit test file's seconds (``--dist loadfile`` hands out files),
tests/cluster/durations.json each cluster test's (``--dist loadgroup`` hands out tests and groups);
tests/conftest.py starts the longest first. Times measured with both lanes running side by side
(as scripts/test.sh runs them) order best: they include the wait for the CPUs.
"""
from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINE = re.compile(r"^([\d.]+)s (?:call|setup|teardown)\s+(\S+)", re.M)


def seconds(log: str) -> dict[str, float]:
    """Each test's seconds (setup, call and teardown together) in a ``--durations=0`` report."""
    out: dict[str, float] = collections.Counter()
    for value, nodeid in LINE.findall(log):
        out[nodeid] += float(value)
    return out


def write(path: Path, table: dict[str, float]) -> None:
    rows = dict(sorted(((k, max(1, round(v))) for k, v in table.items()), key=lambda kv: (-kv[1], kv[0])))
    path.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"{path.relative_to(ROOT)}: {len(rows)} entries, {sum(rows.values())} s")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    unit, cluster = (seconds(Path(a).read_text()) for a in argv)
    files: dict[str, float] = collections.Counter()
    for nodeid, s in unit.items():
        files[nodeid.split("::", 1)[0]] += s
    if not files or not cluster:
        print("error: no '--durations=0' lines found in one of the logs; run pytest with --durations=0",
              file=sys.stderr)
        return 2
    write(ROOT / "tests" / "durations.json", files)
    write(ROOT / "tests" / "cluster" / "durations.json", cluster)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
