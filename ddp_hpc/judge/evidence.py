"""How one rank's run ended, from its own evidence: its ``error`` / ``end`` events, its
``rank{R}.out`` and srun's (or the local driver's) report of its exit.

`own_ending` gives each rank a first classification; `ddp_hpc.judge.attribution` then weighs
the ranks against each other (a node lost, a rank stuck while the others timed out) and names
the primary cause. The kinds (docs/status.md, "Who broke the job"):

- ``raised``: an ``error`` event (or a traceback in ``rank{R}.out``) that is not a consequence;
- ``exited``: a non-zero exit with no Python error (srun's "Exited with exit code 7");
- ``killed``: a signal ended it: the exec wrapper's error/end event names one (SIGKILL...), or
  srun reports "task 3: Killed" / exit code 128+N, or the local driver "exited with -9";
- ``consequence``: it failed because a peer did: gloo/NCCL "Connection reset/closed by peer",
  "Timed out waiting ... for send/recv", watchdog and ProcessGroupNCCL timeouts, "Broken pipe";
- ``stopped``: stopped from outside (a SIGTERM/SIGINT passed on by the exec wrapper, or srun
  stopping the step after another task failed);
- ``completed`` / ``preempted``: its ``end`` event says so;
- ``silent``: no end, no error, no report: decided later (``lost``, ``stuck``, ``vanished``,
  ``running``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields

from ddp_hpc.exits import signal_name, signal_number, signal_text
from ddp_hpc.judge.srun import TaskReport, exception_of
from ddp_hpc.parsing import to_float

#: failures caused by a peer that died, hung or vanished, most telling first; the match is what
#: status shows. gloo's "Application timeout caused pair closure" fails a collective when another
#: of the rank's collectives (an asynchronous one started earlier) timed out waiting for a peer:
#: gloo then closes every connection of the group.
CONSEQUENCES = tuple(re.compile(p, re.IGNORECASE) for p in (
    r"Connection (?:reset|closed) by peer", r"Broken pipe",
    r"Timed out waiting \d+\s*ms for \w+", r"Application timeout caused pair closure",
    r"Watchdog caught collective operation timeout",
    r"Some NCCL operations have failed or timed out", r"NCCL communicator was aborted",
    r"remote process exited or there was a network error", r"Timed out waiting[^.\n\[]{0,40}",
    r"NCCL watchdog[^.\n]{0,40}", r"ProcessGroupNCCL[^\n]{0,60}?time(?:d)? ?out", r"Socket Timeout",
    r"DistNetworkError"))
#: the consequences that are a collective timeout: a peer never arrived (stuck, not gone)
TIMEOUT_RE = re.compile(r"time(?:d)? ?out|watchdog", re.IGNORECASE)
#: a wrapper's words for "the command failed" that hide the command's own error
_WRAPPER_WORDS = re.compile(r"exited with (?:exit )?status -?\d+|exited with code -?\d+", re.I)
#: a rank's own last error line when it left no traceback ("ddp_hpc run: error: ...")
_ERROR_LINE = re.compile(r"\berror\b:?\s", re.IGNORECASE)
#: signals that mean "stopped from outside" (scancel, Ctrl-C, srun ending the step)
STOP_SIGNALS = frozenset({1, 2, 15})
#: torch's error when a stop signal (srun ending the step, scancel) reached a DataLoader worker
#: before the rank's own handler did: the rank was stopped, it did not fail ("Killed" is left out:
#: the OOM killer's SIGKILL of a worker is a failure of its own)
_WORKER_STOPPED = re.compile(r"DataLoader worker \(pid[^)]*\) is killed by signal: (Terminated|Interrupt|Hangup)")
_STRSIGNAL = {"Terminated": 15, "Interrupt": 2, "Hangup": 1}


@dataclass
class RankEnding:
    """One rank's ending in one run: its kind (see the module docstring), the words status shows
    (``text``), how we know (``basis``) and the times that order the ranks."""

    rank: int
    host: str | None
    kind: str
    text: str = ""
    basis: str = ""
    time: float | None = None       # when its error/end event was written
    last_time: float | None = None  # its newest event other than ``stack``
    last_step: int | None = None
    last_event: str | None = None
    exc_type: str | None = None
    message: str | None = None
    traceback: list[str] | None = None
    signal: int | None = None
    exit_code: int | None = None
    phrase: str | None = None       # the consequence text matched
    from_event: bool = False        # the rank wrote this itself (events), not srun about it
    report_order: int | None = None
    after_abort: bool = False
    gap_s: float | None = None      # stuck: how much older its last event is than the others'
    waited: str | None = None       # the collective its watchdog stack showed it waiting in, before it failed

    def to_dict(self) -> dict:
        """Every field but the traceback (all plain values: no deep copy, which cost seconds over
        8,192 ranks in bench/scale.py)."""
        return {name: getattr(self, name) for name in _DICT_FIELDS}

    @property
    def timed_out(self) -> bool:
        """It failed in a collective that timed out waiting for a peer: its words say so, or its
        stack showed it waiting in the collective before it failed."""
        return self.kind == "consequence" and bool(self.waited or TIMEOUT_RE.search(self.phrase or ""))

    @property
    def spoke(self) -> bool:
        """It wrote how it ended (it was alive to tell)."""
        return self.from_event or self.kind == "consequence"


#: what `RankEnding.to_dict` gives: every field but the traceback
_DICT_FIELDS = tuple(f.name for f in fields(RankEnding) if f.name != "traceback")


def consequence_phrase(*texts: object) -> str | None:
    """The consequence words (see CONSEQUENCES) of the first text that has any, trimmed."""
    for t in texts:
        for pattern in CONSEQUENCES if t else ():
            if m := pattern.search(str(t)):
                return m.group(0).strip().rstrip(":,;")
    return None


def own_error_line(lines: list[str]) -> str | None:
    """The last line of a rank's output that reports an error in words ("error: ..."), outside
    srun's and slurmstepd's own lines."""
    for ln in reversed(lines):
        s = ln.strip()
        if s and _ERROR_LINE.search(s) and not s.startswith(("srun:", "slurmstepd:")):
            return s
    return None


def own_ending(rank: int, events: list[dict], out_tb: list[str] | None, out_tail: list[str],
               report: TaskReport | None, out_name: str) -> RankEnding:
    """Classify one rank from its events of one run (file order), the traceback in its
    ``rank{R}.out`` (None: none), that file's last lines and srun's report (None: none)."""
    last = next((e for e in reversed(events) if e.get("event") != "stack"), None)
    step = next((s for e in reversed(events) if e.get("event") != "stack" and isinstance(s := e.get("step"), int)),
                None)
    host = next((e.get("host") for e in reversed(events) if e.get("host")), None) or (
        report.host if report is not None else None)
    base = RankEnding(rank, host, "silent", last_time=to_float(last.get("time")) if last else None,
                      last_step=step, last_event=last.get("event") if last else None)
    if report is not None:
        base.report_order, base.after_abort = report.order, report.after_abort
    errors = [e for e in events if e.get("event") == "error"]
    end = next((e for e in reversed(events) if e.get("event") == "end"), None)
    if errors:
        return _from_error(base, _pick(errors), end, out_tb, out_tail, out_name)
    if end is not None:
        return _from_end(base, end, out_tb, out_tail, out_name)
    killed = _killed_first(report)
    if out_tb and not killed:
        exc_type, message = exception_of(out_tb)
        return _words(base, exc_type, message, out_tb, f"traceback in {out_name}", out_tail)
    if not killed and (phrase := consequence_phrase(*reversed(out_tail))):
        return _set(base, "consequence", phrase, out_name, phrase=phrase)
    if report is not None:
        return _from_report(base, report)
    return base


def _killed_first(report: TaskReport | None) -> bool:
    """srun reports the rank killed by a signal of its own (not a stop, not NCCL's abort after a
    collective timeout, not one of srun's kills as it ended the step): that outweighs a traceback
    or words in its ``rank{R}.out`` when the rank wrote no event of its end. A SIGKILLed rank's
    DataLoader workers print "ConnectionResetError ... Connection reset by peer" into that file as
    they lose their parent; those are not the rank's own words."""
    return bool(report is not None and report.signal and report.signal not in STOP_SIGNALS | {6}
                and not report.after_abort)


def _pick(errors: list[dict]) -> dict:
    """The error that explains the rank: its first of its own (not a consequence), else its first
    consequence, else its first. A wrapper's bare exit status (``Exited``: "exited with status 1",
    no traceback) comes last: it only repeats how the process ended, so a rank whose script wrote
    that it lost a peer stays a victim whatever its exit code."""
    def bare(e: dict) -> bool:
        return e.get("exc_type") == "Exited" and not e.get("traceback")

    for e in errors:
        if not bare(e) and not consequence_phrase(e.get("message"), e.get("exc_type")):
            return e
    return next((e for e in errors if not bare(e)), errors[0])


def _from_error(base: RankEnding, e: dict, end: dict | None, out_tb, out_tail,
                out_name: str) -> RankEnding:
    base.time, base.from_event = to_float(e.get("time")), True
    base.exit_code = e.get("exit_code") if isinstance(e.get("exit_code"), int) else None
    sig = signal_number(e.get("signal")) or (signal_number(end.get("signal")) if end else None)
    if sig and (e.get("exc_type") == "Signal" or base.exit_code is None):
        phrase = consequence_phrase(*reversed(out_tail)) if sig == 6 else None
        if phrase:  # NCCL's watchdog aborts the process after a collective timeout
            return _set(base, "consequence", phrase, f"error event; {out_name}", phrase=phrase,
                        signal=sig)
        # a native crash of an instrumented script: faulthandler's stack as its traceback
        stack = str(e.get("traceback") or "").rstrip("\n").splitlines() or None
        return _set(base, "killed", f"killed by {signal_text(sig)}", "error event", signal=sig,
                    exc_type=e.get("exc_type"), message=e.get("message"), traceback=stack)
    exc_type, message = e.get("exc_type"), e.get("message")
    tb = str(e.get("traceback") or "").rstrip("\n").splitlines() or None
    wrapper = exc_type in ("Exited", "Signal") or _WRAPPER_WORDS.search(str(message or ""))
    if wrapper and out_tb:  # a wrapper's "exited with status 2": the rank's own traceback first
        exc_type, message = exception_of(out_tb)
        tb = out_tb
    elif wrapper and (line := own_error_line(out_tail)):  # its own words first, the wrapper's below
        tb = (tb or []) + ([_said(exc_type, message)] if tb is None else [])
        return _words(base, None, line, tb, f"error event; {out_name}", out_tail)
    if exc_type == "Exited" and not tb:  # a status, no Python error: the wrapper's words alone
        return _set(base, "exited", _said(exc_type, message), "error event", exc_type=exc_type, message=message)
    return _words(base, exc_type, message, tb, "error event", out_tail)


def _said(exc_type, message) -> str:
    """An error in words: ``ValueError: bad batch``; the exec wrapper's "Exited" / "Signal" (not
    exception names) as their message alone: ``exited with status 3``."""
    if exc_type in ("Exited", "Signal") and message:
        return str(message)
    return ": ".join(str(x) for x in (exc_type, message) if x)


def _from_end(base: RankEnding, end: dict, out_tb, out_tail, out_name: str) -> RankEnding:
    base.time, base.from_event = to_float(end.get("time")), True
    status = str(end.get("status"))
    sig = signal_number(end.get("signal"))
    code = end.get("exit_code") if isinstance(end.get("exit_code"), int) else None
    if status in ("completed", "preempted"):  # teardown: a native abort after the script ended
        after = f"; then {end['teardown']} in native teardown" if end.get("teardown") else ""
        return _set(base, status, status + after, "end event", exit_code=code)
    if status in ("killed", "interrupted"):  # a SIGTERM/SIGINT the exec wrapper passed on
        how = f" by {signal_name(sig)}" if sig else ""
        word = "stopped" if status == "killed" else status
        return _set(base, "stopped", f"{word}{how}", "end event", signal=sig, exit_code=code)
    if sig:
        return _set(base, "killed", f"killed by {signal_text(sig)}", "end event", signal=sig)
    if out_tb:
        exc_type, message = exception_of(out_tb)
        return _words(base, exc_type, message, out_tb, f"traceback in {out_name}", out_tail)
    what = f"{status} (exit {code})" if code else status
    return _set(base, "exited" if status == "failed" else status, what, "end event", exit_code=code)


def _from_report(base: RankEnding, r: TaskReport) -> RankEnding:
    basis = f"{r.source} exit report"
    if r.signal:
        if r.signal in STOP_SIGNALS or r.after_abort:
            return _set(base, "stopped", f"stopped by {signal_name(r.signal)}", basis,
                        signal=r.signal, exit_code=r.exit_code)
        what = "killed by the OOM killer" if r.oom else f"killed by {signal_text(r.signal)}"
        return _set(base, "killed", what, basis, signal=r.signal, exit_code=r.exit_code)
    if r.exit_code:
        return _set(base, "exited", f"exit code {r.exit_code}", basis, exit_code=r.exit_code,
                    message=f"exit code {r.exit_code}")
    return base


def _words(base: RankEnding, exc_type, message, tb, basis: str, out_tail) -> RankEnding:
    """A Python error: a consequence when its words say a peer failed, ``stopped`` when a stop
    signal reached its DataLoader workers first, else ``raised``."""
    if m := _WORKER_STOPPED.search(str(message or "")):
        sig = _STRSIGNAL[m.group(1)]
        return _set(base, "stopped", f"stopped by {signal_name(sig)} via its DataLoader workers", basis,
                    signal=sig, exc_type=exc_type, message=message, traceback=tb)
    tail = (tb or [])[-3:]
    phrase = consequence_phrase(message, exc_type, *reversed(tail))
    return _set(base, "consequence" if phrase else "raised", _said(exc_type, message), basis, phrase=phrase,
                exc_type=exc_type, message=message, traceback=tb)


def _set(base: RankEnding, kind: str, text: str, basis: str, **kw) -> RankEnding:
    base.kind, base.text, base.basis = kind, text, basis
    for k, v in kw.items():
        setattr(base, k, v)
    return base
