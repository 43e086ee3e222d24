"""The job request as one value: Slurm options from the job YAML's ``slurm:`` section and the
command line (the command line wins), validated here, so every backend gets the same checked
``JobSpec`` and a bad request fails before anything is submitted.

Why one dataclass for the options: as in submitit, the valid option names are the fields of one
signature (``SlurmOptions``), so an unknown key in ``slurm:`` is refused with the full list of
valid ones instead of silently ignored. Every string that will reach an ``#SBATCH`` line is
validated against a conservative pattern (sbatch parses those lines itself, with its own quoting
rules); config overrides may hold anything and are shell-quoted by the renderer instead.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import secrets
import signal as _signal
import sys
import time as _time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["SpecError", "SlurmOptions", "TaskSpec", "JobSpec", "merge_options", "parse_sweeps",
           "sweep_tasks", "time_to_seconds", "parse_signal", "build_spec", "MANAGED_SBATCH_KEYS"]


class SpecError(ValueError):
    """A request that cannot run; the message names the value, where it came from and the fix."""


@dataclass(frozen=True, kw_only=True)
class SlurmOptions:
    """Every valid key of a job YAML's ``slurm:`` section (and the matching CLI options)."""
    nodes: int = 1
    gpus_per_node: int = 1           # CLI --gpus; also the tasks per node (one task per GPU)
    cpus_per_task: int | None = None  # default: data.num_workers + 1
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "01:00:00"
    mem: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    job_name: str | None = None      # default: the config's `name`
    dependency: str | None = None
    signal: str | None = None        # SIG@GRACE, default <preempt.signal>@90
    sbatch_args: dict = field(default_factory=dict)   # any other sbatch option: {key: value}
    backend: str = "auto"


VALID_KEYS = tuple(f.name for f in dataclasses.fields(SlurmOptions))
BACKENDS = ("auto", "submitit", "sbatch", "local")

# Options ddp_hpc sets itself: a --sbatch-arg for them would silently break the one-task-per-GPU
# layout, the log layout or preemption, so each is refused with the option to use instead.
MANAGED_SBATCH_KEYS = {
    "nodes": "--nodes", "N": "--nodes", "ntasks": "--nodes and --gpus", "n": "--nodes and --gpus",
    "ntasks-per-node": "--gpus (one task per GPU)", "gpus-per-node": "--gpus",
    "gpus": "--gpus", "G": "--gpus", "gres": "--gpus", "cpus-per-task": "--cpus-per-task",
    "c": "--cpus-per-task", "output": "the log directory (log.dir)", "o": "log.dir",
    "error": "log.dir", "e": "log.dir", "open-mode": "nothing (always append)",
    "array": "--sweep", "a": "--sweep", "job-name": "--job-name", "J": "--job-name",
    "signal": "--signal", "requeue": "nothing (always set)", "no-requeue": "nothing",
    "wrap": "a config file", "chdir": "running from that directory", "D": "cd",
    "partition": "--partition", "p": "--partition", "time": "--time", "t": "--time",
    "account": "--account", "A": "--account", "qos": "--qos", "q": "--qos", "mem": "--mem",
    "constraint": "--constraint", "C": "--constraint", "exclusive": "--exclusive",
    "dependency": "--dependency", "d": "--dependency",
}

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}$")
_PLAIN = re.compile(r"^[A-Za-z0-9_.:@%+=,/&|*!()\[\]-]+$")   # no blanks, quotes, $, #, ;, \
_SBATCH_KEY = re.compile(r"^[a-z][a-z0-9-]+$")
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
_MEM = re.compile(r"^\d+[KMGT]?$", re.I)
_DEPENDENCY = re.compile(r"^(?:singleton|[a-z]+(?::[0-9_+?*]+)+)(?:[,?](?:singleton|[a-z]+(?::[0-9_+?*]+)+))*$")
_OVERRIDE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _fail(what: str, source: str, hint: str) -> SpecError:
    return SpecError(f"{what} ({source}).\nHINT: {hint}")


