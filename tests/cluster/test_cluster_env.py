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
from ddp_hpc.testcluster import ClusterError, ClusterSpec, network
from ddp_hpc.testcluster.spec import first_job_id, render_gres_conf, render_slurm_conf
from ddp_hpc.testcluster.state import load_state

ALLREDUCE_JOB = Path(__file__).with_name("_allreduce_job.py")


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


# ---------------------------------------------------------------------------- harness, no cluster needed
def test_hosts_block_is_added_and_removed_leaving_the_file_as_found(tmp_path, monkeypatch):
    hosts = tmp_path / "hosts"
    original = "127.0.0.1 localhost\n# a comment\n10.1.2.3 other\n"
    hosts.write_text(original)
    monkeypatch.setattr(network, "HOSTS_FILE", hosts)
    spec = ClusterSpec(nodes=2, state_dir=tmp_path / "state")
    network.add_hosts_block(spec)
    network.add_hosts_block(spec)                       # idempotent: one block
    text = hosts.read_text()
    assert text.startswith(original) and text.count("10.77.0.11 n1") == 1
    assert "10.77.0.1 ddpctl" in text and "10.77.0.12 n2" in text
    with open(hosts, "a") as f:                        # someone else edits meanwhile
        f.write("10.9.9.9 later\n")
    assert network.remove_hosts_block(spec)
    assert hosts.read_text() == original + "10.9.9.9 later\n"
    assert not network.remove_hosts_block(spec)


def test_names_already_in_hosts_are_refused(tmp_path, monkeypatch):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n10.0.0.5 n2 n2.example\n")
    monkeypatch.setattr(network, "HOSTS_FILE", hosts)
    with pytest.raises(ClusterError, match=r"\['n2'\] already in /etc/hosts.*\nHINT: .*--node-prefix"):
        network.check_names_free(ClusterSpec(nodes=2, state_dir=tmp_path))


@pytest.mark.parametrize("kwargs, message", [
    ({"nodes": 0}, "--nodes 0 is out of range"),
    ({"layout": "bridge"}, "--layout 'bridge' is unknown"),
    ({"subnet": "8.8.8.0/24"}, "not a private IPv4 /24"),
    ({"subnet": "10.0.0.0/16"}, "not a private IPv4 /24"),
    ({"state_dir": "/tmp/a b"}, "contains a space"),
])
def test_bad_spec_names_the_value_and_the_fix(kwargs, message):
    with pytest.raises(ClusterError, match="HINT:") as err:
        ClusterSpec(**kwargs)
    assert message in str(err.value)


def test_rendered_config_has_fast_requeue_fake_gpus_and_per_node_ports(tmp_path):
    net = ClusterSpec(nodes=3, gpus_per_node=2, slurmdbd=True, state_dir=tmp_path)
    conf = render_slurm_conf(net)
    for line in ("SchedulerParameters=sched_interval=2,bf_interval=2", "JobRequeue=1", "KillWait=10",
                 "JobCompType=jobcomp/filetxt", "AccountingStorageType=accounting_storage/slurmdbd",
                 "NodeName=n3 NodeAddr=10.77.0.13 NodeHostname=n3 Port=16818"):
        assert line in conf
    assert f"AuthInfo=socket={tmp_path}/munge/munged.sock,cred_expire=10" in conf
    assert "AccountingStorageType" not in render_slurm_conf(net, accounting=False)
    assert f"NodeName=n[1-3] Name=gpu File={tmp_path}/dev/nvidia[0-1]" in render_gres_conf(net)
    assert "FirstJobId" not in conf and "FirstJobId=4242\n" in render_slurm_conf(net, first_job=4242)
    assert first_job_id(1_800_000_000) != first_job_id(1_800_000_001) <= 60_000_000
    loop = render_slurm_conf(ClusterSpec(nodes=2, layout="loopback", state_dir=tmp_path))
    assert "NodeName=n2 NodeAddr=127.0.0.1 NodeHostname=localhost Port=16902" in loop
    assert "Gres=gpu:4" in loop


