"""How the script's Python part ended, told to ``ddp_hpc.exec`` before the interpreter's native
teardown: one JSON line on a pipe the wrapper gave (``{"code": 0, "how": "end", "at": 1796...}``;
``at``: when, so the wrapper can tell an ending that came before a stop it passed on from one the
stop caused).

Why: with torch 2.13 a script that finished its work can still die in native teardown (static
destructors: "terminate called without an active exception", SIGABRT) after every rank wrote its
results. The wrapper then sees a signal death; with this record it knows the script itself had
ended with code N, and reports the rank as completed (N = 0) with a warning naming the abort.

The record is written by an ``atexit`` handler registered before the script runs, so it runs
after every handler the script and its libraries register (atexit runs them last in, first out):
when it runs, nothing of the script's Python code is left to run. The exit code:

- an exception that reached the top: 1 (Python keeps it in ``sys.last_value`` whatever
  ``sys.excepthook`` the script installed);
- ``sys.exit(n)`` (argparse, click, most scripts), called in the main thread: n;
- Python 3.12 and later also see a ``raise SystemExit(n)`` that leaves the main module
  (``sys.monitoring``'s PY_UNWIND); on 3.11 that case reads as the end of the script (0);
- otherwise the script ran to its end: 0.
"""
from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from typing import Any

__all__ = ["Ending", "watch_ending", "exit_code_of"]

#: the sys.monitoring tool id used on Python 3.12+ (0-2 and 5 are named for debuggers, coverage,
#: profilers and optimizers)
TOOL_ID = 4


def exit_code_of(status: Any) -> int:
    """The process exit code ``sys.exit(status)`` gives: None -> 0, an int -> it, else 1."""
    if status is None:
        return 0
    return status if isinstance(status, int) else 1


class Ending:
    """What is known of how the main module ended; written by `record` at exit."""

    def __init__(self, fd: int, pid: int) -> None:
        self.fd, self.pid = fd, pid
        self.code, self.how = 0, "end"

    def set(self, code: int, how: str) -> None:
        if threading.current_thread() is threading.main_thread():
            self.code, self.how = code, how

    def record(self) -> None:
        if os.getpid() != self.pid:   # a forked child that exits through atexit: not the script
            return
        exc = getattr(sys, "last_value", None)     # set by the interpreter for an uncaught error
        if exc is not None and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
            self.code, self.how = 1, f"exception {type(exc).__name__}"
        try:
            os.write(self.fd, (json.dumps({"code": self.code, "how": self.how, "at": time.time()}) + "\n").encode())
        except OSError:
            pass


def watch_ending(fd: int) -> Ending:
    """Register the exit record (call before the script runs) and follow how the script ends."""
    os.set_inheritable(fd, False)    # programs the script starts do not get the pipe
    ending = Ending(fd, os.getpid())
    atexit.register(ending.record)
    real_exit = sys.exit

    def exit(status: Any = None) -> None:  # noqa: A001 - stands in for sys.exit
        ending.set(exit_code_of(status), "sys.exit")
        real_exit(status)

    sys.exit = exit
    _watch_unwind(ending)
    return ending


def _watch_unwind(ending: Ending) -> None:
    """Python 3.12+: an exception leaving the main module's top level (``raise SystemExit(n)``)."""
    mon = getattr(sys, "monitoring", None)
    if mon is None or mon.get_tool(TOOL_ID) is not None:
        return
    mon.use_tool_id(TOOL_ID, "ddp_hpc")

    def unwound(code, offset, exc) -> None:  # noqa: ANN001, ARG001 - sys.monitoring's API
        if code.co_name != "<module>":
            return
        main = sys.modules.get("__main__")
        if main is None or getattr(main, "__file__", None) != code.co_filename:
            return
        if isinstance(exc, SystemExit):
            ending.set(exit_code_of(exc.code), "SystemExit")
        elif not isinstance(exc, KeyboardInterrupt):
            ending.set(1, f"exception {type(exc).__name__}")

    mon.register_callback(TOOL_ID, mon.events.PY_UNWIND, unwound)
    mon.set_events(TOOL_ID, mon.events.PY_UNWIND)