def time_to_seconds(text: str, source: str = "--time") -> int:
    """Slurm time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    m = _TIME.match(str(text))
    if not m:
        raise _fail(f"time limit {text!r} is not a Slurm time", source,
                    "write minutes (30), HH:MM:SS (02:00:00) or D-HH:MM:SS (1-00:00:00)")
    d, a, b, c = m.groups()
    if d is not None:  # D-H, D-H:M, D-H:M:S
        h, mi, s = int(a), int(b or 0), int(c or 0)
        total = int(d) * 86400 + h * 3600 + mi * 60 + s
    elif c is not None:
        total = int(a) * 3600 + int(b) * 60 + int(c)
    elif b is not None:
        total = int(a) * 60 + int(b)
    else:
        total = int(a) * 60
    if total <= 0:
        raise _fail(f"time limit {text!r} is zero", source, "give the job some time, e.g. 00:30:00")
    return total


def parse_signal(text: str, source: str = "--signal") -> tuple[str, int]:
    """``USR2@90`` / ``SIGUSR1@120`` / ``USR2`` -> (``USR2``, grace seconds; 90 by default)."""
    name, _, grace = str(text).partition("@")
    name = name.upper().removeprefix("SIG")
    if not name or not hasattr(_signal, "SIG" + name) or not name.isalnum():
        raise _fail(f"signal {text!r} is not a signal name", source,
                    "write e.g. USR2@90 (signal USR2, 90 s before the time limit)")
    try:
        seconds = int(grace) if grace else 90
    except ValueError:
        seconds = -1
    if not 0 < seconds <= 65535:
        raise _fail(f"signal grace {grace!r} in {text!r} is not a number of seconds in 1..65535",
                    source, "write e.g. USR2@90")
    return name, seconds


def _check_plain(key: str, value: Any, source: str, pattern: re.Pattern = _PLAIN,
                 hint: str = "") -> str:
    text = str(value)
    if not pattern.match(text):
        raise _fail(f"{key} {text!r} contains characters that are not allowed here", source,
                    hint or "use letters, digits and _ . : @ % + = , / & | * ! ( ) [ ] - only "
                            "(no blanks, quotes, $, #, ; or backslashes)")
    return text


def _coerce(name: str, value: Any, source: str) -> Any:
    """Type-check one option value (YAML gives typed values, the CLI gives them typed too)."""
    ints = {"nodes": 1, "gpus_per_node": 1, "cpus_per_task": 1}
    if name in ints:
        if value is None and name == "cpus_per_task":
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(f"{name} must be an integer, got {value!r}", source,
                        f"write e.g. {name}: 2")
        if value < ints[name]:
            flag = {"nodes": "--nodes", "gpus_per_node": "--gpus"}.get(name, "--cpus-per-task")
            raise _fail(f"{name} = {value} but at least {ints[name]} is needed", source,
                        f"ask for {flag} 1 or more")
        return value
    if name == "exclusive":
        if not isinstance(value, bool):
            raise _fail(f"exclusive must be true or false, got {value!r}", source, "exclusive: true")
        return value
    if name == "sbatch_args":
        if not isinstance(value, Mapping):
            raise _fail(f"sbatch_args must be a mapping, got {value!r}", source,
                        "write sbatch_args: {mail-type: END}")
        return {str(k): v for k, v in value.items()}
    if value is None:
        return None
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise _fail(f"{name} must be a string, got {value!r}", source, f"write e.g. {name}: value")
    value = str(value)
    if name == "time":
        time_to_seconds(value, source)
    elif name == "signal":
        parse_signal(value, source)
    elif name == "mem":
        _check_plain(name, value, source, _MEM, "write e.g. 16G, 500M or 0 (all of the node)")
    elif name == "job_name":
        _check_plain("job name", value, source, _NAME,
                     "use 1-128 letters, digits, '_', '.', '+' or '-', starting with a letter or "
                     "digit (the name also names the log directory)")
    elif name == "dependency":
        _check_plain(name, value, source, _DEPENDENCY,
                     "write e.g. afterok:12345 or afterany:12345:12346")
    elif name == "backend":
        if value not in BACKENDS:
            raise _fail(f"backend {value!r} is unknown", source, f"use one of {', '.join(BACKENDS)}")
    elif name in ("partition", "account", "qos"):
        _check_plain(name, value, source, _NAME, f"use the {name} name as Slurm lists it")
    else:
        _check_plain(name, value, source)
    return value


def merge_options(yaml_section: Mapping[str, Any] | None, cli: Mapping[str, Any],
                  yaml_source: str = "the job YAML") -> SlurmOptions:
    """YAML ``slurm:`` section, then the CLI values that were given (not None) on top."""
    section = dict(yaml_section or {})
    unknown = sorted(k for k in section if k not in VALID_KEYS)
    if unknown:
        raise _fail(f"unknown key slurm.{unknown[0]} in {yaml_source}", "slurm: section",
                    f"valid keys in slurm: are {', '.join(VALID_KEYS)}; any other sbatch option "
                    f"goes under slurm.sbatch_args or --sbatch-arg KEY=VALUE")
    values: dict[str, Any] = {}
    for k, v in section.items():
        values[k] = _coerce(k, v, f"slurm.{k} in {yaml_source}")
    sbatch_args = dict(values.get("sbatch_args", {}))
    for k, v in cli.items():
        if v is None:
            continue
        if k == "sbatch_args":
            sbatch_args.update(_coerce(k, v, "--sbatch-arg"))
            continue
        values[k] = _coerce(k, v, "--" + k.replace("_", "-").replace("gpus-per-node", "gpus"))
    for k, v in sbatch_args.items():
        _check_sbatch_arg(k, v)
    values["sbatch_args"] = sbatch_args
    return SlurmOptions(**values)


def _check_sbatch_arg(key: str, value: Any) -> None:
    src = f"--sbatch-arg {key}={value}"
    if not _SBATCH_KEY.match(key):
        raise _fail(f"sbatch option name {key!r} is not valid", src,
                    "write the long option name without dashes, e.g. --sbatch-arg mail-type=END")
    if key in MANAGED_SBATCH_KEYS:
        raise _fail(f"sbatch option {key!r} is set by ddp_hpc itself", src,
                    f"use {MANAGED_SBATCH_KEYS[key]} instead")
    if value is True or value is None or value == "":
        return   # a flag such as --sbatch-arg hold= / `hold: true`
    _check_plain(f"value of sbatch option {key}", value, src)


def parse_sbatch_args(items: Sequence[str]) -> dict[str, str | bool]:
    out: dict[str, str | bool] = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip().lstrip("-")
        out[key] = value if eq and value != "" else True
    return out


def parse_sweeps(items: Sequence[str]) -> list[tuple[str, list[str]]]:
    """``["lr=1e-3,3e-4", "seed=0,1"]`` -> ``[("lr", ["1e-3", "3e-4"]), ("seed", ["0", "1"])]``."""
    out = []
    for item in items:
        key, eq, values = item.partition("=")
        key = key.strip()
        vals = [v.strip() for v in values.split(",")]
        if not eq or not _OVERRIDE_KEY.match(key) or not all(vals):
            raise _fail(f"sweep {item!r} is not of the form KEY=V1,V2,...", f"--sweep {item}",
                        "write e.g. --sweep optim.lr=1e-3,3e-4 (a dotted config key, values "
                        "separated by commas)")
        if key in (k for k, _ in out):
            raise _fail(f"sweep key {key!r} given twice", f"--sweep {item}",
                        "give all values of one key in one --sweep")
        out.append((key, vals))
    return out


def sweep_tasks(sweeps: Sequence[tuple[str, Sequence[str]]]) -> list[tuple[str, ...]]:
    """Cartesian product, first --sweep outermost: each task's extra overrides."""
    if not sweeps:
        return []
    keys = [k for k, _ in sweeps]
    return [tuple(f"{k}={v}" for k, v in zip(keys, combo))
            for combo in itertools.product(*(vals for _, vals in sweeps))]