def test_spare_nodes_get_a_partition_of_their_own(tmp_path):
    spec = ClusterSpec(nodes=4, spare_nodes=3, state_dir=tmp_path)
    assert spec.node_names == [f"n{i}" for i in range(1, 8)]
    assert (spec.partition_nodes, spec.spare_node_names) == (["n1", "n2", "n3", "n4"], ["n5", "n6", "n7"])
    conf = render_slurm_conf(spec)
    assert "PartitionName=debug Nodes=n[1-4] Default=YES" in conf
    assert "PartitionName=spare Nodes=n[5-7] MaxTime" in conf and "Nodes=ALL" not in conf
    assert "NodeName=n7 NodeAddr=10.77.0.17 NodeHostname=n7" in conf
    assert f"NodeName=n[1-7] Name=gpu File={tmp_path}/dev/nvidia[0-3]" in render_gres_conf(spec)
    assert "PartitionName=debug Nodes=ALL Default=YES" in render_slurm_conf(ClusterSpec(state_dir=tmp_path))
    with pytest.raises(ClusterError, match="spare nodes is out of range"):
        ClusterSpec(nodes=60, spare_nodes=5)
    two = ClusterSpec(nodes=4, spare_nodes=3, spare_partitions=2, state_dir=tmp_path)
    assert two.spare_sets == {"spare": ["n5", "n6", "n7"], "spare2": ["n8", "n9", "n10"]}
    assert two.spare_node_names == ["n5", "n6", "n7"] and two.nodelist == "n[1-10]"
    conf = render_slurm_conf(two)
    assert "PartitionName=spare Nodes=n[5-7] " in conf and "PartitionName=spare2 Nodes=n[8-10] " in conf
    assert ClusterSpec.from_json(two.to_json()) == two
    with pytest.raises(ClusterError, match="spare nodes is out of range"):
        ClusterSpec(nodes=60, spare_nodes=3, spare_partitions=2)


# ---------------------------------------------------------------------------- the cluster itself
@pytest.mark.cluster
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


@pytest.mark.cluster
def test_a_node_resolves_names_from_hosts_and_asks_no_unreachable_dns(slurm_cluster):
    """In the netns layout a node's DNS server is unreachable: the node's resolver points at its
    own loopback, so a reverse lookup /etc/hosts cannot answer (torch's TCPStore does one per
    connection) fails at once instead of waiting out the timeouts; names still resolve."""
    c = slurm_cluster
    if c.layout != "netns":
        pytest.skip(f"the {c.layout} layout shares the machine's resolver")
    p = c.run(["srun", "-N1", "-w", c.nodes[1], "sh", "-c",
               f"cat /etc/resolv.conf; getent hosts {c.nodes[0]}"], timeout=60)
    assert p.returncode == 0, p.stderr
    assert "nameserver 127.0.0.1" in p.stdout.splitlines()
    assert p.stdout.split()[-1] == c.nodes[0] and socket.gethostbyname(c.nodes[0]) in p.stdout


