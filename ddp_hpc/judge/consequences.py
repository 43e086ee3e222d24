"""The words of an attribution: the first failure line, what followed from it ("ranks 0-2: lost
their peer rank 3 (Connection reset by peer)"), and the stacks the ranks wrote.

`ddp_hpc.judge.attribution` decides who is to blame; this module only relabels the ranks whose
failure followed the blamed one and puts the result in words, so the status views and JSON show
the same sentences.
"""
from __future__ import annotations

from ddp_hpc.exits import signal_name
from ddp_hpc.judge.evidence import RankEnding
from ddp_hpc.judge.stacks import stack_excerpt, stack_summary
from ddp_hpc.judge.tails import RunFiles

#: kinds that are shown neither as blamed nor as a consequence
_QUIET = ("completed", "preempted", "running")


def ranks_text(ranks: list[int]) -> str:
    """``[3]`` -> ``rank 3``; ``[0, 1, 2, 5]`` -> ``ranks 0-2,5``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + compress(sorted(ranks))


def compress(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    out, start = [], None
    for i, r in enumerate(ranks):
        start = r if start is None else start
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(r) if start == r else f"{start}-{r}")
            start = None
    return ",".join(out)


def failure_lines(f) -> list[str]:
    """A `ddp_hpc.judge.attribution.Failure` in words, as ``ddp-hpc status JOB`` and
    ``submit --wait`` show it: the first failure line, what followed from it, the blamed rank's
    stack and where the others were, and the tail of its traceback."""
    head = f.summary
    if not head:  # a Failure made elsewhere (no attribution): today's words
        where = f" on {f.host}" if f.host else ""
        what = f.message if f.exc_type in ("Exited", "Signal") and f.message else \
            ": ".join(x for x in (f.exc_type, f.message) if x)
        head = f"rank {f.rank}{where} (restart {f.restart}, from {f.basis})" + (f": {what}" if what else "")
    out = [f"First failure: {head}"]
    out += [f"    {ranks_text(c['ranks'])}: {c['text']}" for c in f.consequences]
    if f.kind in ("killed", "vanished", "stuck"):
        out.append(f"    how we know: {f.basis} (restart {f.restart})")
    if f.stack and f.stack.get("summary"):
        why = f" ({f.stack['reason']})" if f.stack.get("reason") else ""
        out.append(f"    rank {f.rank} was in {f.stack['summary']}{why}:")
        out += [f"        {ln}" for ln in f.stack.get("lines", [])]
    out += [f"    {ranks_text(p['ranks'])} {'was' if len(p['ranks']) == 1 else 'were'} in {p['summary']}"
            for p in f.peer_stacks]
    return out + [f"    {ln}" for ln in f.traceback_tail]


def relabel(endings: dict[int, RankEnding], blamed: list[RankEnding]) -> None:
    """Ranks whose ending followed the blamed one's: srun's kills reported after it are srun
    stopping the step; errors written after a killed, lost, stuck or vanished rank's last event
    are consequences of losing it."""
    p, names = blamed[0], {e.rank for e in blamed}
    for e in endings.values():
        if e.rank in names:
            continue
        if (e.kind == "killed" and not e.from_event and e.report_order is not None
                and p.report_order is not None and e.report_order > p.report_order):
            e.kind, e.text = "stopped", f"stopped by {signal_name(e.signal or 9)}"
        elif (e.kind == "raised" and p.kind in ("killed", "lost", "stuck", "vanished")
              and e.time is not None and p.last_time is not None and e.time > p.last_time):
            e.kind, e.phrase = "consequence", e.text


def headline(p: RankEnding, blamed: list[RankEnding], restart: int) -> str:
    """The first failure line after "First failure: "."""
    where = f" on {p.host}" if p.host else ""
    if p.kind == "vanished":
        who = ranks_text([e.rank for e in blamed])
        if p.basis.startswith("every rank"):
            return f"node {p.host} lost: {who} vanished without end events while the others failed"
        return f"node {p.host} failed ({p.basis}): {who} vanished"
    if p.kind in ("killed", "stuck"):
        return f"rank {p.rank}{where} {p.text}"
    what = "" if p.kind == "lost" else p.text
    return f"rank {p.rank}{where} (restart {restart}, from {p.basis})" + (f": {what}" if what else "")


def lines(endings: dict[int, RankEnding], blamed: list[RankEnding]) -> list[dict]:
    """What happened to every other rank that did not end well, grouped: {ranks, text}."""
    p, names = blamed[0], {e.rank for e in blamed}
    groups: dict[str, list[int]] = {}
    texts: dict[str, tuple[str, str]] = {}
    for e in sorted(endings.values(), key=lambda e: e.rank):
        if e.rank in names or e.kind in _QUIET:
            continue
        one, many = _followed(e, p)
        groups.setdefault(many, []).append(e.rank)
        texts[many] = (one, many)
    return [{"ranks": rs, "text": texts[k][0] if len(rs) == 1 else texts[k][1]}
            for k, rs in groups.items()]


def _followed(e: RankEnding, p: RankEnding) -> tuple[str, str]:
    """(singular, plural) words for what happened to rank ``e`` given the blamed rank ``p``."""
    peer = f"node {p.host}" if p.kind == "vanished" else f"rank {p.rank}"
    if e.kind == "consequence":
        why = f" ({e.phrase})" if e.phrase else ""
        if p.kind == "consequence":
            return f"lost a peer too{why}", f"lost a peer too{why}"
        if p.kind == "stuck" and e.timed_out:
            return f"timed out waiting for {peer}{why}", f"timed out waiting for {peer}{why}"
        if p.kind == "vanished":
            return f"lost its peers on {p.host}{why}", f"lost their peers on {p.host}{why}"
        return f"lost its peer {peer}{why}", f"lost their peer {peer}{why}"
    if e.kind == "stopped":
        how = e.text.replace("stopped by ", "") if e.text.startswith("stopped by ") else e.text
        return (f"stopped after {peer} failed ({how})",) * 2
    if e.kind == "raised" and (e.exc_type, e.message) == (p.exc_type, p.message):
        return ("raised the same error",) * 2
    if e.kind == "lost":
        return ("left no end event",) * 2
    if e.kind == "stuck":
        return (f"also stuck ({e.text.removeprefix('stuck: ')})",) * 2
    if e.kind == "vanished":
        return (f"vanished with node {e.host}",) * 2
    return (f"also {e.text}" if e.kind in ("killed",) else f"also failed: {e.text}",) * 2


def stacks(logs: RunFiles, restart: int, p: RankEnding,
           endings: dict[int, RankEnding]) -> tuple[dict | None, list[dict]]:
    """(the blamed rank's newest ``stack`` event in words, where the other ranks were by their
    newest stack events, grouped)."""
    newest: dict[int, dict] = {}
    for rank, stream in logs.ranks.items():
        evs = [e for e in stream.of_restart(restart) if e.get("event") == "stack" and e.get("stack")]
        if evs:
            newest[rank] = evs[-1]
    own = None
    if (ev := newest.get(p.rank)) is not None:
        text = str(ev.get("stack"))
        own = {"summary": stack_summary(text), "reason": ev.get("reason"), "time": ev.get("time"),
               "lines": stack_excerpt(text)}
    groups: dict[str, list[int]] = {}
    for rank, ev in sorted(newest.items()):
        if rank != p.rank and (s := stack_summary(str(ev.get("stack")))):
            groups.setdefault(s, []).append(rank)
    return own, [{"ranks": rs, "summary": s} for s, rs in groups.items()]
