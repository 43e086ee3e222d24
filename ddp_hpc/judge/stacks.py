"""Python stacks in the run logs: the ``stack`` event's ``stack`` text, faulthandler's dump of
all threads, turned into one line a user can act on ("loop.py:337 in backward") and a short
excerpt.

faulthandler writes each thread as a block, innermost call first::

    Thread 0x00007f3b2c7fe640 (most recent call first):
      File "/usr/lib/python3.11/threading.py", line 324 in wait
      File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

    Current thread 0x00007f3b3a1c9740 (most recent call first):
      File "/src/ddp_hpc/train/loop.py", line 337 in backward
      File "<frozen runpy>", line 88 in _run_code

The thread that matters is the main thread (the training loop). faulthandler does not name it;
it is the thread whose outermost frame is not ``threading``'s ``_bootstrap`` (every other thread
starts there). When a helper thread wrote the dump (a watchdog before a collective timeout), the
"Current thread" is that helper, so it is preferred only when it is the main thread. Text in
``traceback.format_stack`` order (innermost call last) is read as well.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_HEADER = re.compile(r"^(?P<current>Current thread|Thread) (?P<id>0x[0-9a-fA-F]+)?.*"
                     r"\(most recent call first\):\s*$")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+),? in (?P<func>\S+)')
_THREAD_START = ("_bootstrap", "_bootstrap_inner")
_STDLIB = re.compile(r"/lib/python\d+(\.\d+)?/[^/]+(\.py)?(/|$)")

#: how many lines of the chosen thread the excerpt keeps (its header and the innermost frames)
EXCERPT_LINES = 12


@dataclass
class Thread:
    """One thread of a dump: its header line and its frames, innermost first."""

    header: str
    current: bool
    lines: list[str] = field(default_factory=list)  # the frame lines as written
    frames: list[tuple[str, int, str]] = field(default_factory=list)  # (file, line, function)

    @property
    def started_by_threading(self) -> bool:
        return bool(self.frames) and (self.frames[-1][2] in _THREAD_START
                                      and self.frames[-1][0].endswith("threading.py"))


def threads(text: str) -> list[Thread]:
    """The thread blocks of a faulthandler dump; a traceback-style text (innermost call last)
    becomes one thread with its frames reversed."""
    out: list[Thread] = []
    cur: Thread | None = None
    for ln in str(text or "").splitlines():
        if m := _HEADER.match(ln.strip()):
            cur = Thread(ln.strip(), m.group("current") == "Current thread")
            out.append(cur)
        elif (f := _FRAME.match(ln)) and cur is not None:
            cur.lines.append(ln.rstrip())
            cur.frames.append((f.group("file"), int(f.group("line")), f.group("func")))
    if out:
        return out
    frames = [(ln.rstrip(), f) for ln in str(text or "").splitlines() if (f := _FRAME.match(ln))]
    if not frames:
        return []
    frames.reverse()
    return [Thread("(most recent call first)", True, [ln for ln, _ in frames],
                   [(f.group("file"), int(f.group("line")), f.group("func")) for _, f in frames])]


def main_thread(text: str) -> Thread | None:
    """The thread running the training loop (see the module docstring), or None."""
    blocks = [t for t in threads(text) if t.frames]
    if not blocks:
        return None
    for pick in (lambda t: t.current and not t.started_by_threading,
                 lambda t: not t.started_by_threading, lambda t: t.current):
        found = [t for t in blocks if pick(t)]
        if found:
            return found[0]
    return blocks[0]


def stack_summary(text: str) -> str | None:
    """The innermost frame of the main thread as ``loop.py:337 in backward`` (file name only);
    when that frame is in an installed library (torch), the innermost frame of the program's
    own code follows: ``graph.py:979 in _engine_run_backward, from step.py:56 in micro_batch``.
    None when the text holds no frame."""
    t = main_thread(text)
    if t is None:
        return None
    out = _frame(t.frames[0])
    if _library(t.frames[0][0]):
        own = next((f for f in t.frames[1:] if not _library(f[0])), None)
        if own is not None:
            out += f", from {_frame(own)}"
    return out


def _frame(f: tuple[str, int, str]) -> str:
    return f"{f[0].replace(chr(92), '/').rsplit('/', 1)[-1]}:{f[1]} in {f[2]}"


def _library(path: str) -> bool:
    """Installed packages, the standard library and ddp_hpc's own hooks in a script (not the
    program's own code)."""
    p = path.replace("\\", "/")
    return (p.startswith("<") or "/site-packages/" in p or "/dist-packages/" in p
            or "/ddp_hpc/instrument/" in p or bool(_STDLIB.search(p)))


def collective(text: str) -> str | None:
    """What collective the main thread waits in, in words ("all_reduce", "DDP's all-reduce
    (backward)"), or None when it is not in one: a frame of ``torch.distributed``'s collectives,
    of autograd's backward (where DDP's reducer waits for its gradient all-reduce) or of DDP's
    forward (its buffer broadcast)."""
    t = main_thread(text)
    if t is None:
        return None
    for file, _line, func in t.frames:
        p = file.replace("\\", "/")
        if p.endswith("torch/distributed/distributed_c10d.py"):
            return func
        if p.endswith("torch/nn/parallel/distributed.py"):
            return "DDP's forward (buffer broadcast)"
        if "/torch/autograd/" in p:
            return "DDP's all-reduce (backward)"
    return None


def own_frame(text: str) -> str | None:
    """The innermost frame of the program's own code in the main thread: ``stuck (train.py:17)``."""
    t = main_thread(text)
    if t is None:
        return None
    f = next((f for f in t.frames if not _library(f[0])), t.frames[0])
    return f"{f[2]} ({_frame(f).split(' in ')[0]})"


def hang_line(texts: dict[int, str], ranks_text) -> str | None:
    """A hang in one line from the ranks' stacks (rank -> stack text): the ranks *not* inside a
    collective first, then the collectives the others wait in: ``rank 3 in stuck (train.py:17);
    ranks 0-2 wait in DDP's all-reduce (backward)``. None unless some rank waits in a collective
    and some does not. ``ranks_text`` words a list of ranks ("ranks 0-2")."""
    waits: dict[str, list[int]] = {}
    outside: dict[str, list[int]] = {}
    for r, text in sorted(texts.items()):
        if (c := collective(text)) is not None:
            waits.setdefault(c, []).append(r)
        elif (own := own_frame(text)) is not None:
            outside.setdefault(own, []).append(r)
    if not waits or not outside:
        return None
    parts = [f"{ranks_text(rs)} in {where}" for where, rs in outside.items()]
    parts += [f"{ranks_text(rs)} wait{'s' if len(rs) == 1 else ''} in {c}" for c, rs in waits.items()]
    return "; ".join(parts)


def stack_excerpt(text: str, n: int = EXCERPT_LINES) -> list[str]:
    """The main thread's header and its innermost frames, ``n`` lines at most."""
    t = main_thread(text)
    if t is None or n <= 0:
        return []
    return ([t.header] + [ln.strip() for ln in t.lines])[:n]
