"""Job configuration: YAML -> frozen, validated dataclasses, plus dotted ``key=value`` overrides.

Why this shape: a job definition is read on the login node (submit) and again on every task
(``python -m ddp_hpc.run``); both must agree and both must refuse a typo before any compute is
spent.  Every section is a frozen kw-only dataclass whose fields are the only valid keys, so an
unknown key is refused with the list of valid ones, a wrong type names the key, the value, where
it came from and the fix, and nothing downstream has to re-check.

    cfg = load_config("jobs/demo.yaml", ["train.batch_size=64", "optim.lr=0.1"])
"""
from __future__ import annotations

import dataclasses
import importlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml

__all__ = [
    "ConfigError", "JobConfig", "ModelConfig", "DataConfig", "OptimConfig", "ScheduleConfig",
    "TrainConfig", "CheckpointConfig", "PreemptConfig", "LogConfig",
    "load_config", "config_from_dict", "config_to_dict", "apply_overrides", "resolve_factory",
]


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key, the value, its source and the fix."""


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
    filter_zero_grads: bool = False      # drop all-zero grads before step (seed guide, NAS-style nets)
    sync_buffers_at_end: bool = True     # broadcast rank 0's buffers after the last step
    device: Literal["auto", "cpu", "cuda"] = "auto"
    collective_timeout_s: float = 1800.0  # a rank stuck this long in a collective fails the job


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    dir: str | None = None               # default: <run log dir>/checkpoints
    every_steps: int = 0                 # 0: only at epoch ends (and on preemption)
    every_epochs: int = 1
    keep_last: int = 3
    resume: bool = True                  # resume from the newest valid checkpoint in dir


@dataclass(frozen=True, kw_only=True)
class PreemptConfig:
    signal: str = "USR2"                 # plus SIGTERM, always
    requeue: bool = True                 # under Slurm rank 0 requeues its own job
    exit_code: int = 75                  # outside Slurm (EX_TEMPFAIL: "try again")
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
    slurm: dict = field(default_factory=dict)   # validated by ddp_hpc.submit; carried as is

    def __post_init__(self) -> None:
        _validate(self)


# ----------------------------------------------------------------------------- building

def _type_ok(value: Any, tp: Any) -> tuple[bool, Any]:
    """Check (and gently coerce: int -> float, list -> tuple) a value against an annotation."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            ok, v = _type_ok(value, arg)
            if ok:
                return True, v
        return False, value
    if tp is type(None):
        return value is None, value
    if origin is Literal:
        return value in typing.get_args(tp), value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str):   # PyYAML reads 1e-3 (no dot) as a string: accept it
            try:
                return True, float(value)
            except ValueError:
                pass
        return False, value
    if tp is str:
        return isinstance(value, str), value
    if tp is dict:
        return isinstance(value, dict), (dict(value) if isinstance(value, dict) else value)
    if origin is tuple:
        args = typing.get_args(tp)
        if isinstance(value, (list, tuple)) and len(value) == len(args):
            out = []
            for v, a in zip(value, args):
                ok, cv = _type_ok(v, a)
                if not ok:
                    return False, value
                out.append(cv)
            return True, tuple(out)
        return False, value
    return True, value


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return str(tp).replace("typing.", "") if not isinstance(tp, type) else tp.__name__


def _build(cls: type, raw: Any, where: str, source: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where or 'the config'} must be a mapping of keys, got {raw!r} "
                          f"({source}).\nHINT: write it as `key: value` lines in the YAML file.")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in raw if k not in fields]
    if unknown:
        key = f"{where}.{unknown[0]}" if where else str(unknown[0])
        raise ConfigError(
            f"unknown config key {key!r} ({source}).\n"
            f"HINT: valid keys{' in ' + where if where else ''} are: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, value in raw.items():
        tp = hints[name]
        key = f"{where}.{name}" if where else name
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, key, source)
            continue
        ok, coerced = _type_ok(value, tp)
        if not ok:
            raise ConfigError(
                f"config key {key!r} has the wrong type: {value!r} ({type(value).__name__}) "
                f"from {source}.\nHINT: {key} must be {_type_name(tp)}.")
        kwargs[name] = coerced
    try:
        return cls(**kwargs)
    except ConfigError as e:   # cross-field validation: add where the values came from
        first, _, rest = str(e).partition("\n")
        raise ConfigError(f"{first} ({source})\n{rest}".rstrip()) from None


