"""Reading a run's per-rank files, whole or only their ends: each rank's event stream
(`read_events`, within the read budget of a big job: `over_budget`, `read_window`) and the
rank-prefixed tails of ``rank{R}.log`` / ``rank{R}.out``, once or as they grow: what
``ddp-hpc status JOBID --logs [--follow]`` prints.

Pure functions return records ``{rank, file, line}``; only :func:`follow_logs` loops and writes.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from ddp_hpc.fsutil import file_size
from ddp_hpc.judge.srun import TaskReport, tail_file
from ddp_hpc.parsing import to_int
from ddp_hpc.runlogs.schema import EVENTS_RE, LOG_RE, OUT_RE

__all__ = ["rank_files", "logs_tail", "log_line", "render_logs", "follow_logs", "read_window", "RankStream",
           "read_events", "over_budget", "tail_budget", "tail_read_bytes", "RunFiles"]


#: the read budget: a log directory's event files are read whole while together they hold at
#: most FULL_READ_BYTES (about 100,000 events); beyond that, rank 0's file is read whole (up to
#: that size: it gives progress, ETA, eval metrics) and of every other rank's file only the first
#: HEAD_BYTES and the last TAIL_LINES lines (read back from TAIL_BYTES, at most TAIL_MAX_BYTES:
#: a stack event can be long), so status of a job of thousands of ranks takes seconds, not minutes
FULL_READ_BYTES = 32 << 20
HEAD_BYTES = 1 << 10
TAIL_LINES = 24
#: beyond TAIL_RANKS ranks a rank's tail shrinks so that the job's stays about TAIL_LINES x
#: TAIL_RANKS lines, down to MIN_TAIL_LINES (an ending, `END_LINES`, or the step intervals a
#: straggler is judged by): status of a job of 8,192 ranks reads a third of the lines it read
#: with TAIL_LINES a rank (`tail_budget`)
TAIL_RANKS = 1024
MIN_TAIL_LINES = 8  # = END_LINES, below
TAIL_BYTES = 8 << 10
TAIL_MAX_BYTES = 1 << 20
#: the job table (``RunLogs(ends_only=True)``) reads of every rank but rank 0 only how its current
#: run ended: its last events back to its newest ``step``/``epoch``/``start`` (what follows a rank's
#: last training progress is its ending: stack, error, checkpoint, preempt, end), at most END_LINES
#: of them, from its last END_BYTES (more when they hold fewer lines)
END_LINES = 8
END_BYTES = 4 << 10
#: the events that show a rank still in its training loop: its ending comes after the newest one
PROGRESS_EVENTS = ("step", "epoch", "start")
_RAW_DECODE = json.JSONDecoder().raw_decode
try:   # orjson decodes an event line four times faster; a line it refuses (NaN) goes to json
    from orjson import JSONDecodeError as _FastError
    from orjson import loads as _fast_loads
except ImportError:   # not installed (it is a dependency; a platform without its wheel)
    _fast_loads, _FastError = None, ValueError


@dataclass
class RankStream:
    """One rank's events (in file order) and how many lines could not be parsed."""

    rank: int
    path: Path
    events: list[dict] = field(default_factory=list)
    bad_lines: int = 0
    skipped: int = 0  # bytes between the head and the tail not read (the read budget above)
    newest_only: bool = False  # rank 0's newest run and earlier start and eval events (judge.newest)
    #: the events grouped by restart number, and the (list, length) it was built from: status
    #: asks for one run's events many times per rank, and a scan per question made it quadratic
    _by_restart: tuple | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def last(self) -> dict | None:
        return self.events[-1] if self.events else None

    def _runs(self) -> dict[int, list[dict]]:
        """restart number -> its events in file order; rebuilt when `events` changed length."""
        key = (id(self.events), len(self.events))
        if self._by_restart is None or self._by_restart[0] != key:
            runs: dict[int, list[dict]] = {}
            for e in self.events:
                restart = e.get("restart")
                if type(restart) is not int:  # the writer's ints skip the conversion
                    restart = restart_of(e)
                runs.setdefault(restart, []).append(e)
            self._by_restart = (key, runs)
        return self._by_restart[1]

    def of_restart(self, restart: int) -> list[dict]:
        return list(self._runs().get(restart, ()))

    def restart_numbers(self) -> set[int]:
        return set(self._runs())


class RunFiles(Protocol):
    """What attribution reads of a run's log directory (`ddp_hpc.judge.reader.RunLogs` is the
    one implementation): the event streams, each rank's ``rank{R}.out``, srun's reports."""

    ranks: dict[int, RankStream]
    outs: dict[int, Path]

    def current_restart(self) -> int: ...

    def out_traceback(self, rank: int) -> list[str] | None: ...

    def out_tail(self, rank: int) -> list[str]: ...

    def task_reports(self) -> dict[int, TaskReport]: ...

    def node_failures(self) -> tuple[bool, list[str]]: ...


