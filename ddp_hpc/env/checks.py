"""Preflight: every setup that would make ``init_process_group`` hang or bind the wrong GPU, found
before it does (a batch script that runs Python without ``srun``, uneven tasks per node, more
tasks than GPUs, stale variables of an enclosing job), each an `EnvError` with a HINT.

``detect`` is the entry of the whole package: derive the `DistEnv`, raise the first problem.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import psutil

from ddp_hpc.env.gpus import gpu_index, visible_gpus
from ddp_hpc.env.model import DistEnv, EnvError
from ddp_hpc.env.sources import derive, in_batch_step, launcher_of
from ddp_hpc.slurm import hostlist

#: variables Slurm sets when a job or step asked for GPUs
GPU_REQUEST_VARS = ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS",
                    "SLURM_GPUS_PER_TASK", "SLURM_GPUS")


def process_ancestors() -> list[int]:
    """This process's pid and its parents', nearest first."""
    proc = psutil.Process()
    return [proc.pid] + [p.pid for p in proc.parents()]


def check_gpus(env: DistEnv, environ: Mapping[str, str]) -> EnvError | None:
    """Under Slurm, when GPUs were requested, every task must have exactly one GPU to bind."""
    requested = [k for k in GPU_REQUEST_VARS if environ.get(k)]
    if not requested or env.launcher not in ("slurm", "submitit"):
        return None
    visible = visible_gpus(environ) or 0
    if not visible:
        seen = ", ".join(f"{k}={environ[k]}" for k in requested)
        return EnvError(
            f"GPUs were requested ({seen}) but this task sees none "
            f"(CUDA_VISIBLE_DEVICES={environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}), "
            f"local rank {env.local_rank} on {env.hostnames[env.node_rank]}.",
            "Check --gpus-per-node/--gres on the sbatch line and that srun does not override it "
            "(e.g. --gpus=0 or --gres=none in the srun line).",
        )
    try:
        gpu_index(env, environ, visible)
    except EnvError as e:
        return e
    return None


def check_inherited(environ: Mapping[str, str], ancestors: Callable[[], list[int]]) -> EnvError | None:
    """SLURM_* variables copied from an enclosing job or step into an unrelated process."""
    job_nodes = environ.get("SLURM_JOB_NODELIST")
    node = environ.get("SLURMD_NODENAME")
    if job_nodes and node:
        try:
            inside = node in hostlist.expand(job_nodes)
        except ValueError:
            inside = True
        if not inside:
            return EnvError(
                f"SLURMD_NODENAME={node} is not in SLURM_JOB_NODELIST={job_nodes}: these SLURM_* variables were "
                f"inherited from another job (SLURM_JOB_ID={environ.get('SLURM_JOB_ID')}).",
                "Unset SLURM_* before launching (`for v in $(compgen -e SLURM_); do unset $v; done`), "
                "or start the work with srun inside its own allocation.",
            )
    task_pid = environ.get("SLURM_TASK_PID")
    if task_pid and task_pid.isdigit() and not in_batch_step(environ):
        if int(task_pid) not in ancestors():
            return EnvError(
                f"SLURM_TASK_PID={task_pid} (job {environ.get('SLURM_JOB_ID')}, "
                f"step {environ.get('SLURM_STEP_ID')}) is "
                "neither this process nor one of its parents: these SLURM_* variables were inherited from an "
                "enclosing job or step, so the ranks they describe are not this process's.",
                "Launch with srun from inside the allocation (srun sets fresh variables), or unset SLURM_* "
                "before using another launcher.",
            )
    return None


def diagnose(environ: Mapping[str, str],
             ancestors: Callable[[], list[int]] = process_ancestors) -> tuple[DistEnv | None, list[EnvError]]:
    """The derived `DistEnv` (None when it cannot be derived) and every problem found."""
    problems: list[EnvError] = []
    if launcher_of(environ) in ("slurm", "submitit"):
        inherited = check_inherited(environ, ancestors)
        if inherited:
            problems.append(inherited)
    try:
        env = derive(environ)
    except EnvError as e:
        return None, problems + [e]
    except ValueError as e:  # hostlist grammar errors already quote their input
        return None, problems + [EnvError(str(e), "Fix the Slurm host list variable named above.")]
    gpu = check_gpus(env, environ)
    return env, problems + ([gpu] if gpu else [])


def preflight(environ: Mapping[str, str] | None = None, *,
              ancestors: Callable[[], list[int]] = process_ancestors) -> list[EnvError]:
    """Every problem that would make this task hang or misbehave, each an `EnvError` with a HINT."""
    return diagnose(os.environ if environ is None else environ, ancestors)[1]


def detect(environ: Mapping[str, str] | None = None, *,
           ancestors: Callable[[], list[int]] = process_ancestors) -> DistEnv:
    """Derive the `DistEnv` of this process; raise the first problem `preflight` would report."""
    env, problems = diagnose(os.environ if environ is None else environ, ancestors)
    if problems:
        raise problems[0]
    assert env is not None
    return env
