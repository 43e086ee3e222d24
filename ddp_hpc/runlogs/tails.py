"""Rank-prefixed tails of a run's per-rank files (``rank{R}.log``, ``rank{R}.out``), once or as
they grow: what ``ddp-hpc status JOBID --logs [--follow]`` prints.

Pure functions return records ``{rank, file, line}``; only :func:`follow_logs` loops and writes.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

from ddp_hpc.runlogs.schema import LOG_RE, OUT_RE
from ddp_hpc.runlogs.srun import tail_file

__all__ = ["rank_files", "logs_tail", "log_line", "render_logs", "follow_logs", "read_window"]


def read_window(path: Path, head_bytes: int, tail_lines: int, tail_bytes: int,
                max_tail_bytes: int) -> tuple[str, str, int]:
    """(head, tail, bytes skipped between them) of a text file, without reading all of it.

    ``head``: the complete lines within the first ``head_bytes``; ``tail``: the complete lines
    (and what follows the last newline) of the file's end, read backwards in chunks from
    ``tail_bytes`` until they hold more than ``tail_lines`` lines or reach ``max_tail_bytes``. A file
    whose head and tail meet is read whole: (its text, "", 0). An unreadable file is ("", "", 0).
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(head_bytes)
            cut = head.rfind(b"\n") + 1   # the head ends with its last complete line
            chunk = tail_bytes
            while True:
                start = max(cut, size - chunk)
                f.seek(start)
                tail = f.read(size - start)
                if start == cut or tail.count(b"\n") > tail_lines or chunk >= max_tail_bytes:
                    break
                chunk *= 2
    except OSError:
        return "", "", 0
    if start == cut:  # nothing left between them: the whole file
        return (head[:cut] + tail).decode("utf-8", errors="replace"), "", 0
    first = tail.find(b"\n") + 1  # the tail's first line is cut: start after it
    return (head[:cut].decode("utf-8", errors="replace"), tail[first:].decode("utf-8", errors="replace"),
            start + first - cut)


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
