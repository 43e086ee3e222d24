"""ddp_hpc: PyTorch DDP from a laptop to many Slurm GPU nodes.

Data flow (see docs/architecture.md): config -> submit -> env -> dist -> data -> train -> run logs -> status.

The public names, imported on first use (``import ddp_hpc`` itself loads neither torch nor
submitit, so the command-line tools start fast):

    ddp_hpc.submit_job(fn_or_command, nodes=2, gpus=4, ...)   submit a job; returns a handle
    ddp_hpc.fit(model, dataset, config=...)                   train with ddp_hpc's loop
    ddp_hpc.setup_ddp() / ddp_hpc.cleanup_ddp()               process group for any launcher
    ddp_hpc.launch_distributed(fn, world_size)                a function on N local processes
    ddp_hpc.preemption.requested() / .requeue()               preemption in your own script
    ddp_hpc.checkpoint.save(...) / .load(...)                 atomic rank-0 checkpoints
    ddp_hpc.report(step=, total=, loss=)                      progress that ddp-hpc status shows

``ddp_hpc.submit`` is the package of ``ddp-hpc submit`` (``python -m ddp_hpc.submit``).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: public name -> (module, attribute or None for the module itself)
_PUBLIC = {
    "submit_job": ("ddp_hpc.submit.api", "submit_job"),
    "fit": ("ddp_hpc.train.api", "fit"),
    "setup_ddp": ("ddp_hpc.dist", "setup_ddp"),
    "cleanup_ddp": ("ddp_hpc.dist", "cleanup_ddp"),
    "launch_distributed": ("ddp_hpc.launch.spawn", "launch_distributed"),
    "preemption": ("ddp_hpc.preemption", None),
    "checkpoint": ("ddp_hpc.checkpoint", None),
    "report": ("ddp_hpc.progress", "report"),
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'ddp_hpc' has no attribute {name!r}")
    module, attr = _PUBLIC[name]
    value = importlib.import_module(module)
    return value if attr is None else getattr(value, attr)


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
