"""The public names of ``ddp_hpc`` are imported on first use, yet ``help()`` and
``inspect.signature`` see the functions users call, before and after their modules load.
``ddp_hpc.submit`` is a plain package (``python -m ddp_hpc.submit``); the Python call that
submits is ``ddp_hpc.submit_job``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CODE = r'''
import inspect, pydoc, sys, types
import ddp_hpc
assert "torch" not in sys.modules and "ddp_hpc.submit" not in sys.modules, "import ddp_hpc is cheap"
assert "step" in inspect.signature(ddp_hpc.report).parameters
for loaded in (False, True):
    if loaded:
        import ddp_hpc.submit.cli as cli, ddp_hpc.progress   # bind the modules behind the names
        assert ddp_hpc.submit.cli is cli and callable(ddp_hpc.submit.cli.main)
        assert isinstance(ddp_hpc.submit, types.ModuleType)
        assert callable(ddp_hpc.report)                      # still callable as the function
    sig = inspect.signature(ddp_hpc.submit_job)
    assert list(sig.parameters)[:4] == ["target", "args", "kwargs", "nodes"], sig
    text = pydoc.render_doc(ddp_hpc.submit_job, renderer=pydoc.plaintext)
    assert "submit_job(target: " in text and "nodes: 'int' = 1" in text, text[:600]
    assert "Submit ``target``" in text and "job.backend" in text, text[:2000]
    assert "PACKAGE CONTENTS" not in text
    from ddp_hpc import submit_job
    assert submit_job is ddp_hpc.submit_job and repr(submit_job).startswith("<function submit_job at ")
print("ok")
'''


def test_help_and_signature_show_the_functions_behind_lazy_names():
    p = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]
