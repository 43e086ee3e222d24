"""Every Slurm job state mapped to one enum, with an UNKNOWN fallback instead of a crash.

squeue, sacct and the job completion log spell states in several ways: long names (``RUNNING``),
compact codes (``R``, ``CG``, ``OOM``), decorated names (``CANCELLED by 1000``, ``CANCELLED+``
when sacct truncates a column), and, for flags, combinations. The status command needs a single
answer per job plus two facts about it: is the job still alive in the scheduler (so status keeps
polling and ETA makes sense), and did it end well. A state this module does not know (a newer
Slurm, a site plugin) becomes ``JobState.UNKNOWN`` with the raw text kept for display, following
torchx's Slurm scheduler.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class JobState(enum.Enum):
    """A job's state; the value is the Slurm long name (``UNKNOWN`` for anything else)."""

    PENDING = "PENDING"
    CONFIGURING = "CONFIGURING"
    RUNNING = "RUNNING"
    SUSPENDED = "SUSPENDED"
    STOPPED = "STOPPED"
    SIGNALING = "SIGNALING"
    RESIZING = "RESIZING"
    COMPLETING = "COMPLETING"
    STAGE_OUT = "STAGE_OUT"
    POWER_UP_NODE = "POWER_UP_NODE"
    UPDATE_DB = "UPDATE_DB"
    REQUEUED = "REQUEUED"
    REQUEUE_HOLD = "REQUEUE_HOLD"
    REQUEUE_FED = "REQUEUE_FED"
    RESV_DEL_HOLD = "RESV_DEL_HOLD"
    SPECIAL_EXIT = "SPECIAL_EXIT"
    COMPLETED = "COMPLETED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    PREEMPTED = "PREEMPTED"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    LAUNCH_FAILED = "LAUNCH_FAILED"
    REVOKED = "REVOKED"
    #: not a Slurm state: a local job stopped with Ctrl-C (SIGINT) from the terminal that ran it
    INTERRUPTED = "INTERRUPTED"
    UNKNOWN = "UNKNOWN"

    @property
    def active(self) -> bool:
        """True while the scheduler still holds the job (queued, running, held or winding down)."""
        return self in _ACTIVE

    @property
    def terminal(self) -> bool:
        """True once the job has left the scheduler for good."""
        return self in _TERMINAL

    @property
    def failed(self) -> bool:
        """True for every terminal state except COMPLETED."""
        return self.terminal and self is not JobState.COMPLETED


_ACTIVE = frozenset({
    JobState.PENDING, JobState.CONFIGURING, JobState.RUNNING, JobState.SUSPENDED,
    JobState.STOPPED, JobState.SIGNALING, JobState.RESIZING, JobState.COMPLETING,
    JobState.STAGE_OUT, JobState.POWER_UP_NODE, JobState.UPDATE_DB, JobState.REQUEUED,
    JobState.REQUEUE_HOLD, JobState.REQUEUE_FED, JobState.RESV_DEL_HOLD, JobState.SPECIAL_EXIT,
})
_TERMINAL = frozenset({
    JobState.COMPLETED, JobState.CANCELLED, JobState.FAILED, JobState.TIMEOUT,
    JobState.NODE_FAIL, JobState.PREEMPTED, JobState.BOOT_FAIL, JobState.DEADLINE,
    JobState.OUT_OF_MEMORY, JobState.LAUNCH_FAILED, JobState.REVOKED, JobState.INTERRUPTED,
})

#: squeue ``%t`` / ``--states`` compact codes (Slurm's job_state_string_compact).
COMPACT = {
    "PD": JobState.PENDING, "R": JobState.RUNNING, "S": JobState.SUSPENDED,
    "CD": JobState.COMPLETED, "CA": JobState.CANCELLED, "F": JobState.FAILED,
    "TO": JobState.TIMEOUT, "NF": JobState.NODE_FAIL, "PR": JobState.PREEMPTED,
    "BF": JobState.BOOT_FAIL, "DL": JobState.DEADLINE, "OOM": JobState.OUT_OF_MEMORY,
    "CG": JobState.COMPLETING, "CF": JobState.CONFIGURING, "RS": JobState.RESIZING,
    "RQ": JobState.REQUEUED, "RF": JobState.REQUEUE_FED, "RH": JobState.REQUEUE_HOLD,
    "SE": JobState.SPECIAL_EXIT, "ST": JobState.STOPPED, "RV": JobState.REVOKED,
    "RD": JobState.RESV_DEL_HOLD, "SI": JobState.SIGNALING, "SO": JobState.STAGE_OUT,
    "PO": JobState.POWER_UP_NODE, "LF": JobState.LAUNCH_FAILED, "UD": JobState.UPDATE_DB,
}
_ALIASES = {"CANCELED": JobState.CANCELLED, "NODE_FAILURE": JobState.NODE_FAIL,
            "OOM": JobState.OUT_OF_MEMORY}

_BY = re.compile(r"^(?P<name>[A-Z_]+)\s+by\s+(?P<who>\S+)$", re.IGNORECASE)


@dataclass(frozen=True)
class StateInfo:
    """A parsed state: the enum (``job_state``), the text Slurm printed, and any detail ("by 1000")."""

    job_state: JobState
    raw: str
    detail: str = ""

    @property
    def label(self) -> str:
        """What a user sees: the enum name, or the raw text when the state is unknown."""
        if self.job_state is JobState.UNKNOWN:
            return f"UNKNOWN({self.raw})" if self.raw else "UNKNOWN"
        return f"{self.job_state.value} {self.detail}".rstrip()


def parse_state(raw: object) -> StateInfo:
    """Map any spelling of a Slurm state to a :class:`StateInfo`; never raises.

    ``"CANCELLED by 1000"`` -> CANCELLED with detail ``"by 1000"``; ``"RUNNING+"`` (sacct's
    truncation mark) -> RUNNING; ``"R"`` -> RUNNING; ``"REQUEUED,HOLD"``-style flag lists use the
    first known word; anything else -> UNKNOWN keeping the raw text.
    """
    text = "" if raw is None else str(raw).strip()
    word = text.rstrip("+").strip()
    detail = ""
    m = _BY.match(word)
    if m:
        word, detail = m.group("name"), f"by {m.group('who')}"
    for part in re.split(r"[,\s]+", word):
        state = _lookup(part.upper())
        if state is not None:
            return StateInfo(state, text, detail)
    return StateInfo(JobState.UNKNOWN, text, detail)


def _lookup(word: str) -> JobState | None:
    if not word:
        return None
    if word in JobState.__members__ and word != "UNKNOWN":
        return JobState[word]
    return COMPACT.get(word) or _ALIASES.get(word)
