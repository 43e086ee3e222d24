"""Experiment trackers in script jobs: one Weights & Biases run per job, across requeues.

`wandb_environ(child)` gives the variables a script job's child gets beside the torchrun contract
(the exec wrapper adds them): ``WANDB_RUN_ID``, stable for the job (its id, or ``JOBID_TASK`` in an
array, and a digest of its log directory, so ids a test cluster reuses never meet), and
``WANDB_RESUME=allow``, so ``wandb.init()`` in a requeued or restarted job continues the run it
began.  Each is left alone when the user set it; outside a job (no job id) nothing is set.
"""
from __future__ import annotations

import hashlib
import re
from typing import Mapping

__all__ = ["wandb_environ"]

#: W&B's run ids: letters, digits, '-' and '_' (and short)
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
_MAX_ID = 64


def wandb_environ(child: Mapping[str, str]) -> dict[str, str]:
    """``WANDB_RUN_ID`` and ``WANDB_RESUME`` for a child environment that names its job
    (``DDP_HPC_JOB_ID``, ``DDP_HPC_LOG_DIR``), except those already set."""
    job = child.get("DDP_HPC_JOB_ID")
    if not job:
        return {}
    out = {}
    if not child.get("WANDB_RUN_ID"):
        digest = hashlib.sha1(f"{job}\0{child.get('DDP_HPC_LOG_DIR', '')}".encode()).hexdigest()[:8]
        out["WANDB_RUN_ID"] = f"{_UNSAFE.sub('-', job)[:_MAX_ID - 9]}-{digest}"
    if not child.get("WANDB_RESUME"):
        out["WANDB_RESUME"] = "allow"
    return out
