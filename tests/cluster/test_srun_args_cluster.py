"""``--srun-arg`` and ``--container`` on the real test cluster (Slurm 22.05, task/none): the options
reach srun in the rendered script and take effect in every task (``--label`` prefixes each line with
the task id, ``--export=ALL,NAME=VALUE`` adds a variable, ``--cpu-bind=none`` is accepted), and with
``--container`` every rank runs through the container runtime: a stand-in ``apptainer`` on PATH that
logs its argv and runs what follows the image (apptainer is not among Debian's packages)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from ddp_hpc import records

pytestmark = pytest.mark.cluster

PY = sys.executable
PROBE = ("import os\n"
         "print('PROBE', os.environ['RANK'], os.environ.get('DDP_HPC_SRUN_PROBE', '<unset>'), flush=True)\n")
RUNTIME = ('#!/bin/bash\n'
           'printf "%s\\n" "$0" "$@" > "$FAKE_RUNTIME_OUT.$SLURM_PROCID"\n'
           'shift 3\n'
           'exec "$@"\n')


def test_srun_args_and_container_reach_every_task(slurm_cluster):
    c = slurm_cluster
    d = c.shared_dir / f"srun-args-{time.monotonic_ns()}"
    bindir = d / "bin"
    bindir.mkdir(parents=True)
    (bindir / "apptainer").write_text(RUNTIME)
    (bindir / "apptainer").chmod(0o755)
    (d / "probe.py").write_text(PROBE)
    env = {**c.env, "DDP_HPC_HOME": str(d / "home"), "PATH": f"{bindir}:{c.env['PATH']}",
           "FAKE_RUNTIME_OUT": str(d / "runtime.argv")}
    p = c.run([PY, "-m", "ddp_hpc.submit", "--backend", "sbatch", "-N", "2", "-G", "1", "-t", "5",
               "--max-restarts", "0",   # the srun line itself; the supervisor's: tests/test_supervise.py
               "--srun-arg", "label=", "--srun-arg", "export=ALL,DDP_HPC_SRUN_PROBE=through-srun",
               "--srun-arg", "cpu-bind=none", "--container", "/images/stand-in.sif",
               "--wait", "--wait-timeout", "180", "probe.py"], cwd=str(d), env=env, timeout=240)
    (rec,) = records.list_records({"DDP_HPC_HOME": str(d / "home")})
    log_dir = Path(rec.log_dir)
    script = (log_dir / "job.sbatch").read_text()
    assert ("exec srun --kill-on-bad-exit=1 --open-mode=append --output=\"$LOG_DIR/rank%t.out\" "
            "--cpu-bind=none --export=ALL,DDP_HPC_SRUN_PROBE=through-srun --label \"${ARGS[@]}\"") in script
    outs = {r: (log_dir / f"rank{r}.out").read_text() for r in range(2)}
    assert p.returncode == 0, (p.stdout, p.stderr, outs)
    for r in range(2):
        assert f"{r}: PROBE {r} through-srun" in outs[r].splitlines(), outs[r]      # --label, --export
        argv = (d / f"runtime.argv.{r}").read_text().splitlines()
        assert argv[:4] == [str(bindir / "apptainer"), "exec", "--nv", "/images/stand-in.sif"], argv
        assert argv[4:7] == [PY, "-m", "ddp_hpc.exec"], argv
