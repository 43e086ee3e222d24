"""The ``sbatch`` backend: a rendered batch script (``ddp_hpc.submit.render``, kept as
``<log_dir>/job.sbatch``) queued with sbatch. The only backend that takes a node range, a
container and the restarts inside the allocation (``ddp_hpc.supervise`` runs in its batch step)."""

from __future__ import annotations

from ddp_hpc.slurm.cli import SlurmCLI
from ddp_hpc.submit import render
from ddp_hpc.submit import slurm as submit_slurm
from ddp_hpc.submit.backends.base import Plan
from ddp_hpc.submit.backends.onslurm import SlurmBackend
from ddp_hpc.submit.spec import JobSpec

__all__ = ["SbatchBackend"]


class SbatchBackend(SlurmBackend):
    name = "sbatch"
    takes_node_range = True
    takes_container = True
    restarts_in_allocation = True

    def dry_run_text(self, spec: JobSpec) -> str:
        return render.render(spec)

    def queue(self, plan: Plan) -> tuple[str, str | None]:
        job_id, path = submit_slurm.submit_sbatch(plan.spec, plan.text, SlurmCLI(env=dict(plan.env)))
        return job_id, str(path)
