"""A run's events by rank, from either layout of its log directory: one ``node{K}.events.jsonl``
per node (each line with its rank: ``runlogs.nodelog``) or, from earlier versions, one
``rank{R}.events.jsonl`` per rank.

A node file is read as `tails` reads a rank's file -- whole, its window (head and tail) or only
its ending -- with the budgets of `NODE_RANKS` ranks, and split into one `RankStream` per rank
(its ``path`` the node file). A rank's lines keep the order they were written in, but the node's
writer can append a rank's urgent line (its error, its end) before that rank's batched lines of
the second before: each rank's events are ordered by their time.
"""
from __future__ import annotations

import os
from pathlib import Path

from ddp_hpc.judge.tails import (
    END_BYTES,
    END_LINES,
    HEAD_BYTES,
    PROGRESS_EVENTS,
    TAIL_LINES,
    TAIL_MAX_BYTES,
    RankStream,
    decoded,
    file_end,
    read_events,
    read_window,
    tail_read_bytes,
)
from ddp_hpc.runlogs.schema import EVENTS_RE, NODE_EVENTS_RE, events_file, node_events_file

__all__ = ["NODE_RANKS", "EventFile", "event_files", "read_event_file", "read_node_events", "log_events",
           "rank_events", "merge_streams", "ending"]

#: the ranks per node the read budgets of a node file are scaled by (the GPUs of a big node)
NODE_RANKS = 8
#: a step event's line as the writer writes it (``json.dumps``), told without decoding it
STEP_MARK = '"event": "step"'


class EventFile:
    """One event file of a log directory: a node's (``node`` set) or a rank's (``rank`` set)."""

    __slots__ = ("path", "node", "rank")

    def __init__(self, path: Path, node: int | None = None, rank: int | None = None):
        self.path, self.node, self.rank = path, node, rank


def event_files(log_dir: Path, names: list[str]) -> list[EventFile]:
    """The event files among ``names`` (a listing of ``log_dir``), node files first, by index."""
    nodes, ranks = [], []
    for name in names:
        if m := NODE_EVENTS_RE.match(name):
            nodes.append(EventFile(log_dir / name, node=int(m.group(1))))
        elif m := EVENTS_RE.match(name):
            ranks.append(EventFile(log_dir / name, rank=int(m.group(1))))
    return sorted(nodes, key=lambda f: f.node) + sorted(ranks, key=lambda f: f.rank)


def read_event_file(f: EventFile, window: bool = False, ends: bool = False) -> dict[int, RankStream]:
    """The events of one event file by rank (a rank's file: its one stream)."""
    if f.node is None:
        stream = read_events(f.path, window, ends)
        return {stream.rank: stream}
    return read_node_events(f.path, window, ends)


def read_node_events(path: Path, window: bool = False, ends: bool = False,
                     whole_rank: int | None = None, tail: int = TAIL_LINES) -> dict[int, RankStream]:
    """A node file's events by rank: whole, or its window (``window``: its head and its tail, with
    `NODE_RANKS` times a rank file's budget: ``tail`` lines a rank; of the head its step events
    left out: step times are judged from the tail's, and rank 0's are read whole), or each rank's
    ending (``ends``: its events after its newest step, epoch or start event, and that one, at
    most `tails.END_LINES` of them, from the file's end). With ``window``, ``whole_rank``'s
    events are read whole all the same (rank 0's, on node 0: progress, ETA and eval metrics come
    from them, as from rank 0's own file), the other lines only decoded within the window. Lines
    that are no event are counted on the lowest rank's stream."""
    skipped = 0
    try:
        if window and whole_rank is not None:
            text, skipped = _rank_and_window(path, whole_rank, tail)
        elif ends:
            text, skipped = _end_text(path)
        elif window:
            head, end, skipped = read_window(path, HEAD_BYTES * NODE_RANKS, tail * NODE_RANKS,
                                             tail_read_bytes(tail) * NODE_RANKS, TAIL_MAX_BYTES * NODE_RANKS)
            if skipped:   # of a cut file's head its ranks' starts and rendezvous; their steps are the tail's
                head = "".join(line + "\n" for line in head.splitlines() if STEP_MARK not in line)
            text = head + "\n".join(end.splitlines()[-tail * NODE_RANKS:])
        else:
            text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    streams: dict[int, RankStream] = {}
    bad = 0
    for ev in decoded([line for line in text.splitlines() if line.strip()]):
        rank = ev.get("rank") if isinstance(ev, dict) and "event" in ev else None
        if type(rank) is not int:
            bad += 1
            continue
        s = streams.get(rank)
        if s is None:
            s = streams[rank] = RankStream(rank=rank, path=path, skipped=skipped)
        s.events.append(ev)
    for s in streams.values():
        if s.rank == whole_rank:
            s.skipped = 0
        _in_time_order(s.events)
        if ends:
            s.events = ending(s.events)
    if bad and streams:
        streams[min(streams)].bad_lines += bad
    return streams


