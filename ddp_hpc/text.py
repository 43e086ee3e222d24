"""The wording shared by every command: usage names, counts, and help text.

    prog("status")            -> "ddp-hpc status" (or "python -m ddp_hpc.status")
    plural(2, "process")      -> "2 processes"
    argparse.ArgumentParser(prog=prog("env"), formatter_class=HelpFormatter)
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["prog", "plural", "HelpFormatter"]


def prog(name: str) -> str:
    """The name a subcommand's usage line shows: ``ddp-hpc NAME`` when run through the console
    script (or its ``ddp-hpc-NAME`` alias), ``python -m ddp_hpc.NAME`` otherwise."""
    base = os.path.basename(sys.argv[0] if sys.argv else "")
    return f"ddp-hpc {name}" if base.startswith("ddp-hpc") else f"python -m ddp_hpc.{name}"


def plural(n: int | None, word: str) -> str:
    """``1 process``, ``2 processes``, ``1 pretend node``, ``4 pretend nodes``, ``? nodes`` when n
    is unknown: the one wording of counts in messages and logs (no "1 processes", no "node(s)")."""
    many = word + ("es" if word.endswith("s") else "s")
    return f"{'?' if n is None else n} {word if n == 1 else many}"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps descriptions as written and adds ``(default: X)`` only where a default says something
    (not for None, False, empty lists or suppressed values)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if ("%(default)" in text or d in (None, False, [], (), "") or d is argparse.SUPPRESS
                or action.option_strings == [] or isinstance(action, argparse._HelpAction)):
            return text
        return f"{text} (default: %(default)s)"
