"""Factories a job config names (``model.name``, ``data.dataset``, ``data.eval_dataset``,
``train.loss``): a built-in name or ``pkg.module:attr``, turned into the callable it names.

    resolve_factory("mlp", BUILTIN_MODELS, "model.name")                   # the job, on the node
    resolve_factory(spec, BUILTIN_MODELS, "model.name", workdir="/home/me/project")   # before submit

With ``workdir`` the spec is checked the way the job will import it, from its working directory,
before it queues (``ddp_hpc.config.validate``): the errors name that directory, and an exception
that the user's module raises while it imports becomes a ConfigError too.
"""

from __future__ import annotations

import contextlib
import importlib
import reprlib
import sys
from typing import Any, Iterator, Mapping

from ddp_hpc.config.typed import ConfigError

__all__ = ["resolve_factory"]


def resolve_factory(spec: str, builtins: Mapping[str, Any] | None, key: str, *,
                    workdir: str | None = None) -> Any:
    """The callable that ``spec`` names under config key ``key``: ``builtins[spec]``, or the
    attribute path after ':' in the module before it. ``builtins`` None: a name without ':' is not
    checked (None is returned). Raises ConfigError naming the key, the value and the fix."""
    checking = workdir is not None
    if builtins is not None and spec in builtins:
        return builtins[spec]
    if ":" not in spec:
        if builtins is None:
            return None
        raise ConfigError(f"{key}={spec} is neither a built-in nor an import path" if checking else
                          f"{key} = {spec!r} is neither a built-in nor an import path.",
                          f"use one of {', '.join(sorted(builtins))} or 'pkg.module:factory'")
    mod_name, _, attr = spec.partition(":")
    obj = _import(mod_name, key, spec, workdir)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"module {mod_name!r} has no attribute {attr!r} ({key}={spec})" if checking
                              else f"{key} = {spec!r}: module {mod_name!r} has no attribute {attr!r}.",
                              f"name a class or function defined in {mod_name}")
        obj = getattr(obj, part)
    if callable(obj):
        return obj
    if checking:
        raise ConfigError(f"{key}={spec} is not callable: it is {reprlib.repr(obj)} "
                          f"({type(obj).__name__})", "name a class or a function that returns the object")
    raise ConfigError(f"{key} = {spec!r} is not callable", "name a class or function")


def _import(mod_name: str, key: str, spec: str, workdir: str | None) -> Any:
    """The module ``mod_name``; with ``workdir``, imported as from there, and an exception the
    module raises while it runs is reported (on the node it propagates as it is)."""
    if workdir is None:
        try:
            return importlib.import_module(mod_name)
        except ImportError as e:
            raise ConfigError(f"{key} = {spec!r}: cannot import module {mod_name!r} ({e}).",
                              "check the spelling and that the package is installed or on "
                              "PYTHONPATH") from None
    try:
        with _importable_from(workdir):
            return importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(f"cannot import module {mod_name!r} ({key}={spec}): {e}",
                          f"check the spelling, and that the module is installed or importable "
                          f"from the job's working directory {workdir} (or PYTHONPATH)") from None
    except Exception as e:     # the user's module failed while it ran: show what it raised
        raise ConfigError(f"importing module {mod_name!r} ({key}={spec}) raised "
                          f"{type(e).__name__}: {e}", f"fix the error in {mod_name}") from None


@contextlib.contextmanager
def _importable_from(workdir: str) -> Iterator[None]:
    """Modules of the working directory importable, as for the job (``python -m ddp_hpc.run``
    puts its working directory first on sys.path)."""
    sys.path.insert(0, workdir)
    importlib.invalidate_caches()
    try:
        yield
    finally:
        sys.path.remove(workdir)
