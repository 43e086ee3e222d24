"""``ddp-hpc submit --stage SRC[=NAME]`` for a user's own script: node-local copies before it starts.

Each ``--stage`` names a file, an LMDB or a folder on the shared filesystem.  ``submit`` checks
them (:func:`parse_stage_items`) and hands them to every rank's wrapper (``ddp_hpc.exec``) in one
variable, ``$DDP_HPC_STAGE`` (JSON).  Before the script starts, :func:`run_staged` stages each one
on every node with :func:`ddp_hpc.data.nodestage.stage_on_node` (the mechanism of
``data.io=stage``: local rank 0 copies, or adopts the copy the batch script's ``sbcast`` left, or
reuses a verified copy of a requeued attempt; the others wait) and gives the script the local path
in ``DDP_HPC_STAGE_<NAME>``.  When the script has ended every rank gives the copy back
(:func:`ddp_hpc.data.nodestage.release_on_node`; the last one out removes it), unless it exited 75
(preempted: the requeued job reuses the copy).

NAME defaults to SRC's base name (a SRC whose name holds ``=`` needs ``=NAME``, unless it exists
and its part before the ``=`` does not); it is upper-cased, and any character other than a letter, a digit
or ``_`` becomes ``_`` (``/shared/train.lmdb`` -> ``DDP_HPC_STAGE_TRAIN_LMDB``).  A script reads it
with :func:`staged_path` (or ``os.environ``), so it changes one path, or none.

The same list comes from a job YAML's ``slurm.stage`` (the flags add to it:
:func:`parse_stage_sources` names both places on a clash) and from ``ddp_hpc.submit_job(...,
stage=[...])``.  A config job's ``ddp_hpc.run`` and a function job's rank stage it in their own
process (:func:`call_staged`) instead of the wrapper.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Callable, Mapping, MutableMapping, Sequence, TypeVar

from ddp_hpc.data.copy import source_kind
from ddp_hpc.data.errors import StageError
from ddp_hpc.data.nodestage import node_user, release_on_node, stage_log_entry, stage_on_node
from ddp_hpc.data.stage import resolve_stage_dir
from ddp_hpc.errors import HintError
from ddp_hpc.exits import EX_TEMPFAIL

__all__ = ["SPEC_VAR", "PREFIX", "StageItem", "parse_stage_items", "parse_stage_sources", "encode_items",
           "decode_items", "run_staged", "requested_items", "call_staged", "staged_path"]

SPEC_VAR = "DDP_HPC_STAGE"        #: the JSON list of what to stage, from submit to the wrapper
PREFIX = "DDP_HPC_STAGE_"         #: + NAME: the local path each rank's script gets
_GIVEN_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")
_BAD_PATH = re.compile(r"[\x00-\x1f\x7f]")
EXIT_STAGE_FAILED = 1
T = TypeVar("T")


@dataclass(frozen=True)
class StageItem:
    """One ``--stage``: the absolute source, the variable's NAME and what the source is
    (``file`` | ``lmdb`` | ``dir``: only files and LMDBs can go by ``sbcast``)."""

    src: str
    name: str
    kind: str

    @property
    def variable(self) -> str:
        return PREFIX + self.name


def _default_name(src: str) -> str:
    base = os.path.basename(src.rstrip("/")) or "ROOT"
    return re.sub(r"[^A-Z0-9_]", "_", base.upper())[:64]


def _split(item: str, workdir: str) -> tuple[str, str | None]:
    """``SRC=NAME`` -> (SRC, NAME).  The last ``=`` belongs to SRC when its right side holds a
    ``/``, or when the whole item names a path that exists and the left side does not."""
    src, eq, name = item.rpartition("=")
    if not eq or "/" in name or not src:
        return item, None
    here = os.path.join(workdir, os.path.expanduser(item))
    if os.path.exists(here) and not os.path.exists(os.path.join(workdir, os.path.expanduser(src))):
        return item, None
    return src, name


def parse_stage_items(items: Sequence[str], *, where: str = "--stage", workdir: str | None = None,
                      ) -> tuple[StageItem, ...]:
    """Check ``SRC[=NAME]`` items (the source must exist here); -> one :class:`StageItem` each.
    A bad name, a missing source, a path with control characters, or two items with one source
    or one name are a :class:`StageError` naming the item."""
    return parse_stage_sources([(where, items)], workdir=workdir)


def _item(item: str, where: str, workdir: str) -> StageItem:
    src, name = _split(str(item), workdir)
    if _BAD_PATH.search(src):
        raise StageError(f"{where} {item!r}: the path holds a control character (newline, tab, ...)",
                         "rename the file or folder, or link it from a plain path")
    if name is not None and not _GIVEN_NAME.fullmatch(name):
        raise StageError(f"{where} {item!r}: NAME {name!r} is not letters, digits and _ (at most 64)",
                         f"write e.g. {where} {src}=TRAIN: the script reads $DDP_HPC_STAGE_TRAIN")
    src = os.path.abspath(os.path.join(workdir, os.path.expanduser(src)))
    try:
        kind = source_kind(src)
    except StageError:
        raise StageError(f"{where} {item!r}: {src} does not exist",
                         "give a file, an LMDB folder or a folder that this machine and the nodes see "
                         "(the shared filesystem)") from None
    return StageItem(src, (name or _default_name(src)).upper(), kind)


def parse_stage_sources(sources: Sequence[tuple[str, Sequence[str]]], *, workdir: str | None = None,
                        ) -> tuple[StageItem, ...]:
    """:func:`parse_stage_items` over items from several places, each ``(where, items)`` (e.g.
    ``("jobs/x.yaml: slurm.stage", [...])`` then ``("--stage", [...])``), in order: one list,
    and a clash across places names both."""
    out: list[tuple[StageItem, str, str]] = []
    workdir = workdir or os.getcwd()
    for where, items in sources:
        for item in items:
            new = _item(item, where, workdir)
            for old, old_where, old_item in out:
                if old.src != new.src and old.name != new.name:
                    continue
                same = "source" if old.src == new.src else f"variable {new.variable}"
                if old_where == where:
                    problem = f"{where}: {old.src} and {item!r} give the same {same}"
                else:
                    problem = f"{old_where} {old_item!r} and {where} {item!r} give the same {same}"
                raise StageError(problem, "stage each source once, each under its own NAME (SRC=NAME); "
                                 "--stage flags add to the YAML's slurm.stage list, they do not replace it")
            out.append((new, where, str(item)))
    return tuple(new for new, _, _ in out)


def encode_items(items: Sequence[StageItem]) -> str:
    """The value of ``$DDP_HPC_STAGE`` for ``items``; "" for none (nothing to stage)."""
    return json.dumps([{"src": i.src, "name": i.name, "kind": i.kind} for i in items]) if items else ""


def decode_items(text: str) -> tuple[StageItem, ...]:
    """``$DDP_HPC_STAGE`` back to items; a value that is not what submit writes is a StageError."""
    try:
        raw = json.loads(text)
        items = tuple(StageItem(str(d["src"]), str(d["name"]), str(d["kind"])) for d in raw)
    except (ValueError, TypeError, KeyError) as e:
        raise StageError(f"${SPEC_VAR} is not a list of staging requests ({e}): {text[:200]!r}",
                         f"let ddp-hpc submit --stage set it, or unset {SPEC_VAR}") from None
    bad = [i.name for i in items if not _GIVEN_NAME.fullmatch(i.name) or not os.path.isabs(i.src)]
    if bad:
        raise StageError(f"${SPEC_VAR} holds bad names or relative sources: {bad}",
                         f"let ddp-hpc submit --stage set it, or unset {SPEC_VAR}")
    return items


def staged_path(name: str, default: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The node-local copy that ``--stage SRC=NAME`` made for this script (``$DDP_HPC_STAGE_NAME``),
    else ``default`` (e.g. the shared path, so the script also runs without ``--stage``)."""
    env = os.environ if environ is None else environ
    path = env.get(PREFIX + name.upper(), default)
    if path is None:
        raise StageError(f"${PREFIX}{name.upper()} is not set: nothing was staged under that name",
                         f"submit with --stage SRC={name.upper()}, or pass a default path")
    return path


