"""The wording shared by every command: usage names, counts, and help text.

    prog("status")            -> "ddp-hpc status" (or "python -m ddp_hpc.status")
    plural(2, "process")      -> "2 processes"
    argparse.ArgumentParser(prog=prog("env"), formatter_class=HelpFormatter)
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys

__all__ = ["prog", "plural", "HelpFormatter", "ArgumentParser"]


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


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser that answers an unknown flag with the nearest known one:
    ``unrecognized arguments: --wiat (did you mean `--wait`?)``."""

    def error(self, message: str):  # type: ignore[override]
        super().error(message + did_you_mean(message, list(self._option_string_actions)))


#: argparse's words for a value outside its choices: the choices quoted (``'status', 'submit'``,
#: Python <= 3.12.6) or not (``status, submit``, 3.12.7+ and 3.13); 3.14 may put its own guess
#: (``, maybe you meant 'status'?``) before the list
_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)'.*?\(choose from (.*)\)")


def did_you_mean(message: str, flags: list[str]) -> str:
    """`` (did you mean `--wait`?)`` for an unknown flag argparse names in ``message`` that is
    close to one of ``flags`` (with several unknown words: which guess is for which), or for an
    invalid choice (a subcommand such as ``sttaus``) close to one of the choices argparse lists;
    "" when none is close."""
    choice = _INVALID_CHOICE.search(message)
    if choice:
        listed = choice.group(2)
        choices = re.findall(r"'([^']*)'", listed) or [c.strip() for c in listed.split(",")]
        near = difflib.get_close_matches(choice.group(1), choices, n=1, cutoff=0.6)
        return f" (did you mean `{near[0]}`?)" if near else ""
    if not message.startswith("unrecognized arguments:"):
        return ""
    words = message.split(":", 1)[1].split()
    pairs = [(w, near[0]) for w in words if w.startswith("-")
             for near in [difflib.get_close_matches(w.split("=", 1)[0], flags, n=1, cutoff=0.7)] if near]
    if not pairs:
        return ""
    if len(words) == 1:
        return f" (did you mean `{pairs[0][1]}`?)"
    return " (did you mean " + ", ".join(f"`{near}` for {w}" for w, near in pairs) + "?)"


def shown_path(path: str | os.PathLike) -> str:
    """``path`` as a user reads it in a one-line message: relative to the working directory when
    it lies inside it (``runs/demo-...``), else as given."""
    text = os.fspath(path)
    try:
        rel = os.path.relpath(text)
    except ValueError:   # another drive (Windows)
        return text
    return text if rel == ".." or rel.startswith(".." + os.sep) else rel


def cut_middle(text: str, width: int) -> str:
    """``/scratch/u/.../demo-20260101-1a2b``: the ends of a path kept, its middle cut."""
    if len(text) <= width:
        return text
    if width <= 3:
        return text[:width]
    head = (width - 3) // 3
    return text[:head] + "..." + text[len(text) - (width - 3 - head):]


def cut_end(text: str, width: int) -> str:
    return text if len(text) <= width else (text[:width - 3] + "..." if width > 3 else text[:width])
