"""Plain-text rank output: Python tracebacks, srun's task exit reports, file tails.

The run logs' JSONL events are the first witness of a failure; these helpers read what is left
when a rank died before it could write an ``error`` event: its stdout/stderr (``rank{R}.out``),
srun's report in the batch output ("srun: error: n2: task 3: Exited with exit code 1", "srun:
error: n2: task 3: Killed", "srun: error: Node failure on n2") and the local driver's line
("ddp_hpc local: job local-x FAILED: rank 3 exited with -9").
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ddp_hpc.exits import signal_of_exit_status, signal_text
from ddp_hpc.slurm.hostlist import HostlistError, expand

#: srun prints a signalled task with strsignal(3)'s words: the word -> the signal number
SIGNAL_WORDS = {"Out Of Memory": 9, "Killed": 9, "Terminated": 15, "Segmentation fault": 11, "Aborted": 6,
                "Bus error": 7, "Interrupt": 2, "Hangup": 1, "Floating point exception": 8,
                "Illegal instruction": 4, "User defined signal 1": 10, "User defined signal 2": 12}
#: srun's report of a task's exit: "srun: error: n2: task 3: Exited with exit code 1",
#: "srun: error: n1: tasks 0-1: Killed".
SRUN_EXIT_RE = re.compile(
    r"(?:(?P<host>[\w.\-\[\],]+): )?tasks? (?P<tasks>[\d,\-]+): (?:Exited with exit code (?P<code>\d+)|"
    r"(?P<word>" + "|".join(SIGNAL_WORDS) + r"))")
#: srun / slurmstepd stopping the whole step: reports after one of these are of tasks it stopped
ABORT_RE = re.compile(r"srun: (?:Terminating|Job step aborted|forcing job termination)|"
                      r"\*\*\* (?:STEP|JOB) \S+ ON \S+ CANCELLED")
#: what the supervisor (``ddp_hpc.supervise``) writes to the batch output, in which srun reports too:
#: a step it starts, and a step it stops. It stops one by killing its tasks at once (``scancel
#: --signal=KILL JOB.STEP``), which srun reports as "task 1: Killed" with no line of its own before
#: them: a report after the supervisor's stop (and before the next start) is of a task it stopped.
SUPERVISOR_PREFIX = "ddp_hpc supervise:"
SUPERVISOR_RE = re.compile(r"^ddp_hpc supervise: (?:(?P<start>starting the step of run \d+)|"
                           r"(?P<stop>stopping the step of run \d+))")
#: Slurm's words for a lost node: srun's "Node failure on n2", slurmstepd's "... DUE TO NODE FAILURE"
NODE_FAILURE_RE = re.compile(r"Node failure on (?P<nodes>\S+)|(?P<stepd>DUE TO NODE FAILURE)")
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?::\s?(.*))?$")
#: torch.distributed prefixes every line of an uncaught exception with the rank: "[rank3]: "
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")
#: the local backend's driver (local-driver.out): "FAILED: rank 3 exited with -9; see ..."
LOCAL_EXIT_RE = re.compile(r"(?:task (?P<task>\d+) \S+ )?FAILED: rank (?P<rank>\d+) exited with (?P<rc>-?\d+)")


@dataclass
class TaskReport:
    """srun's (or the local driver's) word on how one task ended. ``order``: position among the
    reports (the first task to end abnormally comes first); ``after_abort``: reported after srun
    began stopping the whole step, so it was stopped rather than failing on its own."""

    task: int
    exit_code: int | None  # None when a signal ended it
    signal: int | None
    order: int
    host: str | None = None
    after_abort: bool = False
    source: str = "srun"
    oom: bool = False  # srun's "Out Of Memory": the kernel's OOM killer (cgroup limit)

    @property
    def signal_text(self) -> str | None:
        return signal_text(self.signal) if self.signal else None


def task_reports(paths) -> dict[int, TaskReport]:
    """Each task's newest report in the batch output files (``slurm-*.out``), in file order."""
    lines = [ln for p in paths for ln in _read_text(Path(p)).splitlines()]
    found: list[tuple[int, re.Match]] = [(i, m) for i, ln in enumerate(lines)
                                         for m in SRUN_EXIT_RE.finditer(ln)]
    out: dict[int, TaskReport] = {}
    for i, m in found:
        code = int(m.group("code")) if m.group("code") else None
        sig = SIGNAL_WORDS.get(m.group("word") or "")
        if code is not None:  # above 128 from a shell or the exec wrapper: 128 + the signal
            sig = signal_of_exit_status(code) or sig
        for task in _expand_ids(m.group("tasks")):
            out[task] = TaskReport(task, code, sig, i, m.group("host"),
                                   oom=m.group("word") == "Out Of Memory")
    first = min((r.order for r in out.values()), default=0)
    aborts = [i for i, ln in enumerate(lines) if i >= first and ABORT_RE.search(ln)]
    ours = [(i, m.group("stop") is not None) for i, ln in enumerate(lines) if (m := SUPERVISOR_RE.match(ln))]
    for r in out.values():
        before = [stop for i, stop in ours if i < r.order]
        r.after_abort = any(a < r.order for a in aborts) or bool(before and before[-1])
    return out


