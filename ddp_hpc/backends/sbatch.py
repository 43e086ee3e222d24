"""The ``sbatch`` backend: a rendered batch script (``ddp_hpc.backends.render``, kept as
``<log_dir>/job.sbatch``) queued with sbatch. The only backend that takes a node range, a
container and the restarts inside the allocation (``ddp_hpc.supervise`` runs in its batch step)."""

from __future__ import annotations

from pathlib import Path

from ddp_hpc.backends import render
from ddp_hpc.backends.base import Plan
from ddp_hpc.backends.onslurm import SlurmBackend
from ddp_hpc.backends.spec import JobSpec
from ddp_hpc.fsutil import atomic_write_text
from ddp_hpc.slurm.cli import SlurmCLI

__all__ = ["SbatchBackend", "SCRIPT_NAME"]

SCRIPT_NAME = "job.sbatch"        # the rendered script, kept in the log directory


class SbatchBackend(SlurmBackend):
    name = "sbatch"
    takes_node_range = True
    takes_container = True
    restarts_in_allocation = True

    def dry_run_text(self, spec: JobSpec) -> str:
        return render.render(spec)

    def queue(self, plan: Plan) -> tuple[str, str | None]:
        """Write the script into the log directory (kept for the record) and submit it."""
        path = Path(plan.spec.log_dir) / SCRIPT_NAME
        atomic_write_text(path, plan.text)
        return SlurmCLI(env=dict(plan.env)).sbatch(plan.text, cwd=plan.spec.workdir), str(path)
