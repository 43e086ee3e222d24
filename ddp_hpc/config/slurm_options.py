"""The Slurm options of a job, in one place: ``SlurmOptions``.

Its fields are every valid key of a job YAML's ``slurm:`` section; each field's metadata holds
its check (``parse``), its help text, its command-line flags (with sbatch's short forms) and,
where it has one, the sbatch option it becomes. From that one signature -- as submitit derives
its options from one signature -- come the YAML validation (``ddp_hpc.config``), the argparse
flags of ``submit`` (``add_arguments`` / ``given``) and the options the sbatch renderer and the
submitit backend pass on (``PASSTHROUGH``). Every string that will reach an ``#SBATCH`` line is
checked against a conservative pattern (sbatch parses those lines itself, with its own quoting).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Sequence

from ddp_hpc.config.checks import (
    PLAIN,
    check_backend,
    check_count,
    check_flag,
    check_nodes,
    check_plain,
    check_seconds,
    check_signal,
    check_stage,
    check_text,
    check_time,
    node_range,
)
from ddp_hpc.config.typed import ConfigError

__all__ = ["SlurmOptions", "PASSTHROUGH", "MANAGED_SBATCH_KEYS", "MANAGED_SRUN_KEYS", "add_arguments",
           "given", "merged", "sbatch_items"]

LAYOUT = "layout (one task per GPU)"
SLURM = "Slurm options (also from the YAML's slurm: section)"
RESTARTS = "restarts inside the allocation (sbatch backend; docs/restarts.md)"
TOP = ""
#: in-allocation restarts of a job unless asked otherwise (--max-restarts)
DEFAULT_MAX_RESTARTS = 2
#: the floor of the supervisor's hang limit unless asked otherwise (--hang-timeout; supervise/hang.py)
DEFAULT_HANG_TIMEOUT = 30.0

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}")
_MEM = re.compile(r"\d+[KMGT]?", re.I)
_DEPENDENCY = re.compile(r"(?:singleton|[a-z]+(?::[0-9_+?*]+)+)(?:[,?](?:singleton|[a-z]+(?::[0-9_+?*]+)+))*")


def _opt(default: Any, parse: Callable[[Any, str], Any], help: str, *, flags: Sequence[str],
         group: str = SLURM, sbatch: str | None = None, passthrough: bool = False,
         **cli: Any) -> Any:
    """One option: ``flags`` on the command line (first = the name shown in messages),
    ``sbatch`` the sbatch option it corresponds to, ``passthrough`` when it goes to sbatch as is."""
    meta = {"parse": parse, "help": help, "flags": tuple(flags), "group": group,
            "sbatch": sbatch, "passthrough": passthrough, "cli": cli}
    if isinstance(default, dict):
        return dataclasses.field(default_factory=dict, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


_SBATCH_KEY = re.compile(r"[a-z][a-z0-9-]+")


@dataclass(frozen=True)
class _OptionMap:
    """What one command's map of extra options may hold: the names ddp_hpc sets itself (-> what to
    use instead), an example, and what a value may contain (an empty hint: check_plain's own)."""

    tool: str
    managed: Mapping[str, str]
    example: str
    value: re.Pattern = PLAIN
    value_hint: str = ""


def _check_option_map(value: Any, label: str, kind: _OptionMap) -> dict:
    """A mapping of extra options for ``kind.tool``: long names without dashes that ddp_hpc does
    not set itself, each value fit for its line (True or empty: a flag)."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{label} must be a mapping, got {value!r}",
                          f"write {kind.tool}_args: {{{kind.example.replace('=', ': ')}}}")
    out = {str(k): v for k, v in value.items()}
    for key, v in out.items():
        src = f"{label} {key}={v}"
        if not _SBATCH_KEY.fullmatch(key):
            raise ConfigError(f"{kind.tool} option name {key!r} is not valid ({src})",
                              f"write the long option name without dashes, e.g. --{kind.tool}-arg {kind.example}")
        if key in kind.managed:
            raise ConfigError(f"{kind.tool} option {key!r} is set by ddp_hpc itself ({src})",
                              f"use {kind.managed[key]} instead")
        if not (v is True or v is None or v == ""):
            check_plain(f"value of {kind.tool} option {key} ({src})", v, kind.value, kind.value_hint)
    return out


def check_sbatch_args(value: Any, label: str) -> dict:
    """A mapping of other sbatch options: valid names that ddp_hpc does not set itself, values
    fit for an #SBATCH line (True or empty: a flag)."""
    # MANAGED_SBATCH_KEYS is derived from SlurmOptions below: looked up when called
    return _check_option_map(value, label, _OptionMap("sbatch", MANAGED_SBATCH_KEYS, "mail-type=END"))


_SRUN_VALUE = re.compile(r"[A-Za-z0-9_.:@%+=,/&|*!()\[\]#~-]+")
#: srun options the batch step sets itself -> what to use instead
MANAGED_SRUN_KEYS = {
    "kill-on-bad-exit": "nothing (always 1: one dead rank ends the step)", "K": "nothing",
    "open-mode": "nothing (always append)", "output": "the log directory (log.dir)", "o": "log.dir",
    "error": "log.dir", "e": "log.dir", "ntasks": "--nodes and --gpus", "n": "--nodes and --gpus",
    "ntasks-per-node": "--gpus (one task per GPU)", "nodes": "--nodes", "N": "--nodes",
    "cpus-per-task": "--cpus-per-task", "c": "--cpus-per-task", "gpus": "--gpus (per node)",
    "gpus-per-node": "--gpus", "G": "--gpus", "gres": "--gpus", "job-name": "--job-name",
    "J": "--job-name", "time": "--time", "t": "--time", "signal": "--signal",
}
_SRUN_MAP = _OptionMap("srun", MANAGED_SRUN_KEYS, "cpu-bind=none", _SRUN_VALUE,
                       "use letters, digits and _ . : @ % + = , / & | * ! ( ) [ ] # ~ - only "
                       "(no blanks, quotes, $, ; or backslashes)")


def check_srun_args(value: Any, label: str) -> dict:
    """A mapping of srun options for the job step (``--container-image``, ``--cpu-bind``, ``--mpi``
    ...): long names that the batch step does not set itself, values without blanks, quotes, $, ;
    or backslashes (True or empty: a flag). They reach srun as single, quoted words."""
    return _check_option_map(value, label, _SRUN_MAP)


_IMAGE = re.compile(r"[A-Za-z0-9_./:@+#~=-]+")


def _name_of(what: str) -> Callable[[Any, str], Any]:
    return check_text(_NAME, f"use the {what} name as Slurm lists it")


@dataclass(frozen=True, kw_only=True)
class SlurmOptions:
    """Every valid key of a job YAML's ``slurm:`` section and the matching ``submit`` flags."""

    UNKNOWN_KEY_HINT: ClassVar[str] = ("any other sbatch option goes under slurm.sbatch_args or "
                                       "--sbatch-arg KEY=VALUE")

    nodes: int | str = _opt(1, check_nodes, "nodes; each runs one task per GPU; a range MIN-MAX "
                            "(sbatch's) starts the job on what is free, MIN nodes at least, and "
                            "the job runs with the nodes it got (the local backend runs MAX)",
                            flags=("--nodes", "-N"), group=LAYOUT, sbatch="nodes",
                            type=lambda text: int(text) if text.strip().isdigit() else text,
                            metavar="N|MIN-MAX")
    gpus_per_node: int = _opt(
        1, check_count(1), "GPUs per node, which is also the tasks per node (one task per GPU); "
        "per node, unlike sbatch's -G/--gpus, which counts the GPUs of all nodes",
        flags=("--gpus", "-G", "--gpus-per-node"), group=LAYOUT, sbatch="gpus-per-node", type=int,
        metavar="G")
    cpus_per_task: int | None = _opt(
        None, check_count(1, optional=True), "CPUs per task (default: data.num_workers + 1)",
        flags=("--cpus-per-task", "-c"), group=LAYOUT, sbatch="cpus-per-task", type=int,
        metavar="C")
    time: str = _opt("01:00:00", check_time, "time limit: minutes, HH:MM:SS or D-HH:MM:SS",
                     flags=("--time", "-t"), sbatch="time", metavar="TIME")
    partition: str | None = _opt(None, _name_of("partition"), "partition to run in "
                                 "(default: the cluster's default partition)",
                                 flags=("--partition", "-p"), sbatch="partition", passthrough=True,
                                 metavar="NAME")
    account: str | None = _opt(None, _name_of("account"), "account to charge the job to",
                               flags=("--account", "-A"), sbatch="account", passthrough=True,
                               metavar="NAME")
    qos: str | None = _opt(None, _name_of("qos"), "quality of service",
                           flags=("--qos", "-q"), sbatch="qos", passthrough=True, metavar="NAME")
    mem: str | None = _opt(None, check_text(_MEM, "write e.g. 16G, 500M or 0 (all of the node)"),
                           "memory per node, e.g. 64G (0: all of it)",
                           flags=("--mem",), sbatch="mem", passthrough=True, metavar="SIZE")
    constraint: str | None = _opt(None, check_text(), "node features required, e.g. a100&ib",
                                  flags=("--constraint", "-C"), sbatch="constraint",
                                  passthrough=True, metavar="FEATURES")
    dependency: str | None = _opt(
        None, check_text(_DEPENDENCY, "write e.g. afterok:12345 or afterany:12345:12346"),
        "start after other jobs, e.g. afterok:12345", flags=("--dependency", "-d"),
        sbatch="dependency", passthrough=True, metavar="TYPE:JOBID")
    exclusive: bool = _opt(False, check_flag, "whole nodes, shared with no other job",
                           flags=("--exclusive",), sbatch="exclusive", passthrough=True,
                           action="store_true")
    job_name: str | None = _opt(
        None, check_text(_NAME, "use 1-128 letters, digits, '_', '.', '+' or '-', starting with "
                                "a letter or digit (the name also names the log directory)"),
        "job name (default: the config's name)", flags=("--job-name", "-J"), sbatch="job-name",
        metavar="NAME")
    signal: str | None = _opt(None, check_signal, "preemption signal and its grace seconds "
                              "before the time limit, e.g. USR2@90 (default: <preempt.signal>@90)",
                              flags=("--signal",), sbatch="signal", metavar="SIG@SECONDS")
    sbatch_args: dict = _opt({}, check_sbatch_args, "any other sbatch option, e.g. mail-type=END "
                             "(repeatable; a flag without a value: hold=)",
                             flags=("--sbatch-arg",), action="append", metavar="KEY=VALUE")
    srun_args: dict = _opt({}, check_srun_args, "an srun option for every rank's step, e.g. "
                           "cpu-bind=none or container-image=IMAGE (pyxis) (repeatable; a flag "
                           "without a value: label=)", flags=("--srun-arg",), action="append",
                           metavar="KEY=VALUE")
    container: str | None = _opt(
        None, check_text(_IMAGE, "give an image path or URI without blanks or shell characters, "
                                 "e.g. /images/torch.sif or docker://pytorch/pytorch:latest"),
        "run each rank as `apptainer exec --nv IMAGE ...` (or singularity), sbatch backend",
        flags=("--container",), metavar="IMAGE")
    max_restarts: int = _opt(
        DEFAULT_MAX_RESTARTS, check_count(0), "restart the ranks inside the allocation after a lost "
        "node, a killed rank or a hang, at most N times, resuming from the newest checkpoint (0: a "
        "fault ends the job, as before)", flags=("--max-restarts",), group=RESTARTS, type=int, metavar="N")
    spare_nodes: int = _opt(0, check_count(0), "K more nodes in the allocation that stand by and "
                            "replace a failed one", flags=("--spare-nodes",), group=RESTARTS, type=int,
                            metavar="K")
    min_nodes: int | None = _opt(None, check_count(1, optional=True), "go on with fewer nodes, down to "
                                 "M, when no spare is left (default: --nodes: never fewer)",
                                 flags=("--min-nodes",), group=RESTARTS, type=int, metavar="M")
    restart_on_error: bool = _opt(False, check_flag, "restart after an exception raised by the code "
                                  "(or its non-zero exit) too", flags=("--restart-on-error",),
                                  group=RESTARTS, action="store_true")
    hang_timeout: float = _opt(
        DEFAULT_HANG_TIMEOUT, check_seconds, "call a hang when no rank finished a step for max(S, 10x "
        "the median step time) once steps are timed, and restart after taking the ranks' stacks "
        "(0: only the stall timeout, train.collective_timeout_s + 15 s)", flags=("--hang-timeout",),
        group=RESTARTS, type=float, metavar="S")
    warm_standby: bool = _opt(
        False, check_flag, "after the ranks train, keep a standby step of ranks that imported torch, "
        "so a restart skips Python's and torch's start-up (each standby rank holds an imported torch "
        "in host memory, about 0.3-0.4 GB, and imports it beside the training)",
        flags=("--warm-standby",), group=RESTARTS, action="store_true")
    health_check: bool = _opt(
        True, check_flag, "before each start and restart, check the next step's nodes (GPUs answer "
        "NVML, staged data fits, the rendezvous address routes) and exclude a node that fails; "
        "--no-health-check starts the ranks unchecked", flags=("--no-health-check",), group=RESTARTS,
        action="store_false")
    stage: tuple = _opt((), check_stage, "before the job starts, copy SRC (a file, an LMDB or a folder) "
                        "once per node to node-local storage and give every rank the path in "
                        "$DDP_HPC_STAGE_<NAME> (NAME: SRC's base name, upper-cased); removed when the job "
                        "ends, kept for a requeue (repeatable; flags add to the YAML's list)",
                        flags=("--stage",), group=TOP, action="append", metavar="SRC[=NAME]")
    backend: str = _opt("auto", check_backend, "auto: submitit when Slurm answers, else local; or a "
                        "backend's name: local, sbatch, submitit or one registered",
                        flags=("--backend",), group=TOP, metavar="NAME")

    def __post_init__(self) -> None:
        """Each value that is not its field's default is checked (a default passes its check:
        tests/test_config_checks.py), so a copy with one value changed (``dataclasses.replace``)
        checks that one again, not all of them."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not _is_default(f, value):
                object.__setattr__(self, f.name, f.metadata["parse"](value, f"slurm.{f.name}"))
        _check_restarts(self)

    @property
    def node_range(self) -> tuple[int, int]:
        """(MIN, MAX) nodes: (N, N) for a plain count."""
        return node_range(self.nodes)


def _is_default(f: dataclasses.Field, value: Any) -> bool:
    """``value`` is the field's default, of the same type (``True`` is no node count of 1)."""
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return type(value) is type(default) and value == default


def _check_restarts(o: SlurmOptions) -> None:
    """The restart options against each other and --nodes."""
    low, high = node_range(o.nodes)
    if o.min_nodes is not None and o.min_nodes > high:
        raise ConfigError(f"--min-nodes {o.min_nodes} (slurm.min_nodes) is more than --nodes {o.nodes}",
                          f"use --min-nodes {high} or fewer: it is how few nodes a job may go on with")
    if o.spare_nodes and low != high:
        raise ConfigError(f"--spare-nodes {o.spare_nodes} (slurm.spare_nodes) with the node range --nodes "
                          f"{o.nodes}: which of the nodes Slurm gives are spares would be a guess",
                          f"give a node count (--nodes {high}) with --spare-nodes, or the range without it")
    hang = o.hang_timeout != DEFAULT_HANG_TIMEOUT
    if o.max_restarts == 0 and (o.spare_nodes or o.min_nodes is not None or o.restart_on_error or hang
                                or o.warm_standby):
        given = [w for w, on in (("--spare-nodes", o.spare_nodes), ("--min-nodes", o.min_nodes is not None),
                                 ("--restart-on-error", o.restart_on_error), ("--hang-timeout", hang),
                                 ("--warm-standby", o.warm_standby)) if on]
        key = given[0][2:].replace("-", "_")
        raise ConfigError(f"{' and '.join(given)} (slurm.{key}) need "
                          "restarts inside the allocation, but --max-restarts is 0",
                          f"give --max-restarts 1 or more, or drop {' and '.join(given)}")


FIELDS = {f.name: f for f in dataclasses.fields(SlurmOptions)}

#: the options handed to sbatch (and submitit) under their own name, in this order
PASSTHROUGH = tuple(name for name, f in FIELDS.items() if f.metadata["passthrough"])


def _managed() -> dict[str, str]:
    """sbatch options ddp_hpc sets itself -> what to use instead: a --sbatch-arg for them would
    silently break the one-task-per-GPU layout, the log layout or preemption."""
    out = {"ntasks": "--nodes and --gpus", "n": "--nodes and --gpus",
           "ntasks-per-node": "--gpus (one task per GPU)", "gpus": "--gpus (per node)",
           "G": "--gpus (per node)", "gres": "--gpus",
           "output": "the log directory (log.dir)", "o": "log.dir", "error": "log.dir",
           "e": "log.dir", "open-mode": "nothing (always append)", "array": "--sweep",
           "a": "--sweep", "requeue": "nothing (always set)", "no-requeue": "nothing",
           "wrap": "a config file", "chdir": "running from that directory", "D": "cd"}
    for f in FIELDS.values():
        if f.metadata["sbatch"]:
            flag = f.metadata["flags"][0]
            out[f.metadata["sbatch"]] = flag
            out.update({s.lstrip("-"): flag for s in f.metadata["flags"][1:] if len(s) == 2})
    return out


MANAGED_SBATCH_KEYS = _managed()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field, in groups; every default is None, so ``given`` sees what was typed."""
    groups: dict[str, Any] = {TOP: parser}
    for f in FIELDS.values():
        meta = f.metadata
        group = groups.get(meta["group"]) or groups.setdefault(
            meta["group"], parser.add_argument_group(meta["group"]))
        default = None if f.default is dataclasses.MISSING else f.default
        help_text = f"{meta['help']}; YAML slurm.{f.name}" + (
            f" (default: {default})" if default not in (None, False, ()) else "")
        group.add_argument(*meta["flags"], dest=f.name, default=None, help=help_text,
                           **meta["cli"])


def given(args: Mapping[str, Any]) -> dict[str, Any]:
    """The options typed on the command line, from the parsed flags (``vars(namespace)``; the
    fields `add_arguments` added), with ``sbatch_args`` and ``srun_args`` as KEY -> VALUE mappings."""
    out = {name: args[name] for name in FIELDS if args.get(name) is not None}
    for name in ("sbatch_args", "srun_args"):
        if name in out:
            out[name] = split_sbatch_args(out[name])
    return out


def split_sbatch_args(items: Sequence[str]) -> dict[str, str | bool]:
    """``["mail-type=END", "hold="]`` -> ``{"mail-type": "END", "hold": True}`` (--sbatch-arg and
    --srun-arg alike)."""
    out: dict[str, str | bool] = {}
    for item in items:
        key, eq, value = item.partition("=")
        out[key.strip().lstrip("-")] = value if eq and value != "" else True
    return out


def merged(base: SlurmOptions, cli: Mapping[str, Any], label=None) -> SlurmOptions:
    """``base`` (the YAML section) with the command-line values on top, each checked under the
    name of its flag (``label(field)`` instead: the Python API's keyword); sbatch_args and
    srun_args are merged key by key, stage adds to the list."""
    name_of = label or (lambda name: FIELDS[name].metadata["flags"][0])
    checked = {name: FIELDS[name].metadata["parse"](value, name_of(name)) for name, value in cli.items()}
    for name in ("sbatch_args", "srun_args"):
        if name in checked:
            checked[name] = {**getattr(base, name), **checked[name]}
    if "stage" in checked:   # flags add to the YAML's list (a clash is refused at submit)
        checked["stage"] = (*base.stage, *checked["stage"])
    return dataclasses.replace(base, **checked)


def sbatch_items(opts: Any) -> list[tuple[str, str | None]]:
    """The passthrough options of ``opts`` (a SlurmOptions or anything with those attributes)
    that are set: (sbatch option name, value, or None for a flag), in field order."""
    out: list[tuple[str, str | None]] = []
    for name in PASSTHROUGH:
        value = getattr(opts, name)
        if value is None or value is False:
            continue
        out.append((FIELDS[name].metadata["sbatch"], None if value is True else str(value)))
    return out
