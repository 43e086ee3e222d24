"""What the two Slurm backends (sbatch, submitit) share: the checks against sinfo before anything
is queued, the submission's record and its lines, ``--wait``, whether a job is still in the
queue, and ``scancel``. Each backend says only how it queues a job and what its dry run shows."""

from __future__ import annotations

import os
import socket
from typing import Any, Sequence

from ddp_hpc import records
from ddp_hpc.backends import slurmjob
from ddp_hpc.backends.base import (
    CancelError,
    Plan,
    SubmitOptions,
    Submitted,
    clean_slurm_env,
    make_run_dirs,
    record,
    removed_note,
    say,
)
from ddp_hpc.backends.checks import check_resources, partition_named
from ddp_hpc.backends.spec import JobSpec, SpecError
from ddp_hpc.backends.wait import wait_and_judge
from ddp_hpc.config import JobConfig
from ddp_hpc.slurm.cli import SlurmCLI, SlurmError
from ddp_hpc.slurm.states import parse_state
from ddp_hpc.text import plural, shown_path

__all__ = ["SlurmBackend", "scancel", "cluster_of"]


def preflight(spec: JobSpec, name: str, cli: SlurmCLI, dry_run: bool) -> None:
    """Compare the request with what sinfo lists; a dry run goes on without a cluster."""
    if not cli.available():
        if dry_run:
            say("dry run without Slurm (`sbatch` is not on PATH): partition and GPU checks skipped")
            return
        raise SpecError(f"--backend {name} needs Slurm but `sbatch` is not on PATH",
                        "run on a login node, or use --backend local (or auto)")
    try:
        partitions = cli.sinfo_partitions()
    except SlurmError as exc:
        if not dry_run:
            raise
        say(f"dry run without a reachable cluster: partition and GPU checks skipped "
            f"({str(exc).splitlines()[0]})")
        return
    part = slurmjob.check_against_cluster(spec, partitions)
    check_resources(spec, partition_named(partitions, part))


def cluster_of(cli: SlurmCLI) -> str:
    """The record's cluster: Slurm's ClusterName, else this host's name."""
    try:
        return cli.cluster_name()
    except SlurmError:
        return socket.gethostname()


def scancel(job_id: str, cli: SlurmCLI) -> None:
    """``scancel`` a Slurm job or array task (through ``ddp_hpc.slurm.cli``)."""
    if not cli.available():
        raise CancelError(f"job {job_id} is a Slurm job, but `scancel` is not on PATH here.",
                          "run `ddp-hpc cancel` on a login node of the cluster that runs the job.")
    cli.cancel(job_id)


class SlurmBackend:
    """The shared part of a backend that queues jobs with Slurm (module docstring)."""

    name = "slurm"
    runs_here = False
    takes_functions = False
    takes_node_range = False
    takes_container = False
    restarts_in_allocation = False
    devices_here = False

    def __repr__(self) -> str:
        return f"<{self.name} backend>"

    def __str__(self) -> str:
        return self.name

    def check(self, spec: JobSpec, cli: SlurmCLI, dry_run: bool) -> None:
        preflight(spec, self.name, cli, dry_run)

    def plan(self, spec: JobSpec, task_cfgs: Sequence[JobConfig] | None) -> Plan:
        env, removed = clean_slurm_env(os.environ)
        return Plan(spec, self.dry_run_text(spec), env, tuple(removed),
                    None if task_cfgs is None else tuple(task_cfgs))

    def dry_run_text(self, spec: JobSpec) -> str:
        raise NotImplementedError

    def queue(self, plan: Plan) -> tuple[str, str | None]:
        """Queue the job: (job id, the batch script kept for the record)."""
        raise NotImplementedError

    def submit(self, plan: Plan, cli: SlurmCLI, opts: SubmitOptions) -> Submitted:
        spec = plan.spec
        cluster = cluster_of(cli)
        make_run_dirs(spec, plan.task_cfgs)
        if plan.removed:
            say(removed_note(plan.removed) + " (before submitting)")
        job_id, script = self.queue(plan)
        rec = record(spec, job_id, self, cluster, script=script)
        array = f", array of {len(spec.tasks)}" if spec.is_array else ""
        nodes = (f"{spec.options.nodes} nodes" if isinstance(spec.options.nodes, str)
                 else plural(spec.nodes, "node"))
        say(f"submitted job {job_id} ({self.name}, {nodes} x "
            f"{plural(spec.tasks_per_node, 'task')}{array})")
        say(f"logs in {shown_path(spec.log_dir)}")
        if not opts.quiet:
            print(job_id, flush=True)
        if not opts.wait:
            return Submitted(rec)
        return Submitted(rec, wait_and_judge(spec, job_id, cli, opts.wait_timeout, say))

    def submit_function(self, spec: JobSpec, fn: Any, args: tuple, kwargs: dict,
                        cli: SlurmCLI) -> Submitted:
        raise SpecError(f"a Python function cannot go through backend={self.name!r}",
                        "use a backend that takes functions (see ddp_hpc.submit_job)")

    def active(self, rec: records.JobRecord, cli: SlurmCLI) -> bool | None:
        """Asks squeue, never the record's kept final state (a requeued job runs again after
        status kept its PREEMPTED); None when squeue cannot answer."""
        try:
            rows = cli.squeue([rec.id])
        except SlurmError:
            return None
        return any(parse_state(r.get("State")).state.active for r in rows)

    def cancel(self, rec: records.JobRecord, job_id: str, grace: float, cli: SlurmCLI) -> str:
        scancel(job_id, cli)
        return f"job {job_id}: scancel sent"
