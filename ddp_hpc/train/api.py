"""Python entry points: `fit` (your model and dataset), `train_ddp` (the mp.spawn-style signature),
and `run_job` (a JobConfig, used by ``python -m ddp_hpc.run``).

Why three: `python -m ddp_hpc.run` covers jobs described in YAML; `fit` is for users who build
their model and dataset in Python but want the same loop, checkpoints, preemption handling and
run logs; `train_ddp(rank, world_size, model_class, data, epochs)` is the classic mp.spawn-style
function and plugs straight into ``launch_distributed``:

    from ddp_hpc.launch import launch_distributed
    results = launch_distributed(train_ddp, 4, args=(MyNet, (X, y), 3))

All three set up the process group when none exists (``ddp_hpc.dist.setup_ddp``, which reads the
launcher's variables) and tear it down again; an existing group is used as is.
"""
from __future__ import annotations

import dataclasses
import gc
import os
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.utils.data import Dataset, Subset, TensorDataset

from ddp_hpc import dist as ddp_dist
from ddp_hpc.config import (
    ConfigError,
    JobConfig,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    load_config,
    resolve_factory,
    run_key,
)
from ddp_hpc.env import detect
from ddp_hpc.errors import HintError
from ddp_hpc.examples.models import BUILTIN_MODELS
from ddp_hpc.examples.synthetic import BUILTIN_DATASETS
from ddp_hpc.fsutil import atomic_write_text
from ddp_hpc.runlogs.schema import CONFIG_FILE
from ddp_hpc.runlogs.startup import rendezvous_fields
from ddp_hpc.runlogs.writer import RunLog, resolve_log_dir
from ddp_hpc.text import plural
from ddp_hpc.train.build import seed_everything
from ddp_hpc.train.loop import Trainer
from ddp_hpc.train.parts import TrainParts
from ddp_hpc.train.result import TrainResult

__all__ = ["fit", "train_ddp", "run_job", "make_config", "build_model", "build_datasets",
           "build_loss", "TrainResult"]


def make_config(config: JobConfig | Mapping | str | Path | None = None,
                overrides: Iterable[str] = ()) -> JobConfig:
    """A JobConfig from a YAML path, a nested dict, a JobConfig or nothing, plus overrides."""
    overrides = list(overrides)
    if isinstance(config, JobConfig):
        if not overrides:
            return config
        return config_from_dict(apply_overrides(config_to_dict(config), overrides),
                                f"config + overrides {overrides}")
    if config is None or isinstance(config, (str, Path)):
        return load_config(config, overrides)
    return config_from_dict(apply_overrides(dict(config), overrides), "the config dict")


def build_model(cfg: JobConfig) -> nn.Module:
    factory = resolve_factory(cfg.model.name, BUILTIN_MODELS, "model.name")
    seed_everything(cfg.train.seed)          # identical initial weights on every rank
    try:
        model = factory(**cfg.model.kwargs)
    except TypeError as e:
        raise ConfigError(
            f"model.name={cfg.model.name!r} rejected model.kwargs={cfg.model.kwargs!r}: {e}",
            "pass only arguments its constructor accepts") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.name={cfg.model.name!r} returned {type(model).__name__}, "
                          f"not a torch.nn.Module", "make the factory return the model (an nn.Module)")
    return model


def _dataset_factory(spec: str, kwargs: Mapping, key: str, kwargs_key: str) -> Callable[[], Dataset]:
    """The dataset factory of ``key``; its errors name the config keys that built it."""
    factory = resolve_factory(spec, BUILTIN_DATASETS, key)

    def make() -> Dataset:
        try:
            return factory(**kwargs)
        except HintError as e:
            raise ConfigError(f"{kwargs_key}={dict(kwargs)!r} for {key}={spec!r}: {e.problem}", e.hint) from None
        except TypeError as e:
            raise ConfigError(f"{key}={spec!r} rejected its kwargs {kwargs_key}={dict(kwargs)!r}: {e}",
                              "pass only arguments the dataset factory accepts") from None
    return make


