"""The Slurm backends (submitit, rendered sbatch) and the checks that run before anything is
submitted. (Waiting for a submitted job: ``ddp_hpc.submit.wait``.)

Why checks here and not left to sbatch: sbatch's own refusals ("Requested node configuration is
not available", "invalid partition specified") do not say which value was wrong or what would
work; sinfo does, so the request is compared against it first and the error names the fix.

Why clean SLURM_* first: a submission made from inside another job (an salloc shell, a batch
script that chains jobs) inherits that job's SLURM_* variables, and sbatch/srun read many of them
as defaults (SLURM_MEM_PER_NODE, SLURM_NTASKS, SLURM_CPUS_PER_TASK...), silently changing the new
job. Only SLURM_CONF (which cluster to talk to) is kept.
"""

from __future__ import annotations

import contextlib
import os
import shlex
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from ddp_hpc.config.slurm_options import sbatch_items
from ddp_hpc.env.job import RESTART_BASE_VAR
from ddp_hpc.exits import EX_TEMPFAIL
from ddp_hpc.fsutil import atomic_write_text
from ddp_hpc.runlogs.schema import rank_out
from ddp_hpc.submit import render
from ddp_hpc.submit.spec import JobSpec, SpecError

__all__ = ["clean_slurm_env", "cleaned_environ", "check_against_cluster", "submitit_parameters",
           "submitit_folder", "submit_submitit", "submit_sbatch", "run_task", "run_command_task",
           "submitit_calls", "SCRIPT_NAME"]

KEEP_SLURM = frozenset({"SLURM_CONF"})
SCRIPT_NAME = "job.sbatch"        # the rendered script, kept in the log directory
SUBMITIT_DIR = "submitit"         # submitit's own files (*.pkl, its logs), under the log directory


