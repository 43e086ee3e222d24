"""What the two Slurm backends (sbatch, submitit) share: their client (``SlurmCLI``), the checks
against sinfo before anything is queued, the submission's record and its lines, ``--wait``, what
the scheduler says of many jobs at once (``describe``: squeue, else sacct, else ``sacct -c``, in
one call each for all of them), whether a job is still in the queue, ``scancel`` and signals to
the ranks. Each backend says only how it queues a job and what its dry run shows."""

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
from ddp_hpc.exits import signal_name
from ddp_hpc.judge.decide import LOGS, Described
from ddp_hpc.runlogs.schema import batch_out
from ddp_hpc.slurm.cli import SlurmCLI, SlurmError
from ddp_hpc.slurm.query import cluster_or_reason, query_slurm
from ddp_hpc.slurm.states import parse_state
from ddp_hpc.text import plural, prog, shown_path

__all__ = ["SlurmBackend", "scancel", "cluster_of", "NOT_ON_PATH"]

#: what status says of a Slurm job when this machine has no Slurm commands
NOT_ON_PATH = "slurm: commands not found on PATH"


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
    """The shared part of a backend that queues jobs with Slurm (module docstring). ``client``:
    the SlurmCLI to use (None: one made when first needed, for this machine's Slurm, with an
    enclosing job's SLURM_* variables left out); ``offline``: why the scheduler is not to be
    asked (its jobs are then described without it)."""

    name = "slurm"
    describes_with = "slurm"
    runs_here = False
    takes_functions = False
    takes_node_range = False
    takes_container = False
    restarts_in_allocation = False
    devices_here = False

    def __init__(self, client: SlurmCLI | None = None, offline: str | None = None) -> None:
        self._client = client
        self.offline = offline

    @property
    def client(self) -> SlurmCLI:
        if self._client is None:
            self._client = SlurmCLI(env=clean_slurm_env(os.environ)[0], slow_note=say)
        return self._client

    def __repr__(self) -> str:
        return f"<{self.name} backend>"

    def __str__(self) -> str:
        return self.name

    def check(self, spec: JobSpec, dry_run: bool) -> None:
        preflight(spec, self.name, self.client, dry_run)

    def plan(self, spec: JobSpec, task_cfgs: Sequence[JobConfig] | None) -> Plan:
        env, removed = clean_slurm_env(os.environ)
        return Plan(spec, self.dry_run_text(spec), env, tuple(removed),
                    None if task_cfgs is None else tuple(task_cfgs))

    def dry_run_text(self, spec: JobSpec) -> str:
        raise NotImplementedError

    def queue(self, plan: Plan) -> tuple[str, str | None]:
        """Queue the job: (job id, the batch script kept for the record)."""
        raise NotImplementedError

    def submit(self, plan: Plan, opts: SubmitOptions) -> Submitted:
        spec, cli = plan.spec, self.client
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

    def submit_function(self, spec: JobSpec, fn: Any, args: tuple, kwargs: dict) -> Submitted:
        raise SpecError(f"a Python function cannot go through backend={self.name!r}",
                        "use a backend that takes functions (see ddp_hpc.submit_job)")

    def describe(self, jobs: Sequence[Any], history: bool = False,
                 only: str | None = None) -> dict[str, Described]:
        """What Slurm says of ``jobs`` (squeue, else sacct, else ``sacct -c``; one call per source
        for all of them), and of a job submitted on another cluster nothing (job ids repeat
        across clusters): a note says so. ``history``: a requeued job's earlier runs too;
        ``only``: the one source to ask (``logs``: none)."""
        tried: list[str] = []
        found: dict = {}
        foreign: set[str] = set()
        cluster = None
        ask = self.offline is None
        if self.offline:
            tried.append(self.offline)
        elif ask and self._client is None and not self.client.available():   # a client given was checked
            tried.append(NOT_ON_PATH)
            ask = False
        if only == LOGS:
            tried.append("logs: asked for with --source logs")
        elif ask:
            cluster, down = cluster_or_reason(self.client)
            foreign = {j.id for j in jobs if cluster and j.record is not None
                       and j.record.cluster not in (None, "", cluster)}
            expect = {j.id: {"name": j.record.name, "submitted_at": j.record.submitted_at}
                      for j in jobs if j.record is not None}
            ids = [j.id for j in jobs if j.id not in foreign]
            if ids:
                found, more = query_slurm(ids, self.client, expect, history=history,
                                          controller_down=down, only=only)
                tried += more
        out = {}
        for j in jobs:
            notes = ((f"submitted on cluster {j.record.cluster!r}, not this one ({cluster!r}): the scheduler "
                      "was not asked (job ids repeat across clusters)",) if j.id in foreign else ())
            out[j.id] = Described(True, found.get(j.id), tried=tuple(tried), notes=notes,
                                  output=self._output(j))
        return out

    @staticmethod
    def _output(job: Any) -> str | None:
        """The batch script's output file of ``job`` (the sbatch layout; submitit's goes to its
        own folder, and its tasks' output to the ranks' files)."""
        rec = job.record
        if rec is None or not rec.log_dir:
            return None
        if "_" in job.id:
            base, task = job.id.split("_", 1)
            return f"{rec.log_dir}/task{task}/{batch_out(f'{base}_{task}')}"
        return f"{rec.log_dir}/{batch_out(job.id)}"

    def active(self, rec: records.JobRecord) -> tuple[bool | None, str]:
        """Asks squeue, never the record's kept final state (a requeued job runs again after
        status kept its PREEMPTED); None when squeue cannot answer, or cannot speak for the job
        (it was submitted on another cluster: ids repeat across clusters)."""
        if rec.cluster:
            here = cluster_or_reason(self.client)[0]
            if here is not None and here != rec.cluster:
                return None, f"it was submitted on cluster {rec.cluster}, not on this one ({here})"
        try:
            rows = self.client.squeue([rec.id])
        except SlurmError:
            return None, "squeue did not answer"
        return any(parse_state(r.get("State")).job_state.active for r in rows), ""

    def cancel(self, rec: records.JobRecord | None, job_id: str, grace: float) -> str:
        """``scancel``; a job without a record only once Slurm knows it (scancel takes an id it
        does not know without a word)."""
        if rec is None and self.client.available():
            d = self.describe([_Bare(job_id)])[job_id]
            if d.scheduler is None:
                raise CancelError(f"no job record with id {job_id!r}, and Slurm does not know job {job_id} "
                                  "(squeue, sacct).",
                                  f"check the id with `{prog('status')}` (ddp_hpc's jobs) or squeue.")
        scancel(job_id, self.client)
        return f"job {job_id}: scancel sent"

    def signal_ranks(self, rec: records.JobRecord | None, job_id: str, signum: int) -> str:
        """``scancel --signal`` to every task of the job's steps (not the batch shell)."""
        if not self.client.available():
            raise CancelError(f"job {job_id}: Slurm's commands are not on PATH",
                              "run it on a login node of the job's cluster")
        name = signal_name(signum).removeprefix("SIG")
        self.client.cancel(job_id, signal=name)
        return f"scancel --signal={name} {job_id}"


class _Bare:
    """A job known by its id alone (no record), as ``describe`` takes it."""

    def __init__(self, job_id: str) -> None:
        self.id, self.record = job_id, None
