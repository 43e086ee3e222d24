"""GPU binding: how many GPUs CUDA exposes to this task, and which one each rank takes; and
which GPUs this machine has for a local launch (``host_gpus``).

The binding rules are pure functions of a `DistEnv` and the GPU variables; `ddp_hpc.dist` binds
the device with them and the preflight checks refuse the layouts they reject, so both always agree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ddp_hpc.env.model import DistEnv, EnvError


def visible_gpus(environ: Mapping[str, str]) -> int | None:
    """GPUs CUDA will expose given CUDA_VISIBLE_DEVICES; None when the variable is unset."""
    if "CUDA_VISIBLE_DEVICES" not in environ:
        return None
    raw = environ["CUDA_VISIBLE_DEVICES"].strip()
    if raw in ("", "NoDevFiles") or raw.startswith("-"):
        return 0
    ids = [d.strip() for d in raw.split(",") if d.strip()]
    # CUDA stops at the first invalid entry ("0,-1,2" exposes one device)
    return next((i for i, d in enumerate(ids) if d.startswith("-")), len(ids))


#: device nodes a GPU driver creates (NVIDIA's control device; AMD ROCm's kernel fusion driver)
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd")


def gpu_usable(environ: Mapping[str, str], exists: Callable[[str], bool] = os.path.exists) -> bool:
    """Whether a process given ``environ`` could use a GPU: a GPU driver's device node exists and
    CUDA_VISIBLE_DEVICES, when set, exposes a device. False: it runs on the CPU, whatever it asks
    for (``ddp_hpc.exec`` says so in a script's start event, as the training core does)."""
    if visible_gpus(environ) == 0:
        return False
    return any(exists(p) for p in GPU_DEVICE_NODES)


def gpu_index(env: DistEnv, environ: Mapping[str, str], visible: int) -> int | None:
    """The CUDA index this rank binds among ``visible`` devices, or None for CPU; pure.

    What Slurm 22.05 sets (seen on the test cluster, 2 tasks per node; srun tasks get no
    SLURM_GPUS_PER_TASK, and SLURM_GPUS_ON_NODE counts the step's GPUs on the node):

    =================================  ====================  ==================  ===========
    request                            CUDA_VISIBLE_DEVICES  SLURM_GPUS_ON_NODE  index
    =================================  ====================  ==================  ===========
    --gpus-per-node=2                  0,1 (every task)      2                   local rank
    --gpus-per-task=1                  0 / 1                 2                   0
    --gpus-per-task=2                  0,1 / 2,3             4                   0
    --gpus-per-node=4 --gpu-bind=...   0 / 1                 4                   0
    =================================  ====================  ==================  ===========

    A task that sees fewer GPUs than its node has (or one GPU, or SLURM_GPUS_PER_TASK is set)
    owns them and takes cuda:0; tasks that all see the node's GPUs take cuda:local_rank. Fewer
    GPUs than tasks on a node, and (under Slurm) more GPUs than tasks, are `EnvError`s.
    """
    if visible == 0:
        return None
    seen = f"CUDA_VISIBLE_DEVICES={environ.get('CUDA_VISIBLE_DEVICES', '<unset>')} ({visible} visible)"
    raw_on_node = environ.get("SLURM_GPUS_ON_NODE", "")
    on_node = int(raw_on_node) if raw_on_node.isdigit() else 0
    where = f"{env.local_world_size} tasks on node {env.node_rank}"
    if 0 < on_node < env.local_world_size:
        raise EnvError(
            f"{where} but only SLURM_GPUS_ON_NODE={on_node} GPUs there ({seen}): "
            f"local rank {env.local_rank} has no GPU to bind.",
            f"Use one task per GPU: --ntasks-per-node={on_node} with --gpus-per-node={on_node}, or --gpus-per-task=1.")
    if visible == 1 or visible < on_node or environ.get("SLURM_GPUS_PER_TASK"):
        return 0  # this task's own device(s): the first is cuda:0
    if env.local_rank >= visible:
        raise EnvError(
            f"local rank {env.local_rank} (rank {env.rank}, {where}) has no GPU to bind: {seen}.",
            f"Use one task per GPU: --ntasks-per-node={visible} with --gpus-per-node={visible}, or "
            "--gpus-per-task=1; for CPU-only runs set CUDA_VISIBLE_DEVICES= (empty).")
    if on_node and env.local_world_size < visible:
        raise EnvError(
            f"{where} but each sees {visible} GPUs ({seen}, SLURM_GPUS_ON_NODE={on_node}): "
            f"{visible - env.local_world_size} GPUs would stay idle.",
            f"Use one task per GPU: --ntasks-per-node={visible} with --gpus-per-node={visible}, or --gpus-per-task=1.")
    return env.local_rank


@dataclass(frozen=True)
class HostGpus:
    """The GPUs this machine gives a local launch: their CUDA_VISIBLE_DEVICES ids (empty: run on
    the CPU) and where that count came from, in words for messages."""
    ids: tuple[str, ...]
    source: str


def host_gpus(environ: Mapping[str, str], *, which: Callable[..., str | None] = shutil.which,
              run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> HostGpus:
    """CUDA_VISIBLE_DEVICES when set (the ids up to the first invalid one, as CUDA reads it),
    else one id per line of ``nvidia-smi -L`` when nvidia-smi is on PATH, else none. Never
    imports torch: the submitting process stays light and CUDA-free."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        raw = environ["CUDA_VISIBLE_DEVICES"]
        ids = tuple(d.strip() for d in raw.split(",") if d.strip())[:visible_gpus(environ) or 0]
        return HostGpus(ids, f"CUDA_VISIBLE_DEVICES={raw!r}")
    smi = which("nvidia-smi", path=environ.get("PATH"))
    if smi is None:
        return HostGpus((), "no nvidia-smi on PATH and CUDA_VISIBLE_DEVICES unset")
    try:
        done = run([smi, "-L"], capture_output=True, text=True, timeout=20, env=dict(environ))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return HostGpus((), f"`nvidia-smi -L` failed ({exc})")
    if done.returncode != 0:
        return HostGpus((), f"`nvidia-smi -L` exited with status {done.returncode}")
    count = sum(1 for line in done.stdout.splitlines() if line.startswith("GPU "))
    return HostGpus(tuple(str(i) for i in range(count)), f"`nvidia-smi -L` lists {count}")