def tail_budget(ranks: int) -> int:
    """The lines of a rank's tail that a windowed read of a job of ``ranks`` ranks takes."""
    return max(MIN_TAIL_LINES, min(TAIL_LINES, TAIL_LINES * TAIL_RANKS // max(1, ranks)))


def tail_read_bytes(lines: int) -> int:
    """The bytes a windowed read first reads back for a tail of ``lines`` lines (more while they
    hold fewer)."""
    return TAIL_BYTES * lines // TAIL_LINES


def read_events(path: Path, window: bool = False, ends: bool = False, since: int | None = None,
                tail: int = TAIL_LINES) -> RankStream:
    """Parse one ``rank{R}.events.jsonl``; malformed lines are skipped and counted. ``window``:
    only its first `HEAD_BYTES` and its last ``tail`` lines (`skipped` says how many bytes
    between them were not read). ``ends``: only its ending (`END_LINES`: the events after its
    newest step, epoch or start event, and that one), decoded from the last line backwards.
    ``since``: only what was appended after that byte offset (of its last `TAIL_MAX_BYTES`)."""
    m = EVENTS_RE.match(path.name)
    stream = RankStream(rank=int(m.group(1)) if m else -1, path=path)
    if ends:
        return _read_ending(stream)
    if window:
        head, end, stream.skipped = read_window(path, HEAD_BYTES, tail, tail_read_bytes(tail), TAIL_MAX_BYTES)
        text = head + "\n".join(end.splitlines()[-tail:])
    elif since is not None:
        text = "\n".join(tail_file(path, sys.maxsize, TAIL_MAX_BYTES, since))
    else:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return stream
    lines = [line for line in text.splitlines() if line.strip()]
    for ev in decoded(lines):
        if isinstance(ev, dict) and "event" in ev:
            stream.events.append(ev)
        else:
            stream.bad_lines += 1  # not JSON (None), or not an event
    return stream


def _read_ending(stream: RankStream) -> RankStream:
    """``read_events(ends=True)``: the file's last lines decoded backwards until one is a
    progress event (`PROGRESS_EVENTS`) or `END_LINES` were taken; `skipped` counts the bytes
    before them. One ``pread`` of the file's end (the job table reads thousands of these)."""
    try:
        text, start, size = file_end(stream.path, END_BYTES, END_LINES)
    except OSError:
        return stream
    if start > 0:  # the first line is cut: start after it
        text = text[text.find("\n") + 1:]
    lines = [line for line in text.rsplit("\n", END_LINES + 1)[-END_LINES - 1:] if line.strip()]
    taken = 0
    for ev in decoded(lines[:-END_LINES - 1:-1]):
        taken += 1
        if isinstance(ev, dict) and "event" in ev:
            stream.events.append(ev)
            if ev.get("event") in PROGRESS_EVENTS:
                break
        else:
            stream.bad_lines += 1
    stream.events.reverse()
    stream.skipped = max(0, size - sum(len(line) + 1 for line in lines[len(lines) - taken:]))
    return stream


def file_end(path: Path, nbytes: int, min_lines: int, max_bytes: int = TAIL_MAX_BYTES) -> tuple[str, int, int]:
    """(the text of the file's last ``nbytes`` or more, where it starts, the file's size): read
    back further, up to ``max_bytes``, while it holds ``min_lines`` lines or fewer."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        while True:
            start = max(0, size - nbytes)
            data = os.pread(fd, size - start, start)
            if start == 0 or data.count(b"\n") > min_lines or nbytes >= max_bytes:
                return data.decode("utf-8", errors="replace"), start, size
            nbytes *= 2
    finally:
        os.close(fd)


def decoded(lines: list[str]):
    """Each line's JSON value as ``json.loads`` gives it, None for one that is not JSON, as they
    are asked for. orjson decodes the line where it is installed (four times faster: status of a
    job of thousands of ranks decodes a hundred thousand lines); what it refuses (``NaN``, the
    writer's word for a diverged loss) is decoded as without it: a line that is one value from
    its first character to its last (the writer's lines) by ``raw_decode`` without
    ``json.loads``'s wrappers, a quarter faster than it; any other by ``json.loads``."""
    for line in lines:
        if _fast_loads is not None:
            try:
                yield _fast_loads(line)
                continue
            except _FastError:
                pass
        try:
            value, end = _RAW_DECODE(line)
            if end == len(line):
                yield value
                continue
        except ValueError:
            pass
        try:
            yield json.loads(line)
        except ValueError:
            yield None


def restart_of(e: dict) -> int:
    return to_int(e.get("restart"), 0)


def over_budget(paths: list[Path]) -> bool:
    """True when the event files together are larger than FULL_READ_BYTES."""
    total = 0
    for p in paths:
        total += file_size(p)
        if total > FULL_READ_BYTES:
            return True
    return False


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
                write=None, interval: float = 0.5, kind: str = "log") -> None:
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
            time.sleep(interval)
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