def check_overrides(overrides: Iterable[str], source: str = "overrides after --") -> tuple[str, ...]:
    out = []
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq or not _OVERRIDE_KEY.match(key.strip()):
            raise _fail(f"override {item!r} is not of the form key=value", source,
                        "write e.g. -- train.epochs=2 optim.lr=0.01")
        if "\0" in value:
            raise _fail(f"override {item!r} contains a NUL byte", source, "remove it")
        out.append(item)
    return tuple(out)


@dataclass(frozen=True)
class TaskSpec:
    """One training run: an array task (``task_id``) or the whole job (``task_id`` None)."""
    task_id: int | None
    overrides: tuple[str, ...]      # the task's extra overrides (the sweep values)
    log_dir: str                    # absolute


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """Everything a backend needs, validated; rendering and submitting read only this."""
    name: str
    nodes: int
    gpus_per_node: int
    cpus_per_task: int
    time: str
    signal: str
    grace_s: int
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    mem: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    dependency: str | None = None
    sbatch_args: tuple[tuple[str, str | bool], ...] = ()
    config: str                     # absolute path of the job YAML
    overrides: tuple[str, ...] = ()  # common to every task
    tasks: tuple[TaskSpec, ...]     # one per array task; a single task with task_id None otherwise
    log_dir: str                    # absolute; for arrays the parent of the per-task dirs
    workdir: str                    # absolute; the job runs from here
    python: str                     # the interpreter the tasks run

    @property
    def is_array(self) -> bool:
        return self.tasks[0].task_id is not None

    @property
    def tasks_per_node(self) -> int:
        return self.gpus_per_node

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def task_argv(self, task: TaskSpec) -> list[str]:
        """``python -m ddp_hpc.run CONFIG overrides...`` for one task (an argument list)."""
        return [self.python, "-m", "ddp_hpc.run", self.config, *self.overrides, *task.overrides]


