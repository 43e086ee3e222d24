"""How a process ends: signals by name and number, and the exit codes ddp_hpc gives a meaning.

- `EX_TEMPFAIL` (75, sysexits.h's "try again later"): a run that stopped to be resumed: it saved a
  checkpoint on preemption (``ddp_hpc.preemption.requeue()``, the training core outside Slurm) or
  requeued itself off a failed node. ``python -m ddp_hpc.exec`` records it as ``preempted``, the
  batch script and the submitit task take it as a clean stop.
- A shell (and the exec wrapper) reports a child killed by signal N with exit status 128 + N:
  `exit_status_of_signal` and `signal_of_exit_status` go each way; `exit_status_of_returncode`
  turns a ``subprocess`` return code (-N: killed by signal N) into that exit status.

Nothing here imports the rest of ddp_hpc, so every layer may use it.
"""
from __future__ import annotations

import signal as _signal

__all__ = ["EX_TEMPFAIL", "SIGNAL_EXIT_BASE", "signal_name", "signal_number", "signal_text",
           "exit_status_of_signal", "signal_of_exit_status", "exit_status_of_returncode"]

#: stopped to be resumed (checkpointed, requeued or to be run again): sysexits.h's EX_TEMPFAIL
EX_TEMPFAIL = 75
#: a child killed by signal N exits (in a shell's words) with 128 + N
SIGNAL_EXIT_BASE = 128


def signal_name(signum: int) -> str:
    """``9`` -> ``SIGKILL`` (``signal 99`` when there is no such signal)."""
    try:
        return _signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def signal_text(signum: int) -> str:
    """``9`` -> ``signal 9 (SIGKILL)``."""
    name = signal_name(signum)
    return f"signal {signum} ({name})" if name.startswith("SIG") else name


def signal_number(name: object, *, numbers: bool = True) -> int | None:
    """``"SIGKILL"`` / ``"kill"`` / ``9`` / ``"9"`` -> 9; None when ``name`` is no signal.

    ``numbers=False`` takes names only: a number (``"9"``) is then no signal either."""
    text = str(name or "").strip().upper()
    if text.isdigit():
        return int(text) if numbers else None
    try:
        return int(_signal.Signals[text if text.startswith("SIG") else "SIG" + text])
    except KeyError:
        return None


def exit_status_of_signal(signum: int) -> int:
    """``9`` -> ``137``: what a shell reports for a child that signal ``signum`` killed."""
    return SIGNAL_EXIT_BASE + signum


def signal_of_exit_status(code: int) -> int | None:
    """``137`` -> ``9``: the signal behind a shell's exit status above 128, else None."""
    return code - SIGNAL_EXIT_BASE if code > SIGNAL_EXIT_BASE else None


def exit_status_of_returncode(returncode: int | None) -> int:
    """A ``subprocess`` return code as a shell's exit status: ``-9`` (killed by SIGKILL) ->
    ``137``, ``3`` -> ``3``, ``None`` (it never ended: no status known) -> ``1``."""
    if returncode is None:
        return 1
    return exit_status_of_signal(-returncode) if returncode < 0 else returncode
