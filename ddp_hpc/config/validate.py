"""Checks of a whole job before it queues: what loading a config cannot see, because it depends on
this machine, the job's working directory and the backend.

Why here and not in the job: a typo in ``model.name``, a missing LMDB or fp16 without a GPU is
otherwise found only when the job starts -- after it waited in the queue -- on every rank at once.
``validate_job`` imports the factory modules (as the job will, from its working directory) but
calls nothing in them, and creates ``log.dir`` (which submit needs anyway).

    validate_job(cfg, backend=backends.get("submitit"), workdir="/home/me/project")   # raises ConfigError

The backend is asked what it does (``restarts_in_allocation``, ``devices_here``), never named.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Protocol

from ddp_hpc.config.batch import check_node_counts
from ddp_hpc.config.factory import resolve_factory
from ddp_hpc.config.sections import DataConfig, JobConfig, TrainConfig
from ddp_hpc.config.slurm_options import SlurmOptions
from ddp_hpc.config.typed import ConfigError
from ddp_hpc.examples import DATASET_NAMES, MODEL_NAMES

__all__ = ["validate_job", "BackendTraits"]


class BackendTraits(Protocol):
    """What the checks ask of the chosen backend (``ddp_hpc.backends.base.Backend`` has these)."""

    name: str
    restarts_in_allocation: bool   # a supervisor restarts the ranks inside the allocation
    devices_here: bool             # the ranks use this machine's devices (a CUDA check here tells)

#: data.io modes that read data.lmdb_path; only lmdb cannot do without it (stage and broadcast
#: fall back to the dataset factory, see ddp_hpc.data.io)
_READS_LMDB = ("lmdb", "stage", "broadcast")
_PACK_HINT = ("pack the dataset once (python -m ddp_hpc.data pack SRC OUT.lmdb) and set "
              "data.lmdb_path=OUT.lmdb")


def validate_job(cfg: JobConfig, *, backend: BackendTraits, workdir: str,
                 create_log_dir: bool = True, slurm: SlurmOptions | None = None) -> None:
    """Refuse, with a ConfigError naming the key, its value and the fix, a job that would fail at
    its start: a factory (model.name, data.dataset, data.eval_dataset, train.loss) that does not
    import or name a callable, data.io=lmdb without data.lmdb_path or with a path that does not
    exist, train.precision=fp16 where the job would run on CPU, a log.dir that cannot be created
    or written; or later: a node count the restart supervisor may go on with (``--min-nodes``,
    ``--nodes MIN-MAX``) on which a resume cannot keep the global batch. ``backend`` is the chosen one
    (what it does is asked of it); ``slurm`` the Slurm options with the command line's flags (default:
    the config's ``slurm:`` section); relative paths and imports are resolved from ``workdir``,
    where the job runs. ``create_log_dir=False`` (a dry run) leaves the file system alone: log.dir's
    nearest existing folder must be writable."""
    _check_node_range(cfg.train, cfg.slurm if slurm is None else slurm, backend)
    _check_data_io(cfg.data, workdir)
    _check_precision(cfg, backend)
    _check_factories(cfg, workdir)
    _check_log_dir(cfg.log.dir, workdir, create_log_dir)


def _check_node_range(train: TrainConfig, o: SlurmOptions, backend: BackendTraits) -> None:
    """The restart supervisor (a backend that restarts inside the allocation, ``--max-restarts`` >
    0) goes on with fewer nodes than
    the run started on, down to ``--min-nodes`` (a range ``--nodes MIN-MAX``: MIN), resuming the
    checkpoint with its global batch: every such count must keep it (``config.batch``)."""
    if not backend.restarts_in_allocation or o.max_restarts == 0:
        return
    low, high = o.node_range
    least = low if o.min_nodes is None else min(low, o.min_nodes)
    if least == high:
        return
    flags = f"--nodes {o.nodes}" + ("" if o.min_nodes is None else f" --min-nodes {o.min_nodes}")
    where = "slurm.nodes" + ("" if o.min_nodes is None else ", slurm.min_nodes")
    check_node_counts(train, range(low, high + 1), range(least, high + 1), o.gpus_per_node,
                      f"{flags} ({where})")


def _in(workdir: str, path: str) -> Path:
    return Path(path) if os.path.isabs(path) else Path(workdir, path)


def _check_data_io(d: DataConfig, workdir: str) -> None:
    if d.io not in _READS_LMDB:
        return
    if not d.lmdb_path:
        if d.io == "lmdb":
            raise ConfigError(f"data.io={d.io} needs data.lmdb_path, which is not set", _PACK_HINT)
        return
    path = _in(workdir, d.lmdb_path)
    if not path.exists():
        where = "" if path == Path(d.lmdb_path) else f" (from {workdir}: {path})"
        raise ConfigError(f"data.lmdb_path={d.lmdb_path} does not exist{where}; data.io={d.io} "
                          f"reads it", f"fix the path (relative paths start in the job's working "
                          f"directory), or {_PACK_HINT}")


def _check_precision(cfg: JobConfig, backend: BackendTraits) -> None:
    if cfg.train.precision != "fp16" or not backend.devices_here:
        return
    import torch  # only here: the submit command starts without it

    if not torch.cuda.is_available():
        raise ConfigError(f"train.precision=fp16 needs CUDA (GradScaler), but the {backend.name} backend "
                          "would run the job on CPU (torch.cuda.is_available() is False here)",
                          "use train.precision=fp32, or train.precision=bf16 (it works on CPU)")


def _builtins() -> dict[str, Mapping[str, Any] | None]:
    """The built-in names of each factory key (only the names: the objects need torch, which the
    check does not import); None: names without ':' are not checked here."""
    models, datasets = dict.fromkeys(MODEL_NAMES), dict.fromkeys(DATASET_NAMES)
    return {"model.name": models, "data.dataset": datasets, "data.eval_dataset": datasets,
            "train.loss": None}


def _check_factories(cfg: JobConfig, workdir: str) -> None:
    specs = {"model.name": cfg.model.name, "data.dataset": cfg.data.dataset,
             "data.eval_dataset": cfg.data.eval_dataset, "train.loss": cfg.train.loss}
    builtins = _builtins()
    for key, spec in specs.items():
        if spec:
            resolve_factory(spec, builtins[key], key, workdir=workdir)


def _check_log_dir(log_dir: str, workdir: str, create: bool) -> None:
    path = _in(workdir, log_dir)
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"log.dir={log_dir} cannot be created ({path}): "
                              f"{e.strerror or e}", _LOG_HINT) from None
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"log.dir={log_dir} cannot be created ({path}): {existing} is not a "
                          f"directory", _LOG_HINT)
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == path else \
            f"cannot be created: {existing} is not writable"
        raise ConfigError(f"log.dir={log_dir} {what} ({path})", _LOG_HINT)


_LOG_HINT = ("set log.dir to a directory you can write that every node sees, e.g. "
             "-- log.dir=/scratch/$USER/runs")
