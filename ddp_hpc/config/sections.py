"""The sections of a job config: frozen kw-only dataclasses whose fields are the only valid keys,
and the checks across fields that a type alone cannot say (``_validate``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ddp_hpc.config.slurm_options import SlurmOptions
from ddp_hpc.config.typed import ConfigError
from ddp_hpc.exits import EX_TEMPFAIL, signal_number

__all__ = ["ModelConfig", "DataConfig", "OptimConfig", "ScheduleConfig", "TrainConfig",
           "CheckpointConfig", "PreemptConfig", "LogConfig", "JobConfig"]

@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """What to train: ``name`` is a built-in (see ddp_hpc.examples.models.BUILTIN_MODELS) or an
    import path ``pkg.mod:factory``; ``kwargs`` are passed to the factory."""
    name: str = "mlp"
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where samples come from and how they reach each rank (the IO layer reads the io fields)."""
    dataset: str = "synthetic"           # built-in name or ``pkg.mod:factory`` returning a Dataset
    kwargs: dict = field(default_factory=dict)
    eval_dataset: str | None = None      # None: no evaluation unless eval_split > 0
    eval_kwargs: dict = field(default_factory=dict)
    eval_split: float = 0.0              # hold out this fraction of `dataset` (deterministic) for eval
    io: Literal["direct", "lmdb", "stage", "broadcast"] = "direct"
    lmdb_path: str | None = None
    stage_to: str = "auto"               # auto | slurm_tmpdir | tmpdir | shm | an absolute path
    stage_cleanup: bool = True
    broadcast_groups: Literal["node", "strided", "two_level"] = "node"
    broadcast_bucket_mb: float = 1.0     # io=broadcast: ship small steps together up to this size (0: off)
    num_workers: int = 0


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    name: Literal["sgd", "adam", "adamw"] = "sgd"
    lr: float = 0.1
    momentum: float = 0.0                # sgd only
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)   # adam / adamw


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """Learning rate per optimizer step: linear warmup, then constant / cosine / step decay."""
    name: Literal["constant", "cosine", "step"] = "constant"
    warmup_steps: int = 0
    step_size: int = 1000                # step: multiply by gamma every step_size optimizer steps
    gamma: float = 0.1
    min_lr_ratio: float = 0.0            # cosine: final lr = lr * min_lr_ratio


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    batch_size: int = 32                 # per rank, per micro-batch
    epochs: int = 1
    max_steps: int | None = None         # optimizer steps; stops early when reached
    grad_accum: int = 1                  # micro-batches per optimizer step (no_sync on all but last)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"   # fp16 needs CUDA (GradScaler)
    clip_grad_norm: float | None = None
    seed: int = 0
    loss: str = "cross_entropy"          # cross_entropy | mse | pkg.mod:factory
    eval_every_epochs: int = 1           # 0: only at the end
    eval_batch_size: int | None = None   # default: batch_size
    strategy: Literal["ddp", "dp", "single"] = "ddp"   # dp: DataParallel, one process (slower)
    find_unused_parameters: bool = False
    static_graph: bool = False
    filter_zero_grads: bool = False      # drop all-zero grads before step (NAS-style nets)
    sync_buffers_at_end: bool = True     # broadcast rank 0's buffers after the last step
    device: Literal["auto", "cpu", "cuda"] = "auto"
    collective_timeout_s: float = 1800.0  # a rank stuck this long in a collective fails the job
    # resuming on another number of ranks keeps the global batch with grad_accum; these allow more:
    allow_batch_size_change: bool = False    # also change the per-rank batch to keep the global batch
    allow_global_batch_change: bool = False  # go on with the nearest global batch when none keeps it


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    dir: str | None = None               # default: <run log dir>/checkpoints
    every_steps: int = 0                 # 0: only at epoch ends (and on preemption)
    every_epochs: int = 1
    keep_last: int = 3
    resume: bool = True                  # resume from the newest valid checkpoint in dir
    # the key `async` (a Python keyword): the training thread only copies the state, a background
    # thread writes the file (train/asyncsave.py); false: the training thread writes it
    async_: bool = field(default=True, metadata={"key": "async"})
    # node-memory snapshots (train/memsnap.py): every N steps; 0: auto (cost <= 1% of a step); -1: off
    memory_every_steps: int = 0


@dataclass(frozen=True, kw_only=True)
class PreemptConfig:
    signal: str = "USR2"                 # plus SIGTERM, always
    requeue: bool = True                 # under Slurm rank 0 requeues its own job
    exclude_failed_nodes: bool = True    # requeues keep the job off nodes that failed earlier runs
    exit_code: int = EX_TEMPFAIL         # outside Slurm (75, EX_TEMPFAIL: "try again")
    timelimit_window_s: float = 180.0    # a signal this close to the job's end time = time limit
    check_every_steps: int = 0           # all-reduce the flag every N steps; 0: auto (~every 0.2 s)


