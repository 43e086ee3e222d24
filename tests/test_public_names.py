"""The public names of ``ddp_hpc`` are imported on first use, yet ``help()`` and
``inspect.signature`` see the functions users call, before and after their modules load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CODE = r'''
import inspect, pydoc, sys
import ddp_hpc
assert "torch" not in sys.modules and "ddp_hpc.submit" not in sys.modules, "import ddp_hpc is cheap"
for loaded in (False, True):
    if loaded:
        import ddp_hpc.submit.cli as cli, ddp_hpc.report   # bind the modules of the same names
        assert ddp_hpc.submit.cli is cli and callable(ddp_hpc.submit.cli.main)
    sig = inspect.signature(ddp_hpc.submit)
    assert list(sig.parameters)[:4] == ["target", "args", "kwargs", "nodes"], sig
    assert "step" in inspect.signature(ddp_hpc.report).parameters
    text = pydoc.render_doc(ddp_hpc.submit, renderer=pydoc.plaintext)
    assert "submit(target: " in text and "nodes: 'int' = 1" in text, text[:600]
    assert "Submit ``target``" in text and "job.backend" in text, text[:2000]
    assert "PACKAGE CONTENTS" not in text
    from ddp_hpc import submit
    assert submit is ddp_hpc.submit and repr(submit).startswith("<function submit at ")
print("ok")
'''


def test_help_and_signature_show_the_functions_behind_lazy_names():
    p = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]
