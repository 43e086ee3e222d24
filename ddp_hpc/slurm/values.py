"""Values that go into Slurm command lines, checked before they get there: job ids and node
names (never anything like ``1;rm`` or ``--all``), and GPU counts read out of Gres strings."""

from __future__ import annotations

import re

from ddp_hpc.errors import HintError

__all__ = ["JOB_ID", "SlurmArgumentError", "validate_job_id", "gpus_in_gres", "NODE_NAME"]

JOB_ID = re.compile(r"[0-9]+(?:_[0-9]+)?\Z")
#: a Slurm node name as ExcNodeList takes it (letters, digits, ``_ . -``; no leading ``-``)
NODE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\Z")


class SlurmArgumentError(HintError, ValueError):
    """A value that cannot go into a Slurm command line (a job id, a signal, a path)."""


def validate_job_id(job_id: object) -> str:
    """A Slurm job id as digits with an optional ``_N`` array task suffix; anything else raises
    SlurmArgumentError, a ValueError (ids end up in argv, so nothing like ``1;rm`` or ``--all`` may
    pass)."""
    text = str(job_id).strip() if isinstance(job_id, (str, int)) else None
    if text is None or not JOB_ID.fullmatch(text):
        raise SlurmArgumentError(
            f"invalid Slurm job id {job_id!r}: expected digits with an optional _N array task "
            "suffix, such as 1234 or 1234_7"
        )
    return text


def gpus_in_gres(gres: str) -> int:
    """GPUs in one node's Gres string: ``gpu:4`` -> 4, ``gpu:a100:2(S:0-1),gpu:v100:1`` -> 3,
    ``(null)`` -> 0."""
    total = 0
    for item in re.split(r",(?![^(]*\))", gres or ""):
        item = re.sub(r"\(.*\)\Z", "", item.strip())
        parts = item.split(":")
        if parts[0] != "gpu":
            continue
        count = parts[-1] if len(parts) > 1 else "1"
        total += int(count) if count.isdigit() else 1
    return total
