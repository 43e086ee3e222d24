"""A stand-in for the exec wrapper's script bootstrap, for tests of ddp_hpc.integrations: on this
PYTHONPATH every Python process calls ``ddp_hpc.integrations.register(when_imported)`` with a small
post-import hook of its own (a meta-path finder that runs the callback after the module's code)."""
import importlib.abc
import importlib.machinery
import sys

_waiting = {}


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _waiting:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        exec_module, callbacks = spec.loader.exec_module, _waiting.pop(name)

        def exec_then_call(module):
            exec_module(module)
            for callback in callbacks:
                callback(module)

        spec.loader.exec_module = exec_then_call
        return spec


def when_imported(name, callback):
    if name in sys.modules:
        callback(sys.modules[name])
    else:
        _waiting.setdefault(name, []).append(callback)


sys.meta_path.insert(0, _AfterImport())
import ddp_hpc.integrations  # noqa: E402

ddp_hpc.integrations.register(when_imported)