def starting_line(restart: int) -> str:
    """The supervisor's line as it starts run ``restart``'s step (`SUPERVISOR_RE`)."""
    return f"starting the step of run {restart}"


def stopping_line(restart: int, why: str) -> str:
    """The supervisor's line as it stops run ``restart``'s step (`SUPERVISOR_RE`)."""
    return f"stopping the step of run {restart}: {why}"


def node_failures(paths) -> tuple[bool, list[str]]:
    """(Slurm reported a node failure, the nodes it named) from batch output files."""
    seen, nodes = False, []
    for p in paths:
        for m in NODE_FAILURE_RE.finditer(_read_text(Path(p))):
            seen = True
            if m.group("nodes"):
                nodes += [n for n in _expand_hosts(m.group("nodes")) if n not in nodes]
    return seen, nodes


def local_reports(path: Path, task: int | None = None) -> dict[int, TaskReport]:
    """The local driver's "FAILED: rank R exited with RC" lines (RC < 0: killed by -RC); of
    array task ``task`` only when given ("task 3 local-x_3 FAILED: ...")."""
    out: dict[int, TaskReport] = {}
    for i, m in enumerate(LOCAL_EXIT_RE.finditer(_read_text(path))):
        if (int(m.group("task")) if m.group("task") else None) != task:
            continue
        rc = int(m.group("rc"))
        out[int(m.group("rank"))] = TaskReport(int(m.group("rank")), rc if rc >= 0 else None,
                                               -rc if rc < 0 else signal_of_exit_status(rc),
                                               i, source="local driver")
    return out


def srun_exit_codes(paths) -> dict[int, int]:
    """Per-task exit codes that srun reported in batch output files (-1: killed by a signal);
    the newest report of a task wins."""
    return {t: (r.exit_code if r.exit_code is not None else -1)
            for t, r in sorted(task_reports(paths).items())}


def traceback_in(path: Path) -> list[str] | None:
    """The last Python traceback block in a text file, or None (torch's ``[rankN]: `` line
    prefixes removed)."""
    return traceback_in_lines(_read_text(path).splitlines())


def traceback_in_lines(raw: list[str]) -> list[str] | None:
    """The last Python traceback block among text lines, or None (see `traceback_in`)."""
    lines = [_RANK_PREFIX.sub("", ln) for ln in raw]
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


def tail_file(path: Path, n: int, max_bytes: int = 1 << 20, since: int = 0) -> list[str]:
    """The last n lines of a file (of what follows byte offset ``since``) without reading more
    than ``max_bytes`` of it."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            start = max(since, size - max_bytes)
            f.seek(start)
            data = f.read()
    except OSError:
        return []
    lines = data.decode("utf-8", errors="replace").splitlines()
    if start > since and lines:
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


def _expand_hosts(text: str) -> list[str]:
    try:
        return expand(text.strip().rstrip(".,"))
    except (HostlistError, ValueError):
        return [text.strip().rstrip(".,")]


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
