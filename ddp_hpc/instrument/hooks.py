"""Post-import hooks: ``when_imported(name, callback)`` runs ``callback(module)`` right after
``name`` is first imported (or at once when it already is).

A finder placed first on ``sys.meta_path`` answers only for watched names: it asks the finders
behind it for the real spec and wraps its loader, whose ``exec_module`` runs the real one and
then the callbacks. The module's ``__loader__`` and ``__spec__.loader`` stay the real loader. A
callback that raises is reported once on stderr and never breaks the import.
"""
from __future__ import annotations

import sys
import threading
from importlib.abc import Loader, MetaPathFinder
from types import ModuleType
from typing import Callable

__all__ = ["when_imported"]

_callbacks: dict[str, list[Callable[[ModuleType], None]]] = {}
_lock = threading.RLock()


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Run ``callback(module)`` once ``name`` is imported; now when it already is."""
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _callbacks.setdefault(name, []).append(callback)
            if not any(isinstance(f, _Finder) for f in sys.meta_path):
                sys.meta_path.insert(0, _Finder())
            return
    _fire(callback, module)


def _fire(callback: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        callback(module)
    except Exception as exc:  # noqa: BLE001 - an import of the user's must never fail for us
        print(f"ddp_hpc: a hook on importing {module.__name__} failed: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)


def _run_callbacks(name: str) -> None:
    with _lock:
        pending = _callbacks.pop(name, [])
    module = sys.modules.get(name)
    if module is not None:
        for cb in pending:
            _fire(cb, module)


class _Finder(MetaPathFinder):
    """Finds nothing itself: for a watched name, the real spec with a `_Loader` around its loader."""

    def __init__(self) -> None:
        self._busy: set[str] = set()

    def find_spec(self, name, path, target=None):  # noqa: ANN001 - importlib's signature
        if name not in _callbacks or name in self._busy:
            return None
        self._busy.add(name)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.discard(name)
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, name)
        return spec


class _Loader(Loader):
    def __init__(self, real: Loader, name: str) -> None:
        self.real, self.name = real, name

    def create_module(self, spec):  # noqa: ANN001
        return self.real.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # the module's own loader from here on (importlib.resources, pickle, linecache use it)
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self.real
        if module.__spec__ is not None and module.__spec__.loader is self:
            module.__spec__.loader = self.real
        self.real.exec_module(module)
        _run_callbacks(self.name)
