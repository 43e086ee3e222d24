"""The job request as one value, ``JobSpec``: the Slurm options (the job YAML's ``slurm:``
section with the command line on top, checked by ``ddp_hpc.config.SlurmOptions``) resolved
against the loaded config, plus where the job runs, what it runs and where its logs go. Every
backend gets the same checked value, so a bad request fails before anything is submitted.

Config overrides may hold anything: they reach the job as literal arguments (the renderer
shell-quotes them); only their keys are checked here.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import secrets
import sys
import time as _time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from ddp_hpc.config import SlurmOptions, parse_signal, time_to_seconds
from ddp_hpc.config.checks import check_plain
from ddp_hpc.data.errors import StageError
from ddp_hpc.data.scriptstage import SPEC_VAR, StageItem, encode_items, parse_stage_sources
from ddp_hpc.errors import HintError

__all__ = ["SpecError", "TaskSpec", "JobSpec", "parse_sweeps", "sweep_tasks", "check_overrides",
           "is_override", "build_spec", "build_command_spec", "new_run_id", "script_sweeps", "stage_items"]


class SpecError(HintError, ValueError):
    """A request that cannot run; the message names the value, where it came from and the fix."""


_OVERRIDE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*$")
_LOG_DIR = re.compile(r"^[A-Za-z0-9_./+=@,:~-]+$")
#: seconds past the collective timeout before the supervisor calls a run stalled
STALL_MARGIN_S = 15.0


def is_override(item: str) -> bool:
    """``key=value`` with a dotted config key (``train.epochs=2``)."""
    key, eq, _ = item.partition("=")
    return bool(eq) and bool(_OVERRIDE_KEY.fullmatch(key.strip()))


def parse_sweeps(items: Sequence[str]) -> list[tuple[str, list[str]]]:
    """``["lr=1e-3,3e-4", "seed=0,1"]`` -> ``[("lr", ["1e-3", "3e-4"]), ("seed", ["0", "1"])]``."""
    out: list[tuple[str, list[str]]] = []
    for item in items:
        key, _, values = item.partition("=")
        key = key.strip()
        vals = [v.strip() for v in values.split(",")]
        if not is_override(item) or not all(vals):
            raise SpecError(f"sweep {item!r} is not of the form KEY=V1,V2,... (--sweep {item})",
                            "write e.g. --sweep optim.lr=1e-3,3e-4 (a dotted config key, values "
                            "separated by commas)")
        if key in (k for k, _ in out):
            raise SpecError(f"sweep key {key!r} given twice (--sweep {item})",
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


def stage_items(sources) -> tuple:
    """``slurm.stage`` of the YAML, then ``--stage`` (they add up), or ``stage=`` of the Python
    API, checked: a missing source or a clash is a SpecError naming the item and where it came
    from (``sources``: (where, items) pairs)."""
    try:
        return parse_stage_sources(sources)
    except StageError as exc:
        raise SpecError(exc.problem, exc.hint) from None


def check_overrides(overrides: Iterable[str]) -> tuple[str, ...]:
    out = []
    for item in overrides:
        if not is_override(item):
            raise SpecError(f"override {item!r} is not of the form key=value",
                            "give one config file, then overrides such as train.epochs=2 "
                            "optim.lr=0.01 (before or after --)")
        if "\0" in item:
            raise SpecError(f"override {item!r} contains a NUL byte", "remove it")
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
    """Everything a backend needs, validated; rendering and submitting read only this.
    ``options`` is resolved: job_name, cpus_per_task and signal (SIG@GRACE) are always set."""
    options: SlurmOptions
    config: str | None              # absolute path of the job YAML; None for a command job
    overrides: tuple[str, ...] = ()  # common to every task
    tasks: tuple[TaskSpec, ...]     # one per array task; a single task with task_id None otherwise
    log_dir: str                    # absolute; for arrays the parent of the per-task dirs
    workdir: str                    # absolute; the job runs from here
    python: str                     # the interpreter the tasks run
    command: tuple[str, ...] | None = None   # a script/module job: the argv every rank runs
    exclude_failed_nodes: bool = True         # preempt.exclude_failed_nodes (ddp_hpc.supervise.avoid)
    #: the restart number of the job's first run: 0, or for a job that resumes a stopped run one
    #: past the highest in that run's logs (DDP_HPC_RESTART_BASE, read by ddp_hpc.env.job)
    restart_base: int = 0
    #: ``--stage SRC[=NAME]`` of a script job: what every node copies before the ranks start
    stage: tuple[StageItem, ...] = ()
    #: the supervisor restarts a step with no training step for this long (0: off); for a config
    #: job train.collective_timeout_s plus `STALL_MARGIN_S`, so the ranks' own timeouts come first
    stall_timeout_s: float = 0.0

    def __post_init__(self) -> None:
        if type(self.restart_base) is not int or self.restart_base < 0:
            raise SpecError(f"restart_base {self.restart_base!r} is not a whole number >= 0",
                            "pass the restart number of the job's first run (0 for a new run)")

    name = property(lambda self: self.options.job_name)
    nodes = property(lambda self: self.options.node_range[1])   # a range MIN-MAX: MAX
    gpus_per_node = property(lambda self: self.options.gpus_per_node)
    tasks_per_node = property(lambda self: self.options.gpus_per_node)   # one task per GPU
    cpus_per_task = property(lambda self: self.options.cpus_per_task)
    time = property(lambda self: self.options.time)
    partition = property(lambda self: self.options.partition)

    @property
    def alloc_nodes(self) -> str:
        """sbatch's --nodes: the job's nodes and its spares, or a range MIN-MAX as given (a range
        takes no spares: SlurmOptions refuses them)."""
        low, high = self.options.node_range
        return f"{low}-{high}" if low != high else str(high + self.options.spare_nodes)

    @property
    def supervised(self) -> bool:
        """The batch step supervises the ranks and restarts them after a fault (--max-restarts)."""
        return self.options.max_restarts > 0

    @property
    def signal(self) -> str:
        return parse_signal(self.options.signal)[0]

    @property
    def grace_s(self) -> int:
        return parse_signal(self.options.signal)[1]

    @property
    def is_array(self) -> bool:
        return self.tasks[0].task_id is not None

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def is_command(self) -> bool:
        """A job that runs the user's own script or module (under ``ddp_hpc.exec``)."""
        return self.command is not None

    def stage_environ(self) -> dict[str, str]:
        """What the ranks' wrapper reads to stage ``--stage``'s sources (empty without any)."""
        return {SPEC_VAR: encode_items(self.stage)} if self.stage else {}

    def stage_sbcast(self) -> tuple[StageItem, ...]:
        """The ``--stage`` sources the batch script sends to every node with Slurm's sbcast
        before srun, for a job on several nodes: files, LMDBs and folders (as one archive)."""
        return tuple(self.stage) if self.nodes > 1 else ()

    def base_argv(self) -> list[str]:
        """What every task runs before its own sweep values: ``python -m ddp_hpc.run CONFIG
        overrides...``, or ``python -m ddp_hpc.exec -- COMMAND...`` for a script or module."""
        if self.command is not None:
            return [self.python, "-m", "ddp_hpc.exec", "--", *self.command]
        return [self.python, "-m", "ddp_hpc.run", str(self.config), *self.overrides]

    def task_argv(self, task: TaskSpec) -> list[str]:
        """One task's argument list: ``base_argv()`` and the task's sweep values."""
        return [*self.base_argv(), *task.overrides]