def clean_slurm_env(environ: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """A copy without an enclosing job's SLURM_* / SRUN_* variables; also returns their names.
    An enclosing job's DDP_HPC_RESTART_BASE goes too (unnamed): a job sets its own."""
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


def _partition(spec: JobSpec, partitions: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The sinfo row of the partition the job will run in."""
    names = [p["name"] for p in partitions]
    if not partitions:
        raise SpecError("sinfo lists no partitions (--partition)",
                        "ask the admins which partition to use; `sinfo` should list it.")
    if spec.partition is not None:
        match = [p for p in partitions if p["name"] == spec.partition]
        if not match:
            raise SpecError(f"partition {spec.partition!r} does not exist on this cluster "
                            f"(--partition / slurm.partition)",
                            f"use one of {', '.join(names)} (sinfo lists them)")
        return match[0]
    defaults = [p for p in partitions if p.get("default")]
    if not defaults:
        raise SpecError("no --partition given and the cluster has no default partition",
                        f"pass --partition with one of {', '.join(names)}")
    return defaults[0]


def check_against_cluster(spec: JobSpec, partitions: Sequence[Mapping[str, Any]]) -> str:
    """Refuse what sinfo says cannot run; returns the partition the job will use."""
    part = _partition(spec, partitions)
    max_gpus = int(part.get("gpus_per_node") or 0)
    if spec.gpus_per_node > max_gpus:
        others = [f"{p['name']} ({p.get('gpus_per_node', 0)} GPUs)" for p in partitions
                  if int(p.get("gpus_per_node") or 0) >= spec.gpus_per_node]
        raise SpecError(
            f"--gpus {spec.gpus_per_node} asks for more GPUs per node than any node of partition "
            f"{part['name']!r} has (at most {max_gpus}, from sinfo)",
            f"use --gpus {max_gpus} or less and more --nodes"
            + (f", or a partition with more: {', '.join(others)}" if others else ""))
    if spec.options.node_range[0] + spec.options.spare_nodes > int(part.get("nodes") or 0):
        asked = f"--nodes {spec.options.nodes}" + (f" + --spare-nodes {spec.options.spare_nodes}"
                                           if spec.options.spare_nodes else "")
        raise SpecError(
            f"{asked} is more than partition {part['name']!r} has "
            f"({part.get('nodes')} nodes, from sinfo)", f"ask for {part.get('nodes')} nodes or fewer")
    return part["name"]


# ----------------------------------------------------------------------------- submitit
def run_task(config: str, overrides: list[str], log_dir: str) -> int:
    """What every submitit task runs: ``ddp_hpc.run`` in-process with the job's log directory.
    (Module-level so submitit pickles it by reference.)"""
    os.environ["DDP_HPC_LOG_DIR"] = log_dir
    from ddp_hpc import run
    try:
        rc = run.main([config, *overrides])
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    if rc:
        raise RuntimeError(f"python -m ddp_hpc.run exited with status {rc}; see {log_dir}")
    return 0


def run_command_task(command: list[str], log_dir: str, preempt_signal: str = "USR2") -> int:
    """What every submitit task of a script or module job runs: ``ddp_hpc.exec`` in-process,
    which derives this rank's torchrun variables and runs ``command`` as its child."""
    os.environ["DDP_HPC_LOG_DIR"] = log_dir
    os.environ["DDP_HPC_PREEMPT_SIGNAL"] = preempt_signal
    from ddp_hpc import exec as ddp_exec
    rc = ddp_exec.run(list(command), log_dir)
    if rc == EX_TEMPFAIL:         # stopped for preemption, checkpointed
        return rc
    if rc:
        raise RuntimeError(f"{shlex.join(command[:3])}... exited with status {rc}; see {log_dir}")
    return 0


def submitit_calls(spec: JobSpec) -> list[tuple[Any, list]]:
    """(function, arguments) per task: what submitit runs (and what --dry-run shows)."""
    if spec.is_command:
        return [(run_command_task, [[*spec.command, *t.overrides], t.log_dir, spec.signal])
                for t in spec.tasks]
    return [(run_task, [spec.config, [*spec.overrides, *t.overrides], t.log_dir])
            for t in spec.tasks]


def submitit_folder(spec: JobSpec) -> Path:
    """submitit's own files (pickles, ``<id>_submission.sh``, ``<id>_0_log.out``) go to a
    subfolder, so the log directory shows the run logs and the rank outputs first."""
    return Path(spec.log_dir) / SUBMITIT_DIR


def submitit_parameters(spec: JobSpec) -> dict[str, Any]:
    """The SlurmExecutor parameters for ``spec`` (what --dry-run shows for this backend)."""
    out = (f"{spec.log_dir}/task%a/{rank_out('%t')}" if spec.is_array
           else f"{spec.log_dir}/{rank_out('%t')}")
    extra: dict[str, Any] = {
        "time": spec.time,                           # keeps D-HH:MM:SS; submitit wants minutes
        "signal": f"{spec.signal}@{spec.grace_s}",   # submitit's default is USR2@90
        "requeue": True,
        **spec.options.sbatch_args,
    }
    params: dict[str, Any] = {
        "job_name": spec.name, "nodes": spec.nodes, "ntasks_per_node": spec.tasks_per_node,
        "gpus_per_node": spec.gpus_per_node, "cpus_per_task": spec.cpus_per_task,
        "signal_delay_s": spec.grace_s,
        "setup": [f"export SRUN_CPUS_PER_TASK={spec.cpus_per_task}",
                  f"cd {shlex.quote(spec.workdir)}"]
        + ([f"export {RESTART_BASE_VAR}={int(spec.restart_base)}"] if spec.restart_base else [])
        + [f"export {k}={shlex.quote(v)}" for k, v in spec.stage_environ().items()]
        + render.stage_sbcast_lines(spec),
        "srun_args": ["--kill-on-bad-exit=1", "--open-mode=append", f"--output={out}",
                      f"--error={out}", *render.srun_args(spec)],
        "additional_parameters": extra,
    }
    # submitit names these parameters as sbatch does, with _ for -, and takes True for a flag
    params.update({k.replace("-", "_"): True if v is None else v for k, v in sbatch_items(spec.options)})
    return params


def submit_submitit(spec: JobSpec) -> list[str]:
    """Submit through submitit; returns the job ids (``123`` or ``123_0``, ``123_1`` ...)."""
    import submitit

    ex = submitit.SlurmExecutor(folder=submitit_folder(spec), max_num_timeout=1000)
    ex.update_parameters(**submitit_parameters(spec))
    calls = submitit_calls(spec)
    fn = calls[0][0]
    with cleaned_environ():
        if spec.is_array:
            ex.update_parameters(array_parallelism=len(spec.tasks))
            jobs = ex.map_array(fn, *(list(col) for col in zip(*(args for _, args in calls))))
        else:
            jobs = [ex.submit(fn, *calls[0][1])]
    return [str(j.job_id) for j in jobs]


def submitit_script(spec: JobSpec, job_id: str) -> str | None:
    """The batch script submitit wrote for ``job_id``, if it is there."""
    path = submitit_folder(spec) / f"{job_id}_submission.sh"
    return str(path) if path.exists() else None


# ----------------------------------------------------------------------------- sbatch
def submit_sbatch(spec: JobSpec, script_text: str, cli) -> tuple[str, Path]:
    """Write the script into the log directory (kept for the record) and submit it."""
    path = Path(spec.log_dir) / SCRIPT_NAME
    atomic_write_text(path, script_text)
    job_id = cli.sbatch(script_text, cwd=spec.workdir)
    return job_id, path
