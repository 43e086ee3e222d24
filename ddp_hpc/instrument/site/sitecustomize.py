"""ddp_hpc's start-up hook for a script run by ``ddp_hpc.exec`` (this directory is put first on
the script's PYTHONPATH). With ``DDP_HPC_INSTRUMENT_BOOT`` set it starts the instrumentation
(``ddp_hpc.instrument.boot``) and removes the variable, so programs the script starts run
uninstrumented; then it runs the ``sitecustomize`` that this one hides, if there is one.
"""
import importlib.machinery
import importlib.util
import os
import sys


def _ddp_hpc_boot():
    # ddp_hpc.exec.instrumented.BOOT_VAR, spelled out: no ddp_hpc import before it is wanted
    config = os.environ.pop("DDP_HPC_INSTRUMENT_BOOT", None)
    if not config:
        return
    try:
        from ddp_hpc.instrument.boot import start
    except ImportError as exc:
        print(f"ddp_hpc: no instrumentation in {sys.executable}: {exc}", file=sys.stderr, flush=True)
        return
    try:
        start(config)
    except Exception as exc:  # noqa: BLE001 - the script runs whatever happens here
        print(f"ddp_hpc: instrumentation failed to start: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)


def _ddp_hpc_chain():
    """Run the next ``sitecustomize`` on sys.path (the one this file hides) as ``sitecustomize``."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_ddp_hpc_boot()
_ddp_hpc_chain()
