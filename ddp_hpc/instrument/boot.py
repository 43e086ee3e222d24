"""Start-up of an instrumented script: what ``sitecustomize`` runs in the child of
``ddp_hpc.exec`` before the script's first line (docs/scripts.md, "What status sees without
changes").

``start(config)`` takes the JSON the wrapper put in ``DDP_HPC_INSTRUMENT_BOOT``
(``ddp_hpc.exec.instrumented.BOOT_VAR``, which ``site/sitecustomize.py`` reads):
``exit_fd`` (the pipe for the exit record, `ddp_hpc.instrument.ending`), ``fault`` (this rank's
faulthandler file in the run directory) and ``pythonpath`` (the user's own PYTHONPATH, given back
to ``os.environ`` so programs the script starts see it unchanged). It imports nothing heavy: the
step hooks (`ddp_hpc.instrument.steps`) are installed once the script itself imports torch, and
``ddp_hpc.integrations.register(when_imported)`` runs when that module exists.
"""
from __future__ import annotations

import faulthandler
import importlib
import importlib.util
import json
import os
import sys
from types import ModuleType

from ddp_hpc.instrument.ending import watch_ending
from ddp_hpc.instrument.hooks import when_imported

__all__ = ["start"]

#: the module whose ``register(when_imported)`` hooks the frameworks (Lightning, transformers)
INTEGRATIONS = "ddp_hpc.integrations"

_fault_file = None   # kept open for faulthandler for the life of the process


def start(config: str) -> None:
    """Set up this process (the script's interpreter) from the wrapper's ``config``."""
    global _fault_file
    cfg = json.loads(config)
    if cfg.get("pythonpath") is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = cfg["pythonpath"]
    if cfg.get("exit_fd") is not None:
        watch_ending(int(cfg["exit_fd"]))      # first atexit handler: it runs last
    if cfg.get("fault"):
        try:
            _fault_file = open(cfg["fault"], "a", encoding="utf-8")   # noqa: SIM115 - lives on
            faulthandler.enable(file=_fault_file, all_threads=True)
        except OSError as exc:
            print(f"ddp_hpc: no native-crash stacks: cannot open {cfg['fault']}: {exc}",
                  file=sys.stderr, flush=True)
    when_imported("torch", _on_torch)
    # the framework integrations, looked up by name (an optional part: no import of it here)
    if importlib.util.find_spec(INTEGRATIONS) is not None:
        importlib.import_module(INTEGRATIONS).register(when_imported)


def _on_torch(torch: ModuleType) -> None:
    from ddp_hpc.instrument.steps import install
    install(torch)
