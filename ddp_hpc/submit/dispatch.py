"""After the job is known and checked (``JobSpec``) and its backend chosen: check what that
backend takes, plan, and either print the plan (``--dry-run``) or submit it. Returns what the
submission left (``Submitted``: the job record, the exit status). The command line is
``ddp_hpc.submit.cli``, the Python API ``ddp_hpc.submit.api``; the backends ``ddp_hpc.submit.backends``.
"""

from __future__ import annotations

import sys
from typing import Sequence

from ddp_hpc.config import JobConfig
from ddp_hpc.submit.backends import check_options
from ddp_hpc.submit.backends.base import Backend, SubmitOptions, Submitted
from ddp_hpc.submit.spec import JobSpec

__all__ = ["dispatch"]


def dispatch(spec: JobSpec, backend: Backend, cli, opts: SubmitOptions | None = None,
             task_cfgs: Sequence[JobConfig] | None = None) -> Submitted:
    """Run or submit ``spec`` on ``backend`` (``cli``: the SlurmCLI it may ask); ``task_cfgs``:
    each task's config, copied into its run directory (None for a script or module job). A dry
    run prints the plan (a batch script, submitit's parameters, the launcher commands), writes
    nothing and returns no record."""
    opts = opts or SubmitOptions()
    check_options(spec, backend, opts.dry_run)
    backend.check(spec, cli, opts.dry_run)
    plan = backend.plan(spec, task_cfgs)
    if opts.dry_run:
        sys.stdout.write(plan.text)
        sys.stdout.flush()
        return Submitted(None)
    return backend.submit(plan, cli, opts)