@dataclass(frozen=True, kw_only=True)
class LogConfig:
    dir: str = "runs"
    every_n_steps: int = 10
    progress: Literal["auto", "bar", "lines", "off"] = "auto"


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    name: str = "ddp_hpc"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    preempt: PreemptConfig = field(default_factory=PreemptConfig)
    log: LogConfig = field(default_factory=LogConfig)
    slurm: SlurmOptions = field(default_factory=SlurmOptions)   # read by ddp_hpc.submit

    def __post_init__(self) -> None:
        _validate(self)


def _check(cond: bool, key: str, value: Any, need: str) -> None:
    if not cond:
        raise ConfigError(f"config key {key!r} = {value!r} is invalid", f"{key} must be {need}.")


def _validate(cfg: JobConfig) -> None:
    t, c, d, o, s, lg = cfg.train, cfg.checkpoint, cfg.data, cfg.optim, cfg.schedule, cfg.log
    _check(t.batch_size > 0, "train.batch_size", t.batch_size, "a positive integer (per rank)")
    _check(t.epochs > 0, "train.epochs", t.epochs, "a positive integer")
    _check(t.max_steps is None or t.max_steps > 0, "train.max_steps", t.max_steps, "null or > 0")
    _check(t.grad_accum > 0, "train.grad_accum", t.grad_accum, "a positive integer")
    _check(t.collective_timeout_s > 0, "train.collective_timeout_s", t.collective_timeout_s,
           "> 0 seconds (e.g. 600; lower fails a hung job sooner, too low kills slow but healthy steps)")
    _check(t.clip_grad_norm is None or t.clip_grad_norm > 0, "train.clip_grad_norm",
           t.clip_grad_norm, "null or > 0")
    _check(t.eval_every_epochs >= 0, "train.eval_every_epochs", t.eval_every_epochs, ">= 0")
    _check(t.eval_batch_size is None or t.eval_batch_size > 0, "train.eval_batch_size",
           t.eval_batch_size, "null or > 0")
    _check(o.lr > 0, "optim.lr", o.lr, "> 0")
    _check(o.momentum >= 0 and o.weight_decay >= 0, "optim.momentum/weight_decay",
           (o.momentum, o.weight_decay), ">= 0")
    _check(s.warmup_steps >= 0, "schedule.warmup_steps", s.warmup_steps, ">= 0")
    _check(s.step_size > 0, "schedule.step_size", s.step_size, "> 0")
    _check(0.0 <= s.min_lr_ratio <= 1.0, "schedule.min_lr_ratio", s.min_lr_ratio, "in [0, 1]")
    _check(c.every_steps >= 0 and c.every_epochs >= 0, "checkpoint.every_steps/every_epochs",
           (c.every_steps, c.every_epochs), ">= 0")
    _check(c.keep_last >= 1, "checkpoint.keep_last", c.keep_last, ">= 1")
    _check(c.memory_every_steps >= -1, "checkpoint.memory_every_steps", c.memory_every_steps,
           ">= 1 (every N steps), 0 (auto: at most 1% of the step time) or -1 (off)")
    _check(0.0 <= d.eval_split < 1.0, "data.eval_split", d.eval_split, "in [0, 1)")
    _check(d.num_workers >= 0, "data.num_workers", d.num_workers, ">= 0")
    _check(d.broadcast_bucket_mb >= 0, "data.broadcast_bucket_mb", d.broadcast_bucket_mb, ">= 0")
    _check(d.stage_to in ("auto", "slurm_tmpdir", "tmpdir", "shm") or d.stage_to.startswith("/"),
           "data.stage_to", d.stage_to, "auto | slurm_tmpdir | tmpdir | shm | an absolute path")
    _check(lg.every_n_steps > 0, "log.every_n_steps", lg.every_n_steps, "a positive integer")
    _check(cfg.preempt.timelimit_window_s >= 0, "preempt.timelimit_window_s",
           cfg.preempt.timelimit_window_s, ">= 0")
    _check(cfg.preempt.check_every_steps >= 0, "preempt.check_every_steps",
           cfg.preempt.check_every_steps, ">= 0 (0: automatic)")
    _check(0 <= cfg.preempt.exit_code <= 255, "preempt.exit_code", cfg.preempt.exit_code, "0..255")
    _check(signal_number(cfg.preempt.signal, numbers=False) is not None, "preempt.signal", cfg.preempt.signal,
           "a signal name such as USR2, USR1 or TERM")
    for key, spec in (("model.name", cfg.model.name), ("data.dataset", d.dataset),
                      ("train.loss", t.loss)):
        _check(bool(spec) and spec.count(":") <= 1, key, spec, "a built-in name or 'pkg.mod:factory'")


