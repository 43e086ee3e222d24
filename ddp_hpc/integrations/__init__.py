"""Framework integrations: progress of Lightning and Hugging Face scripts for ``ddp-hpc status``.

- ``lightning``: a Lightning callback, loaded by Lightning itself through the entry points
  ``lightning.pytorch.callbacks_factory`` / ``pytorch_lightning.callbacks_factory`` (setup.cfg);
- ``transformers``: a ``TrainerCallback`` that every Hugging Face ``Trainer`` gets once
  `register` has been called.

`register(when_imported)` is what the script-job bootstrap of ``ddp-hpc exec`` calls at start-up
of every rank (``when_imported(module_name, callback)`` runs ``callback(module)`` right after that
module is first imported, or at once); it imports nothing itself.  docs/scripts.md, "Lightning
and Hugging Face".
"""
from __future__ import annotations

from types import ModuleType
from typing import Callable

__all__ = ["register"]


def _install_transformers(module: ModuleType) -> None:
    from ddp_hpc.integrations import lightning, transformers

    if lightning.in_job():
        transformers.install(module)


def register(when_imported: Callable[[str, Callable[[ModuleType], None]], None]) -> None:
    """Hook the integrations that need one into the imports of the script (inside a job only)."""
    when_imported("transformers.trainer", _install_transformers)