def _stage_all(env, items: Sequence[StageItem], child_env: dict, log) -> list[str]:
    """Stage ``items`` on this node, each path into ``child_env``; -> the copies held.  A failure
    gives back what was staged and raises."""
    held: list[str] = []
    try:
        dest = resolve_stage_dir("auto", child_env)
        for item in items:
            res = stage_on_node(item.src, dest, env)
            held.append(res.path)
            child_env[item.variable] = res.path
            if env.local_rank == 0:
                line, fields = stage_log_entry(res, node_user(env), item.variable)
                log.info(line)
                log.event("stage", **fields)
    except BaseException:
        _release(held, env, log)
        raise
    return held


def run_staged(env, child_env: dict, log, supervise: Callable[[], int]) -> int:
    """Stage what ``child_env[$DDP_HPC_STAGE]`` lists for this rank, put each path in
    ``child_env``, run ``supervise()`` (the script) and give the copies back unless it exited 75.

    ``env``: the rank's DistEnv; ``log``: its run log (``info`` / ``warning`` / ``event``, never
    raising).  Staging that fails is reported (stderr, an ``error`` event) and the script does
    not start: -> exit status 1."""
    spec = child_env.pop(SPEC_VAR, "")
    if not spec:
        return supervise()
    try:
        held = _stage_all(env, decode_items(spec), child_env, log)
    except (HintError, OSError) as exc:
        log.warning(f"staging failed: {exc}")
        log.event("error", exc_type=type(exc).__name__, message=str(exc), traceback=None,
                  exit_code=EXIT_STAGE_FAILED, signal=None)
        return EXIT_STAGE_FAILED
    status = supervise()
    if status != EX_TEMPFAIL:
        _release(held, env, log)
    return status


