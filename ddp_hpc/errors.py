"""The one error format of ddp_hpc: what is wrong (naming the value and where it came from), then
a ``HINT:`` line with the fix.

Every user-facing error class derives from `HintError`; command-line entry points print it with
`report` and exit non-zero (2 for bad input, 1 for a failure at run time)::

    raise ConfigError(f"train.epochs = {v!r} from {path} is negative", "use an integer >= 1")

    ddp-hpc submit: error: train.epochs = -1 from jobs/demo.yaml is negative
    HINT: use an integer >= 1
"""

from __future__ import annotations

import sys
from typing import TextIO


class HintError(Exception):
    """A problem the user can fix: ``problem`` says what was seen, ``hint`` says what to do."""

    def __init__(self, problem: str, hint: str = ""):
        self.problem = problem
        self.hint = hint
        super().__init__(format_error(problem, hint))


def format_error(problem: str, hint: str = "") -> str:
    """``problem`` and, when there is one, a ``HINT:`` line: the only spelling of an error."""
    return f"{problem}\nHINT: {hint}" if hint else problem


def report(prog: str, exc: BaseException | str, file: TextIO | None = None) -> None:
    """Print ``<prog>: error: <message>`` (the message keeps its HINT line) to stderr."""
    print(f"{prog}: error: {exc}", file=file or sys.stderr, flush=True)
