"""How a wrapped command ended, in the run logs' words: the ``end`` status, and for a failure the
``error`` event's fields, taken from the command's own output when it left a Python traceback.

The rules (docs/scripts.md, "Events"):

- exit 0 -> ``completed``; exit 75 (EX_TEMPFAIL, what ``ddp_hpc.preemption.requeue()`` and the
  training core exit with) -> ``preempted``;
- anything else after the wrapper passed on SIGINT -> ``interrupted``, after SIGTERM -> ``killed``,
  and death by any signal the wrapper passed on -> ``killed``: consequences of someone stopping
  the job (scancel, srun's --kill-on-bad-exit, Ctrl-C, the launcher stopping the other ranks), so
  no ``error`` event, which would hide the rank that really failed;
- anything else -> ``failed``, with an ``error`` event: the error ``torch.distributed.elastic``'s
  ``@record`` wrote to the rank's error file, else the child's last Python traceback in
  ``rank<R>.out`` (written after it started), else "exited with status N" / "killed by signal N"
  (with the stack faulthandler wrote to ``rank<R>.fault`` for a native crash);
- a death by SIGABRT / SIGSEGV / SIGBUS *after* the instrumented script's Python part ended
  (its exit record, ``ddp_hpc.instrument.ending``) is a crash in the interpreter's native
  teardown: the rank ends as its script did (``completed`` for 0, with ``teardown`` naming the
  signal), and the wrapper exits with the script's own code;
- so is a death by a signal the wrapper passed on when the exit record was written *before* that
  signal came: the script had already ended (an uncaught exception: ``failed``, with its
  traceback), and the stop only cut its native teardown short. On a loaded machine a rank's
  teardown after its exception outlasted its peer's reaction: the peer saw the connection close,
  failed and exited first, the launcher stopped the others, and the rank that raised read as
  stopped.
"""
from __future__ import annotations

import dataclasses
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ddp_hpc.exits import EX_TEMPFAIL, exit_status_of_signal, signal_name, signal_of_exit_status
from ddp_hpc.judge.srun import exception_of, traceback_in
from ddp_hpc.judge.tails import read_events

TRACEBACK_MARK = b"Traceback (most recent call last):"
TAIL_BYTES = 1 << 20     # how much of the end of the output is read for a traceback


@dataclass(frozen=True)
class Outcome:
    status: str               #: completed | failed | preempted | killed | interrupted
    exit_code: int | None     #: the child's exit code; None when a signal killed it
    signal: str | None        #: the signal that killed the child ("SIGKILL"), else None
    exit_status: int          #: what the wrapper exits with: the exit code, or 128 + signal number
    is_cause: bool            #: the child failed on its own: write an error event
    teardown: str | None = None   #: the signal that killed it in native teardown, after its exit record


#: signals of a native crash; after the script's exit record, a crash of the teardown
TEARDOWN_SIGNALS = (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS)


def classify(returncode: int, forwarded: Sequence[int], ending: dict | None = None,
             stopped_at: float | None = None) -> Outcome:
    """`Popen.returncode` (negative: killed by that signal) and the signals the wrapper passed on,
    in order, to the ``end`` status and the wrapper's exit status; ``ending``: the instrumented
    script's exit record, when it wrote one; ``stopped_at``: when the first signal to pass on came."""
    signum = -returncode if returncode < 0 else None
    if signum in TEARDOWN_SIGNALS and ending is not None and signum not in forwarded:
        return dataclasses.replace(classify(int(ending["code"]), forwarded), teardown=signal_name(signum))
    if signum in forwarded and ending is not None and _ended_before(ending, stopped_at):
        # the script's Python part had ended on its own (an uncaught exception, its exit code)
        # before the stop came, which only cut its teardown short: a rank that raised while its
        # peers were being stopped is the cause, not one more of the stopped
        return dataclasses.replace(classify(int(ending["code"]), ()), teardown=signal_name(signum))
    code = None if signum else returncode
    name = signal_name(signum) if signum else None
    status_code = exit_status_of_signal(signum) if signum else returncode
    stops = [s for s in forwarded if s in (signal.SIGINT, signal.SIGTERM)]
    if returncode == 0:
        status = "completed"
    elif returncode == EX_TEMPFAIL:
        status = "preempted"
    elif stops:
        status = "interrupted" if stops[0] == signal.SIGINT else "killed"
    elif signum in forwarded:
        status = "killed"
    else:
        return Outcome("failed", code, name, status_code, True)
    return Outcome(status, code, name, status_code, False)


def _ended_before(ending: dict, stopped_at: float | None) -> bool:
    """The script's uncaught exception (not an exit it chose, nor Ctrl-C's KeyboardInterrupt,
    which the record never counts) was recorded before the first signal the wrapper passed on
    came. Only an exception: a stop that reaches the script's process group directly can end it
    (``sys.exit`` from a signal handler, Ctrl-C) before the wrapper's own handler runs."""
    at = ending.get("at")
    return (str(ending.get("how", "")).startswith("exception ") and isinstance(at, (int, float))
            and stopped_at is not None and at < stopped_at)


def _tail(path: Path, start: int) -> bytes:
    """What was appended to ``path`` after offset ``start`` (at most its last TAIL_BYTES)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size <= start:
                return b""
            f.seek(max(start, size - TAIL_BYTES))
            return f.read()
    except OSError:
        return b""


def traceback_since(path: Path, start: int) -> list[str] | None:
    """The last Python traceback written to ``path`` after offset ``start``, or None."""
    tail = _tail(path, start)
    if TRACEBACK_MARK not in tail:
        return None
    with tempfile.NamedTemporaryFile(suffix=".out") as f:   # read this run's part, not the file's
        f.write(tail)
        f.flush()
        return traceback_in(Path(f.name))


def error_fields(outcome: Outcome, out_path: Path | None, out_start: int,
                 recorded: dict | None = None, fault: str | None = None) -> dict:
    """The ``error`` event's fields for a child that failed on its own: ``recorded`` (the
    elastic error file's exc_type / message / traceback) first, then a traceback in its output,
    then its exit status or signal (``fault``: the native-crash stack)."""
    block = traceback_since(out_path, out_start) if out_path and outcome.exit_code else None
    if recorded:
        fields = dict(recorded)
    elif block:
        exc_type, message = exception_of(block)
        fields = {"exc_type": exc_type or "Exited", "message": message or "",
                  "traceback": "\n".join(block) + "\n"}
    elif outcome.signal:
        signum = signal_of_exit_status(outcome.exit_status)
        fields = {"exc_type": "Signal", "message": f"killed by signal {signum} ({outcome.signal})",
                  "traceback": fault}
    else:
        fields = {"exc_type": "Exited", "message": f"exited with status {outcome.exit_code}",
                  "traceback": None}
    return {**fields, "exit_code": outcome.exit_code, "signal": outcome.signal}


def last_step(events_path: Path | None, start: int, rank: int) -> int | None:
    """The step of rank ``rank``'s newest ``step`` event appended to ``events_path`` (its node's
    event file) after offset ``start`` (what the child reported through ``ddp_hpc.report``), or of
    a ``progress`` event of phase ``step`` (the number of a step the throttle held back,
    `ddp_hpc.progress`), or None."""
    if events_path is None:
        return None
    for event in reversed(read_events(events_path, since=start).events):
        if event.get("rank") != rank:
            continue
        if (event.get("event") == "step" or event.get("event") == "progress" and event.get("phase") == "step") \
                and isinstance(event.get("step"), int):
            return event["step"]
    return None