def new_run_id(name: str) -> str:
    """``<name>-<YYYYmmdd-HHMMSS>-<hex>``: unique without a Slurm job id, so the log directory
    exists before submission (sbatch cannot create the directory of --output itself)."""
    return f"{name}-{_time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def _resolved(opts: SlurmOptions, cfg: Any) -> tuple[SlurmOptions, str | None]:
    """Defaults taken from the config; also the override that makes training listen for the
    signal Slurm will send, when that differs from the config's preempt.signal."""
    cfg_signal = str(cfg.preempt.signal).upper().removeprefix("SIG")
    sig, grace = parse_signal(opts.signal or f"{cfg_signal}@90",
                              "--signal" if opts.signal else "preempt.signal")
    limit = time_to_seconds(opts.time)
    if grace >= limit:
        raise SpecError(f"signal grace {grace} s is not shorter than the time limit {opts.time} "
                        f"({limit} s) (--signal / --time)",
                        "ask for more time or a shorter grace, e.g. --signal USR2@60")
    resolved = dataclasses.replace(
        opts, job_name=opts.job_name or _sanitize_name(cfg.name), signal=f"{sig}@{grace}",
        cpus_per_task=opts.cpus_per_task or int(cfg.data.num_workers) + 1)
    return resolved, (f"preempt.signal={sig}" if sig != cfg_signal else None)