def _check(cond: bool, key: str, value: Any, need: str) -> None:
    if not cond:
        raise ConfigError(f"config key {key!r} = {value!r} is invalid.\nHINT: {key} must be {need}.")


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
    sig = cfg.preempt.signal.upper().removeprefix("SIG")
    import signal as _signal
    _check(hasattr(_signal, "SIG" + sig), "preempt.signal", cfg.preempt.signal,
           "a signal name such as USR2, USR1 or TERM")
    for key, spec in (("model.name", cfg.model.name), ("data.dataset", d.dataset),
                      ("train.loss", t.loss)):
        _check(bool(spec) and spec.count(":") <= 1, key, spec, "a built-in name or 'pkg.mod:factory'")


def config_from_dict(raw: Mapping, source: str = "a dict") -> JobConfig:
    """Build a JobConfig from plain data; `source` is named in error messages."""
    return _build(JobConfig, raw, "", source)


def config_to_dict(cfg: Any) -> dict:
    """Plain dict/list/str/number form (YAML- and torch.load(weights_only)-safe)."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            v = config_to_dict(v)
        elif isinstance(v, tuple):
            v = list(v)
        elif isinstance(v, dict):
            v = dict(v)
        out[f.name] = v
    return out


def _parse_value(text: str) -> Any:
    """YAML scalar/list/dict syntax, except YAML 1.1's yes/no/on/off, which stay words here."""
    if text.strip().lower() in {"yes", "no", "on", "off", "y", "n"}:
        return text.strip()
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict, overrides: typing.Iterable[str]) -> dict:
    """Apply ``a.b.c=value`` strings (value parsed as YAML) to a nested dict, returning a copy."""
    import copy
    out = copy.deepcopy(raw) if raw else {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value.\n"
                              f"HINT: write e.g. train.batch_size=64 or optim.lr=0.01")
        key, _, text = item.partition("=")
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {item!r} has an empty key part.\nHINT: use dotted keys "
                              f"such as train.epochs=3")
        node = out
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section (it is {nxt!r}).")
            node = nxt
        node[parts[-1]] = _parse_value(text)
    return out


def load_config(path: str | Path | None, overrides: typing.Iterable[str] = ()) -> JobConfig:
    """Read a YAML job file (safe_load), apply dotted overrides, validate. `path=None`: defaults."""
    raw: Any = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist.\nHINT: pass a YAML job "
                              f"file such as jobs/demo.yaml")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
        source = str(p)
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {source!r} must hold a mapping at the top, got {raw!r}")
    overrides = list(overrides)
    if overrides:
        raw = apply_overrides(raw, overrides)
        source = f"{source} + overrides {overrides}"
    return config_from_dict(raw, source)


def resolve_factory(spec: str, builtins: Mapping[str, Any], key: str) -> Any:
    """Turn a built-in name or ``pkg.mod:attr`` into the callable, with an error naming the fix."""
    if spec in builtins:
        return builtins[spec]
    if ":" not in spec:
        raise ConfigError(f"{key} = {spec!r} is neither a built-in nor an import path.\n"
                          f"HINT: use one of {', '.join(sorted(builtins))} or 'pkg.module:factory'")
    mod_name, _, attr = spec.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(f"{key} = {spec!r}: cannot import module {mod_name!r} ({e}).\n"
                          f"HINT: check the spelling and that the package is installed or on "
                          f"PYTHONPATH") from None
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key} = {spec!r}: module {mod_name!r} has no attribute {attr!r}.\n"
                              f"HINT: name a class or function defined in {mod_name}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{key} = {spec!r} is not callable.\nHINT: name a class or function")
    return obj
