"""When a rank's process started and when its process group came up: the marks a restart's phases
are measured from (``ddp_hpc.judge.restarts.phases``, docs/restarts.md, "Where the seconds go").

Each rank writes one ``rendezvous`` event (`schema.EVENTS`) once its process group is up:
``proc_start`` (when the rank's process started: the process srun launched, so for a script run
by ``ddp_hpc.exec`` the wrapper's, which it hands its child in `PROC_START_VAR`), ``called_at``
(when the code called ``init_process_group``: the end of Python's start and the imports) and
``up_at`` (when it returned), and ``step_id``, the Slurm job step the rank runs in (the
supervisor kills that step's tasks at once when it stops a broken step) and ``warm`` (the rank was
the supervisor's warm standby, `WARM_START_VAR`). ddp_hpc's loop writes
it from `dist.setup_ddp`'s marks (`mark_rendezvous`) as soon as its run log exists, before it
restores a checkpoint; a script's instrumentation (``ddp_hpc.instrument.steps``) writes it from
its ``init_process_group`` wrapper.
"""
from __future__ import annotations

import os
import time

from ddp_hpc.env.job import job_facts

__all__ = ["PROC_START_VAR", "WARM_START_VAR", "process_start", "mark_rendezvous", "rendezvous_fields"]

#: set to 1 by the supervisor's warm standby (``supervise.standby``) in a rank it started: the
#: process was waiting with torch imported, and ``proc_start`` is when it was handed its rank
WARM_START_VAR = "DDP_HPC_WARM_START"

#: set by ``ddp_hpc.exec`` for the script it starts: the wrapper's own start time (what srun
#: launched), so a script's ``proc_start`` counts from there
PROC_START_VAR = "DDP_HPC_PROC_START"

_marks: dict[str, float] = {}


def _own_start() -> float | None:
    """This process's start time (epoch seconds) from /proc (Linux), None elsewhere: its age on
    the kernel's boot clock (the uptime now less its start in clock ticks since boot) taken from
    the time now. Not /proc/stat's ``btime``, a whole second that drifts from the wall clock by
    seconds on a long-running machine."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])   # field 22: starttime
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return round(time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK")), 3)
    except (OSError, ValueError, IndexError):
        return None


def process_start(environ=None) -> float | None:
    """When this rank's process started: `PROC_START_VAR` when the exec wrapper set it, else this
    process's own start time (to 1/100 s: the kernel's clock ticks); None when unknown."""
    env = os.environ if environ is None else environ
    try:
        given = float(env.get(PROC_START_VAR) or "nan")
    except ValueError:
        given = float("nan")
    return given if given == given else _own_start()


def mark_rendezvous(called_at: float, up_at: float | None = None) -> None:
    """Note that ``init_process_group`` was called at ``called_at`` and returned at ``up_at`` (now)."""
    _marks.update(called_at=round(called_at, 3), up_at=round(time.time() if up_at is None else up_at, 3))


def rendezvous_fields() -> dict | None:
    """The ``rendezvous`` event's keys, or None when no process group came up in this process."""
    if not _marks:
        return None
    return {"proc_start": process_start(), **_marks, "step_id": job_facts().step_id,
            "warm": os.environ.get(WARM_START_VAR) == "1"}
