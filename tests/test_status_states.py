"""Every Slurm job state maps to the enum; unknown text is kept and shown, never a crash.

The oracle is Slurm's own documentation as installed with the Slurm client: the "JOB STATE
CODES" tables of squeue(1) and sacct(1) list each compact code with its long name.
"""
import gzip
import re
from pathlib import Path

import pytest

from ddp_hpc.slurm.states import COMPACT, JobState, parse_state

ISSUE_STATES = [
    "PENDING", "RUNNING", "SUSPENDED", "COMPLETING", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT",
    "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY", "REQUEUED", "REQUEUE_HOLD",
    "REQUEUE_FED", "RESIZING", "REVOKED", "SIGNALING", "SPECIAL_EXIT", "STAGE_OUT", "STOPPED",
    "RESV_DEL_HOLD", "CONFIGURING",
]


def man_state_table(page: str) -> dict[str, str]:
    path = Path(f"/usr/share/man/man1/{page}.1.gz")
    if not path.exists():
        pytest.skip(f"{path} not installed (Debian's slurm-client ships it)")
    text = gzip.open(path, "rt", errors="replace").read()
    section = text.split('.SH "JOB STATE CODES"', 1)[1].split("\n.SH", 1)[0]
    table = dict(re.findall(r"\\f[B3]([A-Z]{1,3})\s+([A-Z_]+)\\f[RP]", section))
    assert len(table) >= 10, f"could not read the state table of {path}"
    return table


@pytest.mark.parametrize("page", ["squeue", "sacct"])
def test_every_documented_state_and_code_maps(page):
    for code, name in man_state_table(page).items():
        assert parse_state(name).job_state is JobState[name], name
        assert parse_state(code).job_state is JobState[name], code
        assert COMPACT[code] is JobState[name]


@pytest.mark.parametrize("name", ISSUE_STATES)
def test_issue_states_map_to_themselves(name):
    info = parse_state(name)
    assert info.job_state.name == name
    assert info.label == name


def test_cancelled_by_uid_keeps_who():
    info = parse_state("CANCELLED by 1000")
    assert info.job_state is JobState.CANCELLED
    assert info.detail == "by 1000"
    assert info.label == "CANCELLED by 1000"
    assert info.job_state.failed and info.job_state.terminal and not info.job_state.active


def test_sacct_truncation_mark_and_case():
    assert parse_state("CANCELLED+").job_state is JobState.CANCELLED
    assert parse_state(" running ").job_state is JobState.RUNNING
    assert parse_state("OOM").job_state is JobState.OUT_OF_MEMORY


@pytest.mark.parametrize("raw", ["FROBNICATING", "", None, "42", "by nobody", "\x00weird"])
def test_unknown_is_shown_raw_never_raises(raw):
    info = parse_state(raw)
    assert info.job_state is JobState.UNKNOWN
    assert info.raw == ("" if raw is None else str(raw).strip())
    if info.raw:
        assert info.raw in info.label
    assert not info.job_state.active and not info.job_state.terminal


def test_active_and_terminal_partition_the_known_states():
    for s in JobState:
        if s is JobState.UNKNOWN:
            continue
        assert s.active != s.terminal, s
    assert JobState.COMPLETED.terminal and not JobState.COMPLETED.failed
    for s in ("FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL"):
        assert JobState[s].failed
    for s in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING", "REQUEUE_HOLD"):
        assert JobState[s].active