# GPU indexes are asserted: under xdist other jobs would hold the debug nodes' first GPUs, so this
# runs on the spare partition's nodes, on one worker with the node-failure test that uses them too.
@pytest.mark.xdist_group("spare")
@pytest.mark.cluster
def test_fake_gpus_are_handed_out_by_gres(slurm_cluster):
    c = slurm_cluster
    p = c.run(["srun", "-p", c.spare_partition, "-N2", "--ntasks-per-node=1", "--gpus-per-node=2", "sh", "-c",
               'echo "$(hostname) $CUDA_VISIBLE_DEVICES"'], timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = sorted(p.stdout.splitlines())
    assert len(rows) == 2 and [r.split()[1] for r in rows] == ["0,1", "0,1"], p.stdout + p.stderr
    assert len({r.split()[0] for r in rows}) == 2
    p = c.run(["srun", "-p", c.spare_partition, "-N1", "-n2", "--gpus-per-task=2", "sh", "-c",
               'echo "$CUDA_VISIBLE_DEVICES"'], timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(p.stdout.split()) == ["0,1", "2,3"], p.stdout + p.stderr
    p = c.run(["srun", "-p", c.spare_partition, "-N1", f"--gpus-per-node={c.gpus_per_node + 1}", "true"],
              timeout=60)
    assert p.returncode != 0
    assert "Requested node configuration is not available" in p.stderr, p.stderr


@pytest.mark.cluster
def test_batch_job_states_reach_accounting(slurm_cluster):
    c = slurm_cluster
    ok = c.sbatch("#!/bin/bash\nsrun hostname\n", "-N2", "--ntasks-per-node=1", "-w", "n1,n2")
    bad = c.sbatch("#!/bin/bash\nexit 3\n", "-N1")
    assert c.wait(ok) == "COMPLETED"
    # job ids go on from the clock's FirstJobId: a job never takes an earlier cluster's id
    assert int(ok) >= load_state(c.state_dir)["first_job_id"] > 1
    assert sorted(c.output(ok).split()) == ["n1", "n2"]
    assert c.wait(bad) == "FAILED"
    p = c.run(["sacct", "-c", "-n", "-P", "-o", "JobID,State,ExitCode", "-j", f"{ok},{bad}"])
    assert p.returncode == 0, p.stderr
    assert {tuple(line.split("|")) for line in p.stdout.splitlines()} >= {
        (ok, "COMPLETED", "0:0"), (bad, "FAILED", "3:0")}


# Switches accounting off (slurmctld restarts): under xdist the cluster is this test's alone, and it
# runs with the other exclusive tests, after test_status_cluster.py's (tests/conftest.py: _gate).
@pytest.mark.cluster_exclusive
@pytest.mark.xdist_group("exclusive")
@pytest.mark.cluster
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
@pytest.mark.cluster
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


@pytest.mark.cluster
def test_gloo_all_reduce_two_nodes_by_two_tasks(slurm_cluster):
    rows = _run_allreduce(slurm_cluster, 2, 2)
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    assert all(r["backend"] == "gloo" and r["device"] == "cpu" for r in rows)
    assert all(r["world_sum"] == 1 + 2 + 3 + 4 for r in rows)
    # node groups are built from the real layout: ranks 0,1 on one node, 2,3 on the other
    assert [r["node_sum"] for r in rows] == [1 + 2, 1 + 2, 3 + 4, 3 + 4]
    assert rows[0]["host"] == rows[1]["host"] != rows[2]["host"] == rows[3]["host"]


@pytest.mark.cluster
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
    p = c.run(["srun", "-p", c.spare_partition, "-N2", "--ntasks-per-node=2", *gpu_args, "python", "-c",
               DEVICE_PROBE], timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = sorted(json_lines(p.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    return rows


# GPU indexes are asserted: under xdist other jobs would hold the debug nodes' first GPUs, so this
# runs on the spare partition's nodes, on one worker with the node-failure test that uses them too.
@pytest.mark.xdist_group("spare")
@pytest.mark.cluster
def test_gpus_per_node_binds_local_rank(slurm_cluster):
    rows = _probe_devices(slurm_cluster, "--gpus-per-node=2")
    for r in rows:
        assert r["cvd"] == "0,1"                     # both tasks of a node see the node's two GPUs
        assert r["index"] == r["local_rank"]         # ... and each takes its own: cuda:local_rank


# GPU indexes are asserted: under xdist other jobs would hold the debug nodes' first GPUs, so this
# runs on the spare partition's nodes, on one worker with the node-failure test that uses them too.
@pytest.mark.xdist_group("spare")
@pytest.mark.cluster
def test_gpus_per_task_binds_its_only_device(slurm_cluster):
    rows = _probe_devices(slurm_cluster, "--gpus-per-task=1")
    for node in {r["host"] for r in rows}:
        seen = sorted(r["cvd"] for r in rows if r["host"] == node)
        assert seen == ["0", "1"]                    # one distinct device per task on each node
    assert all(r["index"] == 0 for r in rows)        # the only visible device is cuda:0


# Drains a node of the default partition: alone on the cluster, with the other exclusive tests.
@pytest.mark.cluster_exclusive
@pytest.mark.xdist_group("exclusive")
@pytest.mark.cluster
def test_the_cluster_brings_back_a_node_a_test_left_drained_or_without_its_slurmd(slurm_cluster):
    """What CI met (issue 39): a step that outlived SIGKILL left n2 drained "Kill task failed",
    and every later test that needed it waited until its own timeout. `heal` (called around every
    cluster test by tests/conftest.py) names such a node and brings it back, its slurmd too; a
    test's own deliberate drain (reason "ddp_hpc ...") and nodes outside ``nodes`` are left alone."""
    import os
    import signal
    import time

    from ddp_hpc.testcluster.heal import heal, sick_nodes

    c = slurm_cluster
    spec = ClusterSpec.from_json(load_state(c.state_dir)["spec"])
    sick, mine, other = c.nodes[-1], c.nodes[-2], c.spare_sets["spare"][0] if c.spare_sets else None
    try:
        for node, why in ((sick, "Kill task failed"), (mine, "ddp_hpc deliberate")):
            p = c.run(["scontrol", "update", f"nodename={node}", "state=drain", f"reason={why}"])
            assert p.returncode == 0, p.stderr
        pid = int((c.state_dir / "run" / f"slurmd-{sick}.pid").read_text())
        os.kill(pid, signal.SIGKILL)                         # and its slurmd dies
        time.sleep(0.5)
        found = heal(c.state_dir, nodes=[sick, mine])
        assert list(found) == [sick] and "Kill task failed" in found[sick], found
        assert sick not in sick_nodes(spec)
        state = c.run(["sinfo", "-h", "-N", "-n", sick, "-o", "%T"]).stdout.strip()
        assert state in ("idle", "mixed", "allocated"), state
        assert int((c.state_dir / "run" / f"slurmd-{sick}.pid").read_text()) != pid   # a new slurmd
        assert c.run(["sinfo", "-h", "-N", "-n", mine, "-o", "%T"]).stdout.strip().startswith("drain")
        if other:   # outside ``nodes``: left as it is
            c.run(["scontrol", "update", f"nodename={other}", "state=drain", "reason=Kill task failed"])
            assert heal(c.state_dir, nodes=[sick]) == {}
            assert other in sick_nodes(spec)
    finally:
        for node in filter(None, (mine, other)):
            c.run(["scontrol", "update", f"nodename={node}", "state=resume"])
    jid = c.sbatch("#!/bin/bash\ntrue\n", "-N1", "-w", sick)     # it takes work again
    assert c.wait(jid) == "COMPLETED"