def new_run_id(name: str) -> str:
    """``<name>-<YYYYmmdd-HHMMSS>-<hex>``: unique without a Slurm job id, so the log directory
    exists before submission (sbatch cannot create the directory of --output itself)."""
    return f"{name}-{_time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def build_spec(opts: SlurmOptions, *, config_path: str | os.PathLike, cfg: Any,
               overrides: Sequence[str], sweeps: Sequence[tuple[str, Sequence[str]]] = (),
               workdir: str | None = None, python: str | None = None,
               run_id: str | None = None) -> JobSpec:
    """Resolve defaults from the loaded config ``cfg`` (a JobConfig) and the options."""
    workdir = os.path.abspath(workdir or os.getcwd())
    name = opts.job_name or _sanitize_name(getattr(cfg, "name", "ddp_hpc"))
    cfg_signal = str(cfg.preempt.signal).upper().removeprefix("SIG")
    sig, grace = parse_signal(opts.signal or f"{cfg_signal}@90",
                              "--signal" if opts.signal else "preempt.signal")
    overrides = list(check_overrides(overrides))
    if sig != cfg_signal:   # the training core must listen for the signal Slurm will send
        overrides.append(f"preempt.signal={sig}")
    limit = time_to_seconds(opts.time)
    if grace >= limit:
        raise _fail(f"signal grace {grace} s is not shorter than the time limit {opts.time} "
                    f"({limit} s)", "--signal / --time",
                    "ask for more time or a shorter grace, e.g. --signal USR2@60")
    cpus = opts.cpus_per_task or int(getattr(cfg.data, "num_workers", 0)) + 1
    base = Path(workdir, cfg.log.dir) if not os.path.isabs(cfg.log.dir) else Path(cfg.log.dir)
    log_dir = (base / (run_id or new_run_id(name))).resolve()
    # the log directory appears in #SBATCH --output lines, which sbatch splits at blanks
    _check_plain("log directory", log_dir, "log.dir of the config", re.compile(r"^[A-Za-z0-9_./+=@,:~-]+$"),
                 "set log.dir (e.g. -- log.dir=/scratch/$USER/runs) to a path without blanks, "
                 "quotes or shell characters")
    task_overrides = sweep_tasks(sweeps)
    if task_overrides:
        tasks = tuple(TaskSpec(i, ov, str(log_dir / f"task{i}")) for i, ov in enumerate(task_overrides))
    else:
        tasks = (TaskSpec(None, (), str(log_dir)),)
    return JobSpec(
        name=name, nodes=opts.nodes, gpus_per_node=opts.gpus_per_node, cpus_per_task=cpus,
        time=opts.time, signal=sig, grace_s=grace, partition=opts.partition,
        account=opts.account, qos=opts.qos, mem=opts.mem, constraint=opts.constraint,
        exclusive=opts.exclusive, dependency=opts.dependency,
        sbatch_args=tuple(sorted(opts.sbatch_args.items())),
        config=str(Path(config_path).resolve()), overrides=tuple(overrides), tasks=tasks,
        log_dir=str(log_dir), workdir=workdir, python=python or sys.executable)


def _sanitize_name(name: str) -> str:
    """The config's free-text `name` made safe for a job name and a directory name."""
    out = re.sub(r"[^A-Za-z0-9_.+-]+", "_", str(name)).strip("_.") or "ddp_hpc"
    return out[:128]
