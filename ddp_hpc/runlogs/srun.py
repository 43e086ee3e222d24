"""Plain-text rank output: Python tracebacks, srun's task exit reports, file tails.

The run logs' JSONL events are the first witness of a failure; these helpers read what is left
when a rank died before it could write an ``error`` event: its stdout/stderr (``rank{R}.out``)
and srun's report in the batch output ("srun: error: n2: task 3: Exited with exit code 1").
"""
from __future__ import annotations

import re
from pathlib import Path

#: srun's report of a task's exit: "srun: error: n2: task 3: Exited with exit code 1",
#: "srun: error: n1: tasks 0-1: Killed".
SRUN_EXIT_RE = re.compile(
    r"tasks? ([\d,\-]+): (?:Exited with exit code (\d+)|Killed|Terminated|Segmentation fault|Aborted)")
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?::\s?(.*))?$")
#: torch.distributed prefixes every line of an uncaught exception with the rank: "[rank3]: "
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")


def srun_exit_codes(paths) -> dict[int, int]:
    """Per-task exit codes from srun's reports in batch output files (-1: killed by a signal);
    the newest report of a task wins."""
    codes: dict[int, int] = {}
    for p in paths:
        for m in SRUN_EXIT_RE.finditer(_read_text(Path(p))):
            for task in _expand_ids(m.group(1)):
                codes[task] = int(m.group(2)) if m.group(2) else -1
    return codes


def traceback_in(path: Path) -> list[str] | None:
    """The last Python traceback block in a text file, or None (torch's ``[rankN]: `` line
    prefixes removed)."""
    lines = [_RANK_PREFIX.sub("", ln) for ln in _read_text(path).splitlines()]
    starts = [i for i, ln in enumerate(lines) if "Traceback (most recent call last):" in ln]
    if not starts:
        return None
    block = lines[starts[-1]:]
    end = len(block)
    for i in range(1, len(block)):
        ln = block[i]
        if ln and not ln[0].isspace() and _EXC_LINE.match(ln) and not ln.startswith("Traceback"):
            end = i + 1
            break
    return block[:end]


def exception_of(block: list[str]) -> tuple[str | None, str | None]:
    """(exception type, message) from the last line of a traceback block."""
    for ln in reversed(block):
        if ln and not ln[0].isspace():
            m = _EXC_LINE.match(ln.strip())
            if m and not ln.startswith("Traceback"):
                return m.group(1), (m.group(2) or "")
    return None, None


def tail_lines(text: str, n: int) -> list[str]:
    lines = [ln for ln in str(text).rstrip("\n").splitlines()]
    return lines[-n:] if n > 0 else []


def tail_file(path: Path, n: int, max_bytes: int = 1 << 20) -> list[str]:
    """The last n lines of a file without reading more than ``max_bytes`` of it."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return []
    lines = data.decode("utf-8", errors="replace").splitlines()
    if size > max_bytes and lines:
        lines = lines[1:]  # first line is probably cut
    return lines[-n:] if n > 0 else []


def _expand_ids(text: str) -> list[int]:
    """"0-2,5" -> [0, 1, 2, 5] (srun's task lists)."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (not hi or hi.isdigit()):
            out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
