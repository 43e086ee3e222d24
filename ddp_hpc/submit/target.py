"""What ``submit`` runs, read off its command line the way torchrun reads its own:

    ddp-hpc submit [options] CONFIG.yaml [KEY=VALUE ...] [-- KEY=VALUE ...]   ddp_hpc's own loop
    ddp-hpc submit [options] SCRIPT.py [script args ...]                      your script
    ddp-hpc submit [options] -m MODULE [args ...]                             as `python -m`

Why a scanner before argparse: everything after a script or module belongs to it verbatim, even
``--nodes``, ``-N`` or ``--``; argparse would take those for its own. So the scanner walks the
options, stepping over the values of those that take one, and stops at the first word that is a
script, ``-m``/``--module``, or anything else (a config, an override): argparse then gets only
what is ours. A word that is a script is one ending in ``.py``, or an executable file that is not
a YAML file (``./train.sh``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ddp_hpc.backends.spec import SpecError

__all__ = ["SubmitTarget", "split_argv", "script_command", "module_command"]

_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*$")
_CONFIG_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class SubmitTarget:
    """``kind`` is "config", "script" or "module"; ``ours`` the argv for argparse; ``rest`` what
    follows a script or module (its arguments, verbatim); ``what`` the script path or module."""
    kind: str
    ours: list[str]
    what: str | None = None
    rest: tuple[str, ...] = ()


def _takes_value(parser: argparse.ArgumentParser, word: str) -> bool:
    """Whether option ``word`` (without an attached ``=value``) consumes the next word."""
    for action in parser._actions:   # noqa: SLF001 - argparse exposes no public lookup
        if word in action.option_strings:
            return action.nargs != 0
    return False


def _is_script(word: str) -> bool:
    if word.endswith(".py"):
        return True
    p = Path(word)
    return (not word.endswith(_CONFIG_SUFFIXES) and "=" not in word and p.is_file()
            and os.access(p, os.X_OK))


def split_argv(argv: Sequence[str], parser: argparse.ArgumentParser) -> SubmitTarget:
    """Find the target in ``argv``; see the module docstring."""
    argv = list(argv)
    i = 0
    while i < len(argv):
        word = argv[i]
        if word in ("-m", "--module"):
            if i + 1 >= len(argv):
                raise SpecError(f"{word} needs a module name (as python -m MODULE)",
                                "write e.g. ddp-hpc submit -N 2 -G 4 -m mypkg.train --lr 0.1")
            return SubmitTarget("module", argv[:i], argv[i + 1], tuple(argv[i + 2:]))
        if word.startswith("--module="):
            return SubmitTarget("module", argv[:i], word.split("=", 1)[1], tuple(argv[i + 1:]))
        if word == "--":
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is not None and _is_script(nxt):
                return SubmitTarget("script", argv[:i], nxt, tuple(argv[i + 2:]))
            return SubmitTarget("config", argv)
        if word.startswith("-") and word != "-":
            attached = "=" in word or (not word.startswith("--") and len(word) > 2)
            i += 1 if attached or not _takes_value(parser, word) else 2
            continue
        if _is_script(word):
            return SubmitTarget("script", argv[:i], word, tuple(argv[i + 1:]))
        return SubmitTarget("config", argv)
    return SubmitTarget("config", argv)


def _check_arg(arg: str, where: str) -> str:
    if "\0" in arg:
        raise SpecError(f"argument {arg!r} contains a NUL byte ({where})", "remove it")
    return arg


def script_command(path: str, args: Sequence[str], python: str | None = None) -> tuple[str, ...]:
    """``(python, /abs/script.py, *args)`` (or the executable itself when it is not a .py);
    the script must exist now: the job runs it from the same directory."""
    p = Path(path)
    if not p.is_file():
        where = "" if p.is_absolute() else f" (relative to {os.getcwd()})"
        raise SpecError(f"script {path!r} does not exist{where}",
                        "give the path of your training script, e.g. ddp-hpc submit -N 2 train.py")
    args = tuple(_check_arg(a, f"argument of {path}") for a in args)
    if path.endswith(".py"):
        return (python or sys.executable, str(p.resolve()), *args)
    return (str(p.resolve()), *args)


def module_command(module: str, args: Sequence[str], python: str | None = None,
                   workdir: str | None = None) -> tuple[str, ...]:
    """``(python, -m, module, *args)`` when ``module`` can be imported from ``workdir``."""
    if not _MODULE.fullmatch(module):
        raise SpecError(f"module name {module!r} is not a dotted Python name (-m {module})",
                        "write e.g. -m mypkg.train")
    workdir = workdir or os.getcwd()
    sys.path.insert(0, workdir)
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    finally:
        sys.path.remove(workdir)
    if found is None:
        raise SpecError(f"module {module!r} cannot be found from {workdir} (-m {module})",
                        "install the package into this Python environment, or submit from the "
                        "directory that holds it")
    args = tuple(_check_arg(a, f"argument of -m {module}") for a in args)
    return (python or sys.executable, "-m", module, *args)
