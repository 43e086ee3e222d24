"""What a job sees on the local test cluster: nodes with their own hostnames and addresses,
fake GPUs through GRES, batch jobs whose final state reaches accounting.

Later in this file: ``python -m ddp_hpc.env --json`` and ``setup_ddp`` run for real across nodes.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from ddp_hpc.env import derive_port

pytestmark = pytest.mark.cluster

ALLREDUCE_JOB = Path(__file__).with_name("_allreduce_job.py")


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


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


# ---------------------------------------------------------------------------- ddp_hpc.env for real
def test_env_json_on_two_nodes_by_two_tasks(slurm_cluster):
    c = slurm_cluster
    p = c.run(["srun", "-N2", "--ntasks-per-node=2", "python", "-m", "ddp_hpc.env", "--json"], timeout=180)
    assert p.returncode == 0, p.stderr
    rows = sorted(json_lines(p.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    hosts = rows[0]["hostnames"]
    assert len(hosts) == 2 and set(hosts) <= set(c.nodes)
    for r in rows:
        assert (r["world_size"], r["local_world_size"], r["num_nodes"]) == (4, 2, 2)
        assert r["launcher"] == "slurm"
        assert r["hostnames"] == hosts
        assert r["hostname"] == hosts[r["node_rank"]]      # each task runs on its own node
    # block distribution: ranks 0,1 on the first node, 2,3 on the second
    assert [(r["node_rank"], r["local_rank"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # one master address and port, agreed by all four, derived from the job id
    assert {(r["master_addr"], r["master_port"], r["job_id"]) for r in rows} == {
        (hosts[0], derive_port(rows[0]["job_id"]), rows[0]["job_id"])}


# ---------------------------------------------------------------------------- setup_ddp across nodes
def _run_allreduce(c, nodes: int, per_node: int) -> list[dict]:
    p = c.run(["srun", f"-N{nodes}", f"--ntasks-per-node={per_node}", "--kill-on-bad-exit=1",
               "--time=5", "python", str(ALLREDUCE_JOB)], timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return sorted(json_lines(p.stdout), key=lambda r: r["rank"])


def test_gloo_all_reduce_two_nodes_by_two_tasks(slurm_cluster):
    rows = _run_allreduce(slurm_cluster, 2, 2)
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    assert all(r["backend"] == "gloo" and r["device"] == "cpu" for r in rows)
    assert all(r["world_sum"] == 1 + 2 + 3 + 4 for r in rows)
    # node groups are built from the real layout: ranks 0,1 on one node, 2,3 on the other
    assert [r["node_sum"] for r in rows] == [1 + 2, 1 + 2, 3 + 4, 3 + 4]
    assert rows[0]["host"] == rows[1]["host"] != rows[2]["host"] == rows[3]["host"]


def test_gloo_all_reduce_on_four_nodes(slurm_cluster):
    c = slurm_cluster
    rows = _run_allreduce(c, 4, 1)
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    assert sorted(r["host"] for r in rows) == c.nodes
    assert all(r["world_sum"] == 10 for r in rows)
    assert [r["node_sum"] for r in rows] == [1, 2, 3, 4]


# ---------------------------------------------------------------------------- device choice (fake GPUs)
DEVICE_PROBE = (
    "import json, os, socket\n"
    "from ddp_hpc.env import detect\n"
    "from ddp_hpc.dist import device_index\n"
    "e = detect()\n"
    "print(json.dumps({'rank': e.rank, 'local_rank': e.local_rank, 'host': socket.gethostname(),\n"
    "                  'cvd': os.environ.get('CUDA_VISIBLE_DEVICES'), 'index': device_index(e, os.environ)}))\n"
)


def _probe_devices(c, *gpu_args: str) -> list[dict]:
    p = c.run(["srun", "-N2", "--ntasks-per-node=2", *gpu_args, "python", "-c", DEVICE_PROBE], timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = sorted(json_lines(p.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    return rows


def test_gpus_per_node_binds_local_rank(slurm_cluster):
    rows = _probe_devices(slurm_cluster, "--gpus-per-node=2")
    for r in rows:
        assert r["cvd"] == "0,1"                     # both tasks of a node see the node's two GPUs
        assert r["index"] == r["local_rank"]         # ... and each takes its own: cuda:local_rank


def test_gpus_per_task_binds_its_only_device(slurm_cluster):
    rows = _probe_devices(slurm_cluster, "--gpus-per-task=1")
    for node in {r["host"] for r in rows}:
        seen = sorted(r["cvd"] for r in rows if r["host"] == node)
        assert seen == ["0", "1"]                    # one distinct device per task on each node
    assert all(r["index"] == 0 for r in rows)        # the only visible device is cuda:0
