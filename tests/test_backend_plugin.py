"""A third scheduler as a user would add one: the fake queue backend of docs/architecture.md ("The
Backend seam"), taken from the page as it is, saved as its own file, named in $DDP_HPC_BACKENDS
and nothing else edited, goes through the real commands in their own processes: submit, the job
table, status (its state from the backend's describe), --logs (the ranks' output), cancel, and
status again. Whatever still switched on the known backends' names or kinds would send it the
wrong way, and these assertions would fail."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from loadscale import scaled

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def _fake_backend_source() -> str:
    text = (REPO / "docs" / "architecture.md").read_text()
    m = re.search(r"<!-- fakeq.py -->\n```python\n(.*?)```", text, re.S)
    assert m, "docs/architecture.md lost the fake queue backend's code block"
    return m.group(1)


@pytest.fixture
def fakeq(tmp_path):
    (tmp_path / "fakeq.py").write_text(_fake_backend_source())
    (tmp_path / "hello.py").write_text("import os, sys, time\n"
                                       "print('hello from rank', os.environ['RANK'], flush=True)\n"
                                       "time.sleep(float(sys.argv[1]))\n")
    env = {**os.environ, "DDP_HPC_HOME": str(tmp_path / "home"), "FAKEQ_DIR": str(tmp_path / "queue"),
           "DDP_HPC_BACKENDS": "fakeq:FakeQueue", "PYTHONPATH": str(tmp_path)}

    def run(*args, check=True):
        p = subprocess.run([PY, "-m", *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=scaled(120))
        assert not check or p.returncode == 0, p.stdout + p.stderr
        return p
    return run


def _wait_for(run, job_id: str, state: str) -> dict:
    deadline = time.monotonic() + scaled(60)
    while True:
        st = json.loads(run("ddp_hpc.status", job_id, "--json").stdout)
        if st["state_name"] == state or time.monotonic() > deadline:
            return st
        time.sleep(0.3)


def test_the_documented_fake_scheduler_submits_describes_shows_logs_and_cancels(fakeq, tmp_path):
    p = fakeq("ddp_hpc.submit", "--backend", "fakeq", "-N", "1", "-G", "2", "--log-dir", "runs", "hello.py", "0")
    assert p.stdout.strip() == "fq1" and "backend fakeq: asked for with --backend" in p.stderr
    st = _wait_for(fakeq, "fq1", "COMPLETED")
    assert (st["state_name"], st["source"], st["backend"]) == ("COMPLETED", "fakeq", "fakeq"), st
    detail = fakeq("ddp_hpc.status", "fq1").stdout
    assert "State:      COMPLETED   [source: fakeq]" in detail and "Ranks:      0-1 completed" in detail, detail
    logs = fakeq("ddp_hpc.status", "fq1", "--logs").stdout
    assert "[rank 0 out] hello from rank 0" in logs and "[rank 1 out] hello from rank 1" in logs, logs

    assert fakeq("ddp_hpc.submit", "--backend", "fakeq", "-N", "1", "-G", "1", "--log-dir", "runs",
                 "hello.py", "300").stdout.strip() == "fq2"
    assert _wait_for(fakeq, "fq2", "RUNNING")["source"] == "fakeq"
    pid = int((tmp_path / "queue" / "fq2.pid").read_text())
    out = fakeq("ddp_hpc.submit.cancel", "fq2").stdout
    assert out.strip() == "job fq2: cancelled in the fake queue", out    # the scheduler's own word
    st = _wait_for(fakeq, "fq2", "CANCELLED")
    assert (st["state_name"], st["source"]) == ("CANCELLED", "fakeq"), st
    deadline = time.monotonic() + scaled(30)
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid), "the cancelled job's processes still run"

    table = fakeq("ddp_hpc.status").stdout
    assert re.search(r"fq1\s+hello\s+fakeq\s+COMPLETED", table), table
    assert re.search(r"fq2\s+hello\s+fakeq\s+CANCELLED", table), table


def test_a_backend_named_in_the_environment_that_does_not_load_is_named_with_the_fix(fakeq, tmp_path):
    (tmp_path / "fakeq.py").write_text("raise ImportError('no scheduler client installed')\n")
    p = fakeq("ddp_hpc.submit", "--backend", "fakeq", "-N", "1", "-G", "1", "hello.py", "0", check=False)
    assert p.returncode == 2, p.stderr
    assert ("$DDP_HPC_BACKENDS names backend 'fakeq:FakeQueue', which does not load: ImportError: no scheduler "
            "client installed") in p.stderr and "HINT: fix the module, or take it out of $DDP_HPC_BACKENDS" in p.stderr


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie whose parent has not reaped it yet has ended too
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