def build_datasets(cfg: JobConfig, ctx) -> tuple[Dataset, Dataset | None, Callable | None]:
    """(train dataset, eval dataset or None, batches function for io != direct or None)."""
    d = cfg.data
    make_train = _dataset_factory(d.dataset, d.kwargs, "data.dataset", "data.kwargs")
    eval_ds = None
    if d.eval_dataset:
        eval_ds = _dataset_factory(d.eval_dataset, d.eval_kwargs, "data.eval_dataset", "data.eval_kwargs")()
    if d.io == "direct":
        train = make_train()
        if d.eval_split and eval_ds is None:
            n_eval = max(1, int(len(train) * d.eval_split))
            perm = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.train.seed))
            eval_ds = Subset(train, perm[:n_eval].tolist())
            train = Subset(train, perm[n_eval:].tolist())
        return train, eval_ds, None
    if d.eval_split:
        raise ConfigError(
            f"data.eval_split={d.eval_split} works with data.io=direct only, not {d.io!r}",
            "name a separate data.eval_dataset")
    from ddp_hpc.data.io import make_train_batches, open_train_data  # lmdb: only for these modes
    train = open_train_data(d, ctx, make_train)
    seed = cfg.train.seed

    def batches(epoch: int, start_batch: int, batch_size: int):   # the batch size chosen at resume
        return make_train_batches(train, d, ctx, batch_size=batch_size, seed=seed,
                                  epoch=epoch, start_batch=start_batch, num_workers=d.num_workers)
    return train, eval_ds, batches


def build_loss(cfg: JobConfig) -> tuple[Callable, bool]:
    """(loss function, is classification)."""
    builtins = {"cross_entropy": nn.CrossEntropyLoss, "mse": nn.MSELoss}
    return resolve_factory(cfg.train.loss, builtins, "train.loss")(), cfg.train.loss == "cross_entropy"


# ----------------------------------------------------------------------------- process group

class _Context:
    """Stand-in for ddp_hpc.dist.DistContext when the caller already set up a process group."""

    def __init__(self, env, device):
        self.env, self.device, self.backend = env, device, dist.get_backend() if ddp_dist.group_initialized() else None


def _context(rank: int | None, world_size: int | None, timeout_s: float = 1800.0):
    """(context, whether we created the group)."""
    if ddp_dist.group_initialized():
        env = detect()
        env = dataclasses.replace(env, rank=dist.get_rank(), world_size=dist.get_world_size())
        device = ddp_dist.select_device(env)
        if device.type == "cuda":   # nccl's object collectives and .cuda() use the current device
            torch.cuda.set_device(device)
        return _Context(env, device), False
    return ddp_dist.setup_ddp(rank, world_size, timeout=timeout_s), True


def _teardown(ok: bool) -> None:
    """Free the DDP wrapper, then destroy our process group (after a clean run, behind a barrier).

    DDP sits in a reference cycle; left to the collector at interpreter exit, its reducer is
    destroyed after torch's own state and the process aborts ("terminate called without an
    active exception") in about one run of ten with 2 gloo ranks.  gc.collect() here frees it
    while everything is alive.  After an error there is no barrier: a peer may be dead."""
    gc.collect()
    if ok and ddp_dist.group_has_peers():
        dist.barrier()
    ddp_dist.cleanup_ddp()


def _run_id(env, cfg: JobConfig) -> str:
    """The job id; without one (a plain ``python -m ddp_hpc.run``, torchrun) the config's run key
    (``<name>-<hash of the resolved config>``): the same command again finds the same run
    directory and resumes from its checkpoints, as a requeued Slurm job does. Every rank derives
    the same id."""
    return str(env.job_id) if env.job_id else run_key(cfg)