def _rank_and_window(path: Path, rank: int, tail_lines: int) -> tuple[str, int]:
    """The lines of ``rank`` (the writer's ``"rank": R,``, told without decoding) and those of the
    window around them; and the bytes of the other lines, not read."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    head, tail = HEAD_BYTES * NODE_RANKS, tail_lines * NODE_RANKS
    mark, taken, size, skipped = f'"rank": {rank},', [], 0, 0
    for i, line in enumerate(lines):
        size += len(line) + 1
        if size <= head or i >= len(lines) - tail or mark in line:
            taken.append(line)
        else:
            skipped += len(line) + 1
    return "\n".join(taken), skipped


def _end_text(path: Path) -> tuple[str, int]:
    """The complete lines of the file's last `END_BYTES` x `NODE_RANKS` bytes (more while they
    hold too few lines), and the bytes before them."""
    text, start, _ = file_end(path, END_BYTES * NODE_RANKS, END_LINES * NODE_RANKS, TAIL_MAX_BYTES * NODE_RANKS)
    if start > 0:                    # the first line is cut: start after it
        cut = text.find("\n") + 1
        text, start = text[cut:], start + len(text[:cut].encode("utf-8"))
    return text, start


def ending(events: list[dict]) -> list[dict]:
    """A rank's ending as `tails` reads it from a rank's file: its newest progress event and what
    follows, at most `END_LINES` events."""
    out = []
    for ev in reversed(events):
        out.append(ev)
        if ev.get("event") in PROGRESS_EVENTS or len(out) >= END_LINES:
            break
    out.reverse()
    return out


def _in_time_order(events: list[dict]) -> None:
    """Order a rank's events by their time where the node's writer appended one early."""
    times = [e.get("time") for e in events]
    if all(isinstance(t, (int, float)) for t in times) and any(a > b for a, b in zip(times, times[1:])):
        events.sort(key=lambda e: e["time"])


def merge_streams(into: dict[int, RankStream], more: dict[int, RankStream]) -> None:
    """Add ``more``'s streams to ``into``; a rank in both (its node changed at a restart, or a
    directory with both layouts) gets the events of both, by time."""
    for rank, s in more.items():
        have = into.get(rank)
        if have is None:
            into[rank] = s
            continue
        have.events = have.events + s.events
        have.events.sort(key=lambda e: e.get("time") if isinstance(e.get("time"), (int, float)) else 0.0)
        have.bad_lines += s.bad_lines
        have.skipped += s.skipped


def log_events(log_dir: str | Path) -> dict[int, RankStream]:
    """Every rank's events in ``log_dir``, read whole ({} without the directory)."""
    d = Path(log_dir)
    try:
        names = os.listdir(d)
    except OSError:
        return {}
    out: dict[int, RankStream] = {}
    for f in event_files(d, names):
        merge_streams(out, read_event_file(f))
    return out


def rank_events(log_dir: str | Path, rank: int, node: int | None = None) -> RankStream:
    """One rank's events in ``log_dir``, read whole: its own file where there is one (the earlier
    layout), else from node ``node``'s file, else from every node file (rank 0: node 0's first,
    where launchers put it; the others where an odd task layout put it elsewhere)."""
    d = Path(log_dir)
    own = d / events_file(rank)
    if own.exists():
        return read_events(own)
    if node is None and rank == 0:
        node = 0
    if node is not None:
        got = _rank_from(rank, [d / node_events_file(node)])
        if got.events:
            return got
    try:
        paths = [f.path for f in event_files(d, os.listdir(d)) if f.node is not None and f.node != node]
    except OSError:
        paths = []
    return _rank_from(rank, paths, d / node_events_file(node if node is not None else 0))


def _rank_from(rank: int, paths: list[Path], default: Path | None = None) -> RankStream:
    found: dict[int, RankStream] = {}
    for p in paths:
        if p.exists():
            merge_streams(found, {r: s for r, s in read_node_events(p).items() if r == rank})
    return found.get(rank) or RankStream(rank=rank, path=default or (paths[0] if paths else Path(".")))
