"""What a job sees on the local test cluster: nodes with their own hostnames and addresses,
fake GPUs through GRES, batch jobs whose final state reaches accounting.

Later in this file: ``python -m ddp_hpc.env --json`` and ``setup_ddp`` run for real across nodes.
"""

from __future__ import annotations

import json
import socket

import pytest

pytestmark = pytest.mark.cluster


def test_each_task_runs_on_its_own_node_with_its_own_address(slurm_cluster):
    c = slurm_cluster
    p = c.run(["srun", f"-N{len(c.nodes)}", "--ntasks-per-node=1", "sh", "-c",
               'echo "$SLURM_NODEID $(hostname) $SLURMD_NODENAME $(hostname -I)"'], timeout=60)
    assert p.returncode == 0, p.stderr
    rows = sorted(line.split() for line in p.stdout.splitlines())
    assert [r[0] for r in rows] == [str(i) for i in range(len(c.nodes))]
    assert [r[1] for r in rows] == c.nodes            # hostname inside the task = node name
    assert [r[2] for r in rows] == c.nodes
    if c.layout == "netns":
        addrs = [r[3] for r in rows]
        assert len(set(addrs)) == len(c.nodes)          # one address per node ...
        assert addrs == [socket.gethostbyname(n) for n in c.nodes]  # ... the one its name resolves to


def test_fake_gpus_are_handed_out_by_gres(slurm_cluster):
    c = slurm_cluster
    p = c.run(["srun", "-N2", "--ntasks-per-node=1", "--gpus-per-node=2", "sh", "-c",
               'echo "$(hostname) $CUDA_VISIBLE_DEVICES"'], timeout=60)
    assert p.returncode == 0, p.stderr
    assert sorted(p.stdout.split("\n")[:2]) == ["n1 0,1", "n2 0,1"]
    p = c.run(["srun", "-N1", "-n2", "--gpus-per-task=2", "sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES"'],
              timeout=60)
    assert p.returncode == 0, p.stderr
    assert sorted(p.stdout.split()) == ["0,1", "2,3"]
    p = c.run(["srun", "-N1", f"--gpus-per-node={c.gpus_per_node + 1}", "true"], timeout=60)
    assert p.returncode != 0
    assert "Requested node configuration is not available" in p.stderr


def test_batch_job_states_reach_accounting(slurm_cluster):
    c = slurm_cluster
    ok = c.sbatch("#!/bin/bash\nsrun hostname\n", "-N2", "--ntasks-per-node=1")
    bad = c.sbatch("#!/bin/bash\nexit 3\n", "-N1")
    assert c.wait(ok) == "COMPLETED"
    assert sorted(c.output(ok).split()) == ["n1", "n2"]
    assert c.wait(bad) == "FAILED"
    p = c.run(["sacct", "-c", "-n", "-P", "-o", "JobID,State,ExitCode", "-j", f"{ok},{bad}"])
    assert p.returncode == 0, p.stderr
    assert {tuple(line.split("|")) for line in p.stdout.splitlines()} >= {
        (ok, "COMPLETED", "0:0"), (bad, "FAILED", "3:0")}


def test_accounting_can_be_switched_off_and_on(slurm_cluster):
    c = slurm_cluster
    if c.accounting != "slurmdbd":
        pytest.skip("slurmdbd not installed: the cluster runs with jobcomp only")
    c.stop_slurmdbd()
    try:
        assert c.accounting == "jobcomp"
        p = c.run(["sacct", "-n"])
        assert p.returncode != 0 and "accounting storage is disabled" in (p.stdout + p.stderr)
        jid = c.sbatch("#!/bin/bash\ntrue\n", "-N1")
        assert c.wait(jid) == "COMPLETED"       # from sacct -c
    finally:
        c.start_slurmdbd()
    assert c.accounting == "slurmdbd"
    jid = c.sbatch("#!/bin/bash\ntrue\n", "-N1")
    assert c.wait(jid) == "COMPLETED"
    p = c.run(["sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", jid])
    assert p.stdout.split() == [f"{jid}|COMPLETED"]
