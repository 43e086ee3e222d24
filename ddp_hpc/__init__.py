"""ddp_hpc: PyTorch DDP from a laptop to many Slurm GPU nodes.

Data flow (see docs/architecture.md): config -> submit -> env -> dist -> data -> train -> run logs -> status.

The public names, imported on first use (``import ddp_hpc`` itself loads neither torch nor
submitit, so the command-line tools start fast); ``help()`` and ``inspect.signature`` show the
functions themselves:

    ddp_hpc.submit(fn_or_command, nodes=2, gpus=4, ...)   submit a job; returns a handle
    ddp_hpc.fit(model, dataset, config=...)               train with ddp_hpc's loop
    ddp_hpc.setup_ddp() / ddp_hpc.cleanup_ddp()           process group for any launcher
    ddp_hpc.launch_distributed(fn, world_size)            a function on N local processes
    ddp_hpc.preemption.requested() / .requeue()           preemption in your own script
    ddp_hpc.checkpoint.save(...) / .load(...)             atomic rank-0 checkpoints
    ddp_hpc.report(step=, total=, loss=)                  progress that ddp-hpc status shows
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__version__ = "0.1.0"

#: public name -> (module, attribute or None for the module itself)
_PUBLIC = {
    "submit": ("ddp_hpc.submit", "submit"),
    "fit": ("ddp_hpc.train.api", "fit"),
    "setup_ddp": ("ddp_hpc.dist", "setup_ddp"),
    "cleanup_ddp": ("ddp_hpc.dist", "cleanup_ddp"),
    "launch_distributed": ("ddp_hpc.launch.spawn", "launch_distributed"),
    "preemption": ("ddp_hpc.preemption", None),
    "checkpoint": ("ddp_hpc.checkpoint", None),
    "report": ("ddp_hpc.report", "report"),
}

__all__ = ["__version__", *_PUBLIC]


class _FunctionAndModule:
    """A public function that shares its name with a module of this package (``ddp_hpc.submit``
    is also the package ``ddp_hpc.submit``). It is the function to ``help()`` and
    ``inspect.signature`` (its ``__doc__``, ``__name__`` and ``__wrapped__``) and when called;
    every other attribute is the module's (``ddp_hpc.submit.cli``). Nothing is imported before
    it is used."""

    __slots__ = ("_where",)

    def __init__(self, module: str, function: str) -> None:
        object.__setattr__(self, "_where", (module, function))

    #: the module's namespace (what vars() and pytest's monkeypatch read and write)
    __dict__ = property(lambda self: vars(self._module()))  # type: ignore[assignment]

    def _module(self) -> types.ModuleType:
        return importlib.import_module(self._where[0])

    def _function(self) -> Any:
        module, function = self._where
        return getattr(importlib.import_module("ddp_hpc.submit.api" if module == "ddp_hpc.submit"
                                               else module), function)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._function()(*args, **kwargs)

    def __get__(self, obj: Any, objtype: Any = None) -> "_FunctionAndModule":
        return self    # a descriptor: inspect and pydoc treat it as a routine

    __doc__ = property(lambda self: self._function().__doc__)  # type: ignore[assignment]

    def __getattr__(self, name: str) -> Any:
        if name == "_where":
            raise AttributeError(name)
        if name in ("__wrapped__", "__name__", "__qualname__", "__annotations__", "__defaults__",
                    "__kwdefaults__"):
            return self._function() if name == "__wrapped__" else getattr(self._function(), name)
        return getattr(self._module(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._module(), name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._module(), name)

    def __repr__(self) -> str:
        return repr(self._function())

    def __dir__(self) -> list[str]:
        return dir(self._module())


_FunctionAndModule.__name__ = "function"   # pydoc's title: "Help on function in module ddp_hpc"


class _Name:
    """The attribute ``ddp_hpc.<name>`` for a `_FunctionAndModule`: it stays the function when
    the import system binds the module of the same name to it."""

    def __init__(self, name: str) -> None:
        self.value = _FunctionAndModule(*_PUBLIC[name])

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self.value

    def __set__(self, obj: Any, value: Any) -> None:
        """The module itself stays in sys.modules (``import ddp_hpc.submit.cli`` finds it)."""


class _Package(types.ModuleType):
    submit = _Name("submit")
    report = _Name("report")


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'ddp_hpc' has no attribute {name!r}")
    module, attr = _PUBLIC[name]
    value = importlib.import_module(module)
    return value if attr is None else getattr(value, attr)


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
