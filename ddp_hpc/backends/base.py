"""What every backend is and shares: the ``Backend`` protocol, the values it hands along
(``Plan``, ``SubmitOptions``, ``Submitted``), and the steps each submission takes whatever the
backend (its run directories, its job record).

A backend owns its client (a Slurm backend its ``SlurmCLI``, made when first needed, or the one it
was made with) and answers, for one checked ``JobSpec`` or for its jobs:

- ``check(spec, dry_run)``: refuse what it cannot run (options it does not take, what sinfo
  says the cluster cannot hold), before anything is written;
- ``plan(spec, task_cfgs) -> Plan``: what it would run (the dry run prints ``Plan.shown()``);
- ``submit(plan, opts) -> Submitted``: run or queue it, write the job record;
- ``submit_function(spec, fn, args, kwargs) -> Submitted``: a Python function as the job
  (``takes_functions``);
- ``describe(jobs, history, only) -> {id: Described}``: what it can tell about many of its jobs
  at once (one squeue call for all of them; a local job's recorded processes), before any log
  is read; ``ddp_hpc.judge.decide`` decides each job's state from that, its record and its logs;
- ``active(rec) -> (bool | None, why)``: the job still queued or running (None: cannot tell, and
  why not), asked of the live source alone, never of a final state the record keeps;
- ``cancel(rec, job_id, grace) -> str``: stop it; what was done, in one line;
- ``signal_ranks(rec, job_id, signum) -> str``: send every rank a signal (``status --stacks``).

``describes_with``: backends with the same value answer ``describe`` for each other's jobs in
one call (sbatch and submitit: one squeue for the jobs of both).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import yaml

from ddp_hpc import records
from ddp_hpc.backends.spec import JobSpec, SpecError
from ddp_hpc.config import JobConfig, config_to_dict
from ddp_hpc.env.job import RESTART_BASE_VAR
from ddp_hpc.errors import HintError
from ddp_hpc.fsutil import atomic_write_text
from ddp_hpc.judge.decide import Described
from ddp_hpc.runlogs.schema import CONFIG_FILE
from ddp_hpc.slurm.query import SourceState

__all__ = ["GRACE_S", "clean_slurm_env", "cleaned_environ", "Backend", "BackendDefaults", "JobRef", "Described",
           "SourceState", "Plan", "SubmitOptions", "Submitted", "CancelError", "say", "record", "make_run_dirs",
           "removed_note"]


#: seconds between SIGTERM and SIGKILL when a local job is cancelled
GRACE_S = 5.0


class CancelError(HintError, LookupError):
    """A job that cannot be cancelled as asked; names the id, the hint says what to do."""


@dataclass(frozen=True)
class SubmitOptions:
    """How to submit, beside what (the spec): the command line's --dry-run, --wait,
    --wait-timeout; ``quiet``: no job id on stdout (the Python API)."""

    dry_run: bool = False
    wait: bool = False
    wait_timeout: float | None = None
    quiet: bool = False


@dataclass(frozen=True)
class Plan:
    """What a backend would run for a spec: ``text`` is what --dry-run prints (a batch script,
    submitit's parameters, the launcher commands), or a function without arguments that makes it
    where only a dry run needs it (`shown`); ``env`` the environment it submits with (an
    enclosing job's SLURM_* removed), ``removed`` the names taken out; ``task_cfgs`` each task's
    config (None for a script, module or function job), written into its run directory."""

    spec: JobSpec
    text: str | Callable[[], str]
    env: Mapping[str, str]
    removed: tuple[str, ...] = ()
    task_cfgs: tuple[JobConfig, ...] | None = None

    def shown(self) -> str:
        """What --dry-run prints."""
        return self.text() if callable(self.text) else self.text


@dataclass
class Submitted:
    """What a submission left: its job record (None for a dry run), the exit status of the
    submit command (``--wait``: the job's verdict), and for a function job the handles the
    Python API's ``Job`` follows (submitit's job, or the local driver and its pipe)."""

    record: records.JobRecord | None
    exit_code: int = 0
    handles: dict[str, Any] = field(default_factory=dict)


class JobRef(Protocol):
    """A job as ``describe`` takes it: its id (an array task's ``123_4``) and its record (None
    for a job known by its id alone)."""

    id: str
    record: records.JobRecord | None


class Backend(Protocol):
    """One way to run a job (module docstring). The attributes say what it can take, so callers
    ask them instead of comparing names. Made by its class (``backends.register``) with the
    keywords ``client`` (the scheduler client to use; None: its own) and ``offline`` (why its
    scheduler is not to be asked; None: ask it)."""

    name: str
    describes_with: str           # backends with one value answer describe() for each other's jobs
    runs_here: bool               # its jobs are processes on this machine (pids in the record)
    takes_functions: bool         # a Python function as the job (ddp_hpc.submit_job)
    takes_node_range: bool        # --nodes MIN-MAX
    takes_container: bool         # --container IMAGE
    restarts_in_allocation: bool  # --spare-nodes, --min-nodes, --restart-on-error
    devices_here: bool            # its ranks use this machine's GPUs (checked here before they start)

    def check(self, spec: JobSpec, dry_run: bool) -> None: ...

    def plan(self, spec: JobSpec, task_cfgs: Sequence[JobConfig] | None) -> Plan: ...

    def submit(self, plan: Plan, opts: SubmitOptions) -> Submitted: ...

    def submit_function(self, spec: JobSpec, fn: Callable, args: tuple, kwargs: dict) -> Submitted: ...

    def describe(self, jobs: Sequence[JobRef], history: bool = False,
                 only: str | None = None) -> dict[str, Described]: ...

    def active(self, rec: records.JobRecord) -> tuple[bool | None, str]: ...

    def cancel(self, rec: records.JobRecord | None, job_id: str, grace: float) -> str: ...

    def signal_ranks(self, rec: records.JobRecord | None, job_id: str, signum: int) -> str: ...


class BackendDefaults:
    """What a new backend may take from here rather than write: every capability off, the
    keywords it is made with kept (``client``, ``offline``), its jobs described with no other
    backend's, no Python functions, ``active`` from its own ``describe``, and no signals to the
    ranks. A subclass writes ``name``, ``check``, ``plan``, ``submit``, ``describe`` and
    ``cancel`` (docs/architecture.md, "The Backend seam")."""

    name = "?"
    runs_here = takes_functions = takes_node_range = takes_container = False
    restarts_in_allocation = devices_here = False

    def __init__(self, client: Any = None, offline: str | None = None) -> None:
        self.client, self.offline = client, offline

    @property
    def describes_with(self) -> str:
        return self.name

    def submit_function(self, spec: JobSpec, fn: Callable, args: tuple, kwargs: dict) -> Submitted:
        raise SpecError(f"a Python function cannot go through backend={self.name!r}",
                        "use a backend that takes functions (see ddp_hpc.submit_job), or submit a script")

    def active(self, rec: records.JobRecord) -> tuple[bool | None, str]:
        told = self.describe([rec]).get(str(rec.id))   # type: ignore[attr-defined]
        if told is None or told.scheduler is None:
            return None, f"the {self.name} backend does not list job {rec.id}"
        return told.scheduler.info.job_state.active, ""

    def signal_ranks(self, rec: records.JobRecord | None, job_id: str, signum: int) -> str:
        raise CancelError(f"the {self.name} backend cannot send a signal to the ranks of job {job_id}",
                          "see the job's logs: ddp-hpc status JOBID --logs")


#: the one SLURM_* variable a submission keeps: which cluster Slurm's commands talk to
KEEP_SLURM = frozenset({"SLURM_CONF"})


def clean_slurm_env(environ: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """The environment a submission runs with, whatever the backend. A submission made from
    inside another job (an salloc shell, a batch script that chains jobs) inherits that job's
    SLURM_* variables, and sbatch/srun read many of them as defaults (SLURM_MEM_PER_NODE,
    SLURM_NTASKS, SLURM_CPUS_PER_TASK...), silently changing the new job; only SLURM_CONF (which
    cluster to talk to) is kept. Returns a copy without an enclosing job's SLURM_* / SRUN_*
    variables, and their names. An enclosing job's DDP_HPC_RESTART_BASE goes too (unnamed): a
    job sets its own."""
    removed = sorted(k for k in environ
                     if (k.startswith("SLURM_") and k not in KEEP_SLURM) or k.startswith("SRUN_"))
    return {k: v for k, v in environ.items() if k not in removed and k != RESTART_BASE_VAR}, removed


@contextlib.contextmanager
def cleaned_environ() -> Iterator[list[str]]:
    """Remove SLURM_* from os.environ while submitit runs sbatch (it inherits this process's
    environment), and put them back afterwards."""
    clean, removed = clean_slurm_env(os.environ)
    saved = {k: v for k, v in os.environ.items() if k not in clean}
    for k in saved:
        del os.environ[k]
    try:
        yield removed
    finally:
        os.environ.update(saved)


def say(msg: str) -> None:
    """One line of the submit command on stderr."""
    print(f"ddp_hpc submit: {msg}", file=sys.stderr, flush=True)


def record(spec: JobSpec, job_id: str, backend: Backend, cluster: str, *,
           script: str | None = None, pids=None) -> records.JobRecord:
    """Write the job record of a submission (``ddp_hpc.records``); a job of a backend that runs
    here has no time limit and runs the most nodes of a range (no MIN to keep)."""
    array = None
    if spec.is_array:
        array = [{"task_id": t.task_id, "overrides": list(t.overrides), "log_dir": t.log_dir}
                 for t in spec.tasks]
    ranged = isinstance(spec.options.nodes, str) and not backend.runs_here
    rec = records.JobRecord(
        id=job_id, cluster=cluster, name=spec.name, backend=backend.name, nodes=spec.nodes,
        gpus_per_node=spec.gpus_per_node, time_limit=None if backend.runs_here else spec.time,
        log_dir=spec.log_dir, config=spec.config, overrides=list(spec.overrides),
        submitted_at=time.time(), cwd=spec.workdir, array=array, pids=pids, script=script,
        command=list(spec.command) if spec.is_command else None, restart_base=spec.restart_base,
        min_nodes=spec.options.node_range[0] if ranged else None)
    records.write_record(rec)
    return rec


def make_run_dirs(spec: JobSpec, task_cfgs: Sequence[JobConfig] | None) -> None:
    """Every log directory (Slurm cannot create the directory of --output itself), each with a
    copy of the config its run trains with (`task_cfgs`, one per task; None for a script job),
    the Slurm options as submitted included."""
    try:
        Path(spec.log_dir).mkdir(parents=True, exist_ok=True)
        for t in spec.tasks:
            Path(t.log_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SpecError(f"cannot create the log directory {spec.log_dir}: {exc.strerror}",
                        "choose a writable place with --log-dir (or log.dir= for a config)") from exc
    for t, cfg in zip(spec.tasks, task_cfgs or (), strict=task_cfgs is not None):
        resolved = config_to_dict(dataclasses.replace(cfg, slurm=spec.options))
        atomic_write_text(Path(t.log_dir) / CONFIG_FILE,
                          yaml.safe_dump(resolved, sort_keys=False))


def removed_note(removed: Sequence[str]) -> str:
    """The line that says which SLURM_* variables of an enclosing job were left out."""
    return (f"removed {len(removed)} SLURM_* variables of an enclosing job: "
            f"{', '.join(removed[:6])}" + (" ..." if len(removed) > 6 else ""))