def requested_items(environ: MutableMapping[str, str] | None = None) -> tuple[StageItem, ...]:
    """What submit asked this rank to stage (``$DDP_HPC_STAGE``, taken out of ``environ``, by
    default ``os.environ``); empty when nothing."""
    environ = os.environ if environ is None else environ
    spec = environ.pop(SPEC_VAR, "")
    return decode_items(spec) if spec else ()


def call_staged(env, items: Sequence[StageItem], log, body: Callable[[], T], *,
                environ: MutableMapping[str, str] | None = None,
                requeued: Callable[[T], bool] = lambda _value: False) -> T:
    """In this process (a function job's rank, a config job's ``ddp_hpc.run``): stage ``items``,
    set each ``DDP_HPC_STAGE_<NAME>`` in ``environ`` (``os.environ``), return ``body()`` and give
    the copies back, unless it ended in a requeue (``SystemExit(75)``, or ``requeued(value)``):
    the requeued job reuses them.  A staging failure raises before ``body`` runs."""
    environ = os.environ if environ is None else environ
    held = _stage_all(env, items, environ, log)   # type: ignore[arg-type]
    try:
        value = body()
    except SystemExit as exc:
        if exc.code != EX_TEMPFAIL:
            _release(held, env, log)
        raise
    except BaseException:
        _release(held, env, log)
        raise
    if not requeued(value):
        _release(held, env, log)
    return value


def _release(paths: Sequence[str], env, log) -> None:
    """Give each copy back; a removal that fails is a warning (the script's status stands)."""
    for path in paths:
        try:
            outcome, left = release_on_node(path, env)
        except (OSError, StageError) as exc:
            log.warning(f"stage cleanup of {path} failed: {exc}")
            continue
        if outcome == "removed":
            log.info(f"stage cleanup: removed {path}")
        elif env.local_rank == 0 and outcome == "kept":
            log.info(f"stage cleanup: {node_user(env)} is done with {path}; kept for {', '.join(left)} "
                     "(the last one out removes it)")
