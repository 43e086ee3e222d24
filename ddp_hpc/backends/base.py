"""What every backend is and shares: the ``Backend`` protocol, the values it hands along
(``Plan``, ``SubmitOptions``, ``Submitted``), and the steps each submission takes whatever the
backend (its run directories, its job record).

A backend answers, for one checked ``JobSpec``:

- ``check(spec, cli, dry_run)``: refuse what it cannot run (options it does not take, what sinfo
  says the cluster cannot hold), before anything is written;
- ``plan(spec, task_cfgs) -> Plan``: what it would run (the dry run prints ``Plan.shown()``);
- ``submit(plan, cli, opts) -> Submitted``: run or queue it, write the job record;
- ``submit_function(spec, fn, args, kwargs, cli) -> Submitted``: a Python function as the job
  (``takes_functions``);
- ``active(record, cli) -> bool | None``: the job still queued or running (None: cannot tell);
- ``cancel(record, job_id, grace, cli) -> str``: stop it; what was done, in one line.

A job's state and its logs are not asked of the backend: ``ddp-hpc status`` decides a state from
all its sources in one place, and asks the backend only whether its jobs are processes on this
machine (``runs_here``) or a scheduler's.
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
from ddp_hpc.runlogs.schema import CONFIG_FILE

__all__ = ["GRACE_S", "clean_slurm_env", "cleaned_environ", "Backend", "Plan", "SubmitOptions",
           "Submitted", "CancelError", "say", "record", "make_run_dirs", "removed_note"]


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


class Backend(Protocol):
    """One way to run a job (module docstring). The attributes say what it can take, so callers
    ask them instead of comparing names."""

    name: str
    runs_here: bool               # its jobs are processes on this machine (pids in the record)
    takes_functions: bool         # a Python function as the job (ddp_hpc.submit_job)
    takes_node_range: bool        # --nodes MIN-MAX
    takes_container: bool         # --container IMAGE
    restarts_in_allocation: bool  # --spare-nodes, --min-nodes, --restart-on-error
    devices_here: bool            # its ranks use this machine's GPUs (checked here before they start)

    def check(self, spec: JobSpec, cli: Any, dry_run: bool) -> None: ...

    def plan(self, spec: JobSpec, task_cfgs: Sequence[JobConfig] | None) -> Plan: ...

    def submit(self, plan: Plan, cli: Any, opts: SubmitOptions) -> Submitted: ...

    def submit_function(self, spec: JobSpec, fn: Callable, args: tuple, kwargs: dict,
                        cli: Any) -> Submitted: ...

    def active(self, rec: records.JobRecord, cli: Any) -> bool | None: ...

    def cancel(self, rec: records.JobRecord, job_id: str, grace: float, cli: Any) -> str: ...


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