def _train(cfg: JobConfig, ctx, parts: TrainParts) -> TrainResult:
    env = ctx.env
    log_dir = resolve_log_dir(cfg.log.dir, _run_id(env, cfg))
    log = RunLog(log_dir, env.rank, env.job_id, env.restart_count, start_first=True)
    log_dir = log_dir.absolute()           # events name paths other tools open from elsewhere
    if env.rank == 0 and not (log_dir / CONFIG_FILE).exists():   # submit's copy (with Slurm options) wins
        atomic_write_text(log_dir / CONFIG_FILE, yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    ckpt_dir = Path(cfg.checkpoint.dir).absolute() if cfg.checkpoint.dir else log_dir / "checkpoints"
    step, trainer = 0, None
    try:
        trainer = Trainer(cfg, ctx, parts, log, checkpoint_dir=ckpt_dir)
        log.event("start", world_size=env.world_size, num_nodes=env.num_nodes,
                  local_rank=env.local_rank, pid=os.getpid(), total_steps=trainer.total_steps,
                  epochs=cfg.train.epochs, launcher=env.launcher, device=str(ctx.device))
        if (marks := rendezvous_fields()) is not None:   # a run's first event is its start; the
            log.event("rendezvous", **marks)            # marks carry their own times
        log.info(f"start: {plural(env.world_size, 'rank')} on {plural(env.num_nodes, 'node')}, launcher "
                 f"{env.launcher}, device {ctx.device}, {trainer.total_steps} steps, log dir "
                 f"{log_dir}, checkpoints {ckpt_dir}")
        _stage_log(cfg, parts.train_data, log)
        result = trainer.run()
        step = result.step
        status = "interrupted" if result.reason == "interrupted" else result.status
        log.event("end", status=status, step=result.step)
        log.info(f"end: {status} at step {result.step}"
                 + (f" ({result.reason})" if result.reason and result.reason != status else ""))
        if result.status == "preempted" and not result.requeued:
            log.info(_how_to_resume(env, ckpt_dir))
        return result
    except BaseException as e:
        log.event("error", exc_type=type(e).__name__, message=str(e),
                  traceback=traceback.format_exc())
        log.event("end", status="failed", step=getattr(trainer, "step_done", step))
        log.info(f"FAILED: {type(e).__name__}: {e}")
        raise
    finally:
        log.close()


def _stage_log(cfg: JobConfig, train_ds, log) -> None:
    """A node leader's staging line and event, held while its run log did not exist yet (a plain
    launch: the log directory is known only here)."""
    if train_ds is not None and cfg.data.io == "stage":
        from ddp_hpc.data.io import take_stage_log
        for line, fields in take_stage_log(train_ds):
            log.info(line)
            log.event("stage", **fields)


def _how_to_resume(env, ckpt_dir: Path) -> str:
    same = ("run the same command again (the same config and overrides find the same run "
            "directory), or " if not env.job_id else "")
    return f"to resume: {same}add checkpoint.dir={ckpt_dir} to any launch of this config"


def fit(model: nn.Module, train_dataset: Dataset, *, eval_dataset: Dataset | None = None,
        config: JobConfig | Mapping | str | Path | None = None, overrides: Iterable[str] = (),
        loss_fn: Callable | None = None, classification: bool | None = None,
        on_step: Callable[[int, int], None] | None = None,
        rank: int | None = None, world_size: int | None = None) -> TrainResult:
    """Train your `model` on your `train_dataset` with the toolkit's loop; returns this rank's
    TrainResult (`.model` is the trained plain module).  `config` gives everything else (batch
    size per rank, epochs, optimizer, checkpoints, ...); the model/data sections are ignored."""
    cfg = make_config(config, overrides)
    if loss_fn is None:
        loss_fn, is_cls = build_loss(cfg)
        classification = is_cls if classification is None else classification
    ctx, own = _context(rank, world_size, cfg.train.collective_timeout_s)
    ok = False
    try:
        parts = TrainParts(model, train_dataset, loss_fn, eval_dataset,
                           bool(classification if classification is not None else True),
                           on_step=on_step)
        result = _train(cfg, ctx, parts)
        ok = True
        return result
    finally:
        if own:
            _teardown(ok)


def train_ddp(rank: int, world_size: int, model_class: Callable[..., nn.Module], data: Any,
              epochs: int, *, model_kwargs: Mapping | None = None, eval_data: Any = None,
              config: JobConfig | Mapping | str | Path | None = None,
              overrides: Iterable[str] = (), **train_options: Any) -> TrainResult:
    """The mp.spawn-style signature.  `data` is a Dataset or a tuple of tensors (X, y);
    `train_options` are train.* settings (batch_size=64, grad_accum=2, ...)."""
    opts = [f"train.epochs={epochs}"] + [f"train.{k}={v!r}" if isinstance(v, str) else
                                         f"train.{k}={v}" for k, v in train_options.items()]
    cfg = make_config(config, [*opts, *overrides])
    seed_everything(cfg.train.seed)
    model = model_class(**(model_kwargs or {}))
    to_ds = lambda d: d if d is None or isinstance(d, Dataset) else TensorDataset(*d)  # noqa: E731
    return fit(model, to_ds(data), eval_dataset=to_ds(eval_data), config=cfg,
               rank=rank, world_size=world_size)


def run_job(cfg: JobConfig, on_step: Callable[[int, int], None] | None = None) -> TrainResult:
    """Everything `python -m ddp_hpc.run` does after parsing: build, set up, train, tear down."""
    model = build_model(cfg)                 # config mistakes fail before any rendezvous
    loss_fn, classification = build_loss(cfg)
    _dataset_factory(cfg.data.dataset, cfg.data.kwargs, "data.dataset", "data.kwargs")
    if cfg.data.eval_dataset:
        _dataset_factory(cfg.data.eval_dataset, cfg.data.eval_kwargs, "data.eval_dataset", "data.eval_kwargs")
    ctx, own = _context(None, None, cfg.train.collective_timeout_s)
    ok = False
    try:
        train_ds, eval_ds, batches = build_datasets(cfg, ctx)
        result = _train(cfg, ctx, TrainParts(model, train_ds, loss_fn, eval_ds, classification,
                                             batches=batches, on_step=on_step))
        if cfg.data.io != "direct":         # e.g. remove a staged copy once the run completed
            from ddp_hpc.data.io import close_train_data
            close_train_data(train_ds, cfg.data, ctx, completed=result.status == "completed")
        ok = True
        return result
    finally:
        if own:
            _teardown(ok)
