"""README.md's cluster blocks on the real test cluster (markers: tests/readme_blocks.py).

The session's cluster stands in for the blocks' own `testcluster install|up|down` lines (this
session holds the machine's cluster lock, so they would be refused), and their
`export SLURM_CONF=...` points at the session's cluster; every other line runs as written.
"""

from __future__ import annotations

import re
import time

import pytest
from readme_blocks import blocks, fresh_copy, run_block

pytestmark = pytest.mark.cluster


def _as_run_here(body: str, slurm_conf: str) -> str:
    body = re.sub(r"^\S*ddp-hpc testcluster .*$", ": the test session cluster stands in", body, flags=re.M)
    return re.sub(r"^export SLURM_CONF=\S+", f"export SLURM_CONF={slurm_conf}", body, flags=re.M)


def test_as_run_here_keeps_every_other_line():
    body = (".venv/bin/ddp-hpc testcluster up --nodes 4\nexport SLURM_CONF=/x/slurm.conf PATH=$PWD:$PATH\n"
            "srun hostname\n")
    assert _as_run_here(body, "/c/slurm.conf").splitlines() == [
        ": the test session cluster stands in", "export SLURM_CONF=/c/slurm.conf PATH=$PWD:$PATH", "srun hostname"]


def test_readme_cluster_blocks_work(slurm_cluster, tmp_path):
    """Only test that README.md's cluster blocks run as written on a real Slurm."""
    c = slurm_cluster
    work = fresh_copy(c.shared_dir / f"readme-{int(time.time())}")
    env = {**c.env, "DDP_HPC_HOME": str(tmp_path / "home")}
    cluster_blocks = [b for b in blocks() if b.kind == "cluster"]
    assert cluster_blocks
    outputs = []
    for b in cluster_blocks:
        t0 = time.monotonic()
        p = run_block(_as_run_here(b.body, str(c.slurm_conf)), work, env, timeout=600)
        print(f"README.md:{b.line}: exit {p.returncode} in {time.monotonic() - t0:.1f} s")
        assert p.returncode == 0, (f"README.md block at line {b.line} failed:\n{b.body}\n"
                                   f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        outputs.append(p.stdout)
    assert outputs[0].count("OK rank") == 4, outputs[0]           # env --check: one line per task
    assert "replicas equal" in outputs[0], outputs[0]               # the torchrun-style script under srun
    assert "COMPLETED" in outputs[-1], outputs[-1]                  # status after submit --wait
