"""The Slurm side of the sbatch and submitit backends (``ddp_hpc.backends``): submitit's
parameters and what each of its tasks calls, the sbatch script file, and the checks against sinfo
that run before anything is submitted. (Waiting for a submitted job: ``ddp_hpc.backends.wait``.)

Why checks here and not left to sbatch: sbatch's own refusals ("Requested node configuration is
not available", "invalid partition specified") do not say which value was wrong or what would
work; sinfo does, so the request is compared against it first and the error names the fix.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any, Mapping, Sequence

from ddp_hpc.backends import render
from ddp_hpc.backends.spec import JobSpec, SpecError
from ddp_hpc.config.slurm_options import sbatch_items
from ddp_hpc.env.job import RESTART_BASE_VAR
from ddp_hpc.exits import EX_TEMPFAIL
from ddp_hpc.runlogs.schema import rank_out

__all__ = ["check_against_cluster", "submitit_parameters",
           "submitit_folder", "submitit_script", "run_task", "run_command_task", "submitit_calls"]

SUBMITIT_DIR = "submitit"         # submitit's own files (*.pkl, its logs), under the log directory


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
                  f'export OMP_NUM_THREADS="${{OMP_NUM_THREADS:-{spec.cpus_per_task}}}"',   # render.py: why
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


def submitit_script(spec: JobSpec, job_id: str) -> str | None:
    """The batch script submitit wrote for ``job_id``, if it is there."""
    path = submitit_folder(spec) / f"{job_id}_submission.sh"
    return str(path) if path.exists() else None