def build_spec(opts: SlurmOptions, *, config_path: str | os.PathLike, cfg: Any,
               overrides: Sequence[str], sweeps: Sequence[tuple[str, Sequence[str]]] = (),
               workdir: str | None = None, python: str | None = None,
               run_id: str | None = None) -> JobSpec:
    """Resolve defaults from the loaded config ``cfg`` (a JobConfig) and the options."""
    workdir = os.path.abspath(workdir or os.getcwd())
    options, signal_override = _resolved(opts, cfg)
    overrides = [*check_overrides(overrides), *([signal_override] if signal_override else [])]
    base = Path(workdir, cfg.log.dir) if not os.path.isabs(cfg.log.dir) else Path(cfg.log.dir)
    log_dir = (base / (run_id or new_run_id(options.job_name))).resolve()
    # the log directory appears in #SBATCH --output lines, which sbatch splits at blanks
    check_plain("log directory (log.dir of the config)", log_dir, _LOG_DIR,
                "set log.dir (e.g. -- log.dir=/scratch/$USER/runs) to a path without blanks, "
                "quotes or shell characters")
    task_overrides = sweep_tasks(sweeps)
    if task_overrides:
        tasks = tuple(TaskSpec(i, ov, str(log_dir / f"task{i}")) for i, ov in enumerate(task_overrides))
    else:
        tasks = (TaskSpec(None, (), str(log_dir)),)
    return JobSpec(options=options, config=str(Path(config_path).resolve()),
                   overrides=tuple(overrides), tasks=tasks, log_dir=str(log_dir),
                   workdir=workdir, python=python or sys.executable,
                   exclude_failed_nodes=bool(cfg.preempt.exclude_failed_nodes),
                   stall_timeout_s=float(cfg.train.collective_timeout_s) + STALL_MARGIN_S)


_SCRIPT_KEY = re.compile(r"^-{0,2}[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def script_sweeps(items: Sequence[str]) -> list[tuple[str, list[str]]]:
    """``--sweep lr=1e-3,3e-4`` for a script: each task gets ``--lr=1e-3`` (a key that starts
    with ``-`` is kept as written: ``--sweep=-s=1,2`` gives ``-s=1``)."""
    out: list[tuple[str, list[str]]] = []
    for item in items:
        key, eq, values = item.partition("=")
        vals = [v.strip() for v in values.split(",")]
        if not eq or not _SCRIPT_KEY.fullmatch(key.strip()) or not all(vals):
            raise SpecError(f"sweep {item!r} is not of the form NAME=V1,V2,... (--sweep {item})",
                            "write e.g. --sweep lr=1e-3,3e-4: each task gets --lr=1e-3 etc. as "
                            "extra arguments of the script")
        key = key.strip()
        flag = key if key.startswith("-") else f"--{key}"
        if flag in (k for k, _ in out):
            raise SpecError(f"sweep key {key!r} given twice (--sweep {item})",
                            "give all values of one key in one --sweep")
        out.append((flag, vals))
    return out


def build_command_spec(opts: SlurmOptions, *, command: Sequence[str], name: str,
                       log_root: str = "runs", sweeps: Sequence[tuple[str, Sequence[str]]] = (),
                       workdir: str | None = None, python: str | None = None,
                       run_id: str | None = None) -> JobSpec:
    """The spec of a job that runs ``command`` (the user's script or module) on every rank under
    ``ddp_hpc.exec``; logs go to ``<log_root>/<name>-<stamp>``. Defaults: one CPU per task (give
    ``--cpus-per-task`` for data loader workers) and the USR2@90 preemption signal."""
    workdir = os.path.abspath(workdir or os.getcwd())
    sig, grace = parse_signal(opts.signal or "USR2@90", "--signal")
    limit = time_to_seconds(opts.time)
    if grace >= limit:
        raise SpecError(f"signal grace {grace} s is not shorter than the time limit {opts.time} "
                        f"({limit} s) (--signal / --time)",
                        "ask for more time or a shorter grace, e.g. --signal USR2@60")
    options = dataclasses.replace(opts, job_name=opts.job_name or _sanitize_name(name),
                                  signal=f"{sig}@{grace}", cpus_per_task=opts.cpus_per_task or 1)
    base = Path(workdir, log_root) if not os.path.isabs(log_root) else Path(log_root)
    log_dir = (base / (run_id or new_run_id(options.job_name))).resolve()
    check_plain("log directory (--log-dir)", log_dir, _LOG_DIR,
                "pass --log-dir with a path without blanks, quotes or shell characters")
    tasks = tuple(TaskSpec(i, extra, str(log_dir / f"task{i}"))
                  for i, extra in enumerate(sweep_tasks(sweeps))) or (TaskSpec(None, (), str(log_dir)),)
    return JobSpec(options=options, config=None, tasks=tasks, log_dir=str(log_dir),
                   workdir=workdir, python=python or sys.executable, command=tuple(command))


def _sanitize_name(name: str) -> str:
    """The config's free-text `name` made safe for a job name and a directory name."""
    out = re.sub(r"[^A-Za-z0-9_.+-]+", "_", str(name)).strip("_.") or "ddp_hpc"
    return out[:128]
