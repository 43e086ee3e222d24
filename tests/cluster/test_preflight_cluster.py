"""The preflight errors of ``ddp_hpc.env``, reproduced on a real Slurm.

Each case is a real mistake that makes DDP hang forever on a cluster; here the job must end on
its own (no hang: ``wait`` would time out) with a non-zero exit and the HINT in its output.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.cluster

SETUP_DDP = ("from datetime import timedelta; from ddp_hpc.dist import setup_ddp; "
             "setup_ddp(timeout=timedelta(seconds=120)); print('JOINED')")


def test_batch_script_without_srun_fails_with_hint(slurm_cluster):
    c = slurm_cluster
    script = ("#!/bin/bash\n"
              "python -m ddp_hpc.env --check\n"
              "echo \"check exit=$?\"\n"
              f"python -c \"{SETUP_DDP}\"\n")   # the real hang: 1 process waiting for 3 peers
    jid = c.sbatch(script, "-N2", "--ntasks-per-node=2", "--time=3")
    assert c.wait(jid, timeout=240) == "FAILED"
    out = c.output(jid)
    assert "check exit=1" in out
    assert out.count("SLURM_NTASKS=4") == 2, out          # --check and setup_ddp both refuse
    assert out.count("HINT: Start the training with `srun python ...`") == 2, out
    assert "JOINED" not in out


def test_uneven_ntasks_over_two_nodes_fails_with_hint(slurm_cluster):
    c = slurm_cluster
    p = c.run(["srun", "-N2", "-n3", "--time=3", "python", "-m", "ddp_hpc.env", "--check"], timeout=240)
    assert p.returncode != 0
    err = p.stderr
    assert "Uneven tasks per node" in err and "HINT: Request --nodes=2 --ntasks-per-node" in err, err
    # every one of the three tasks reports it, naming its node and task
    assert sorted(t for t in ("task 0]", "task 1]", "task 2]") if t in err) == ["task 0]", "task 1]", "task 2]"]


def test_uneven_ntasks_setup_ddp_does_not_hang(slurm_cluster):
    c = slurm_cluster
    p = c.run(["srun", "-N2", "-n3", "--time=3", "--kill-on-bad-exit=1", "python", "-c", SETUP_DDP],
              timeout=240)
    assert p.returncode != 0
    assert "JOINED" not in p.stdout
    assert "EnvError" in p.stderr and "HINT: Request --nodes=2 --ntasks-per-node" in p.stderr, p.stderr


# Asserts GPU indexes 0,1: on the spare partition, with the other such tests (test_cluster_env.py).
@pytest.mark.xdist_group("spare")
def test_more_tasks_than_gpus_on_a_node_fails_with_hint(slurm_cluster):
    """Only test of the preflight refusal of more tasks than GPUs on a node, with its hint."""
    c = slurm_cluster
    p = c.run(["srun", "-p", c.spare_partition, "-N1", "--ntasks-per-node=4", "--gpus-per-node=2", "--time=3",
               "python", "-m", "ddp_hpc.env", "--check"], timeout=240)
    assert p.returncode != 0
    assert "CUDA_VISIBLE_DEVICES=0,1" in p.stderr and "has no GPU to bind" in p.stderr, p.stderr
    assert "HINT: Use one task per GPU: --ntasks-per-node=2 with --gpus-per-node=2" in p.stderr


def test_slurm_variables_inherited_from_an_earlier_step_are_refused(slurm_cluster):
    c = slurm_cluster
    # A step's variables saved and replayed outside that step (as a wrapper script or a nested
    # launcher would): its SLURM_TASK_PID is not an ancestor of the new process.
    script = ("#!/bin/bash\n"
              "srun -n1 -N1 bash -c 'export -p' > step.env.$SLURM_JOB_ID\n"
              "(source step.env.$SLURM_JOB_ID && exec python -m ddp_hpc.env --check)\n")
    jid = c.sbatch(script, "-N1", "--ntasks-per-node=1", "--time=3")
    assert c.wait(jid, timeout=240) == "FAILED"
    out = c.output(jid)
    assert "were inherited from an enclosing job or step" in out and "HINT: Launch with srun" in out, out
