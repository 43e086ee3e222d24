"""DistEnv derivation: tables of environments as real launchers set them, every field asserted.

The variable sets below were read off real processes: srun steps on the test cluster (Slurm 22.05),
torchrun 2.x, submitit 1.5 (Slurm and local executors) and ddp_hpc's own local launcher.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys

import pytest

from ddp_hpc import env as envmod
from ddp_hpc.env import PORT_BASE, PORT_SPAN, DistEnv, EnvError, derive_port, detect, free_port, preflight, user_port
from ddp_hpc.env.ports import FREE_BASE, FREE_SPAN

HOST = socket.gethostname()


def srun_task(procid, localid, nodeid, *, nodes="n[1-2]", tpn="2(x2)", ntasks=4, job="4242", extra=None):
    """The rank variables an `srun` task sees (Slurm 22.05), trimmed to what matters."""
    e = {
        "SLURM_JOB_ID": job, "SLURM_JOBID": job, "SLURM_JOB_NODELIST": nodes, "SLURM_NODELIST": nodes,
        "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": tpn,
        "SLURM_NTASKS": str(ntasks), "SLURM_NPROCS": str(ntasks),
        "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_STEP_NODELIST": nodes, "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_STEP_TASKS_PER_NODE": tpn,
        "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid),
        "SLURMD_NODENAME": f"n{nodeid + 1}", "SLURM_TASK_PID": "1", "SLURM_CPUS_ON_NODE": "2",
    }
    e.update(extra or {})
    return e


def torchrun_task(rank, local_rank, *, world=4, local_world=2, group_rank=None, port="29500"):
    return {
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(local_world),
        "GROUP_RANK": str(rank // local_world if group_rank is None else group_rank),
        "GROUP_WORLD_SIZE": str(world // local_world), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
    }


def ancestors_ok():
    return [1]


FIELDS = ("rank", "local_rank", "world_size", "local_world_size", "node_rank", "num_nodes",
          "master_addr", "master_port", "hostnames", "job_id", "restart_count", "launcher")

#: derive_port("4242"): 20000 + crc32(b"4242") % 10000 = 20000 + 169812835 % 10000
PORT_4242 = 22835

CASES = {
    # srun -N2 --ntasks-per-node=2: ranks laid out node by node.
    "srun 2x2 rank0": (srun_task(0, 0, 0), (0, 0, 4, 2, 0, 2, "n1", PORT_4242, ("n1", "n2"), "4242", 0, "slurm")),
    "srun 2x2 rank1": (srun_task(1, 1, 0), (1, 1, 4, 2, 0, 2, "n1", PORT_4242, ("n1", "n2"), "4242", 0, "slurm")),
    "srun 2x2 rank3": (srun_task(3, 1, 1), (3, 1, 4, 2, 1, 2, "n1", PORT_4242, ("n1", "n2"), "4242", 0, "slurm")),
    # --gpus-per-task=1: each task sees one device; ranks as usual.
    "srun gpus-per-task rank2": (
        srun_task(2, 0, 1, extra={"SLURM_GPUS_PER_TASK": "1", "SLURM_GPUS_ON_NODE": "2", "CUDA_VISIBLE_DEVICES": "0"}),
        (2, 0, 4, 2, 1, 2, "n1", PORT_4242, ("n1", "n2"), "4242", 0, "slurm")),
    # --gpus-per-node=2 with 2 tasks per node: both GPUs visible to each task.
    "srun gpus-per-node rank1": (
        srun_task(1, 1, 0, extra={"SLURM_GPUS_PER_NODE": "2", "SLURM_GPUS_ON_NODE": "2",
                                  "CUDA_VISIBLE_DEVICES": "0,1"}),
        (1, 1, 4, 2, 0, 2, "n1", PORT_4242, ("n1", "n2"), "4242", 0, "slurm")),
    # uneven 3,1 (allowed explicitly): local world size differs per node.
    "srun uneven 3,1 rank3": (
        srun_task(3, 0, 1, tpn="3,1", extra={"DDP_HPC_ALLOW_UNEVEN": "1"}),
        (3, 0, 4, 1, 1, 2, "n1", PORT_4242, ("n1", "n2"), "4242", 0, "slurm")),
    "srun uneven 3,1 rank2": (
        srun_task(2, 2, 0, tpn="3,1", extra={"DDP_HPC_ALLOW_UNEVEN": "1"}),
        (2, 2, 4, 3, 0, 2, "n1", PORT_4242, ("n1", "n2"), "4242", 0, "slurm")),
    # zero-padded node names, requeued once, inside a job array.
    "srun array requeued": (
        srun_task(1, 1, 0, nodes="gpu[009-010]", job="5001",
                  extra={"SLURM_ARRAY_JOB_ID": "5000", "SLURM_ARRAY_TASK_ID": "3", "SLURM_RESTART_COUNT": "1",
                         "SLURMD_NODENAME": "gpu009"}),
        (1, 1, 4, 2, 0, 2, "gpu009", 20482, ("gpu009", "gpu010"), "5000_3", 1, "slurm")),  # port of "5000_3.run1"
    # user-set MASTER_ADDR / MASTER_PORT win.
    "srun user master": (
        srun_task(0, 0, 0, extra={"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "31337"}),
        (0, 0, 4, 2, 0, 2, "10.0.0.5", 31337, ("n1", "n2"), "4242", 0, "slurm")),
    # torchrun --standalone --nproc-per-node=4
    "torchrun standalone": (
        torchrun_task(3, 3, world=4, local_world=4),
        (3, 3, 4, 4, 0, 1, "127.0.0.1", 29500, (HOST,), None, 0, "torchrun")),
    # torchrun inside an srun step (one task per node): torchrun's ranks win over Slurm's.
    "torchrun inside srun": (
        {**srun_task(1, 0, 1, tpn="1(x2)", ntasks=2), **torchrun_task(3, 1, world=4, local_world=2, port="29400")},
        (3, 1, 4, 2, 1, 2, "127.0.0.1", 29400, ("n1", "n2"), "4242", 0, "torchrun")),
    # submitit's Slurm executor: srun tasks plus SUBMITIT_* variables.
    "submitit slurm": (
        {**srun_task(2, 0, 1), "SUBMITIT_EXECUTOR": "slurm", "SUBMITIT_FOLDER": "/tmp/x"},
        (2, 0, 4, 2, 1, 2, "n1", PORT_4242, ("n1", "n2"), "4242", 0, "submitit")),
    # submitit's local executor.
    "submitit local": (
        {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_JOB_ID": "777", "SUBMITIT_LOCAL_NTASKS": "2",
         "SUBMITIT_LOCAL_JOB_NUM_NODES": "1", "SUBMITIT_LOCAL_NODEID": "0", "SUBMITIT_LOCAL_GLOBALID": "1",
         "SUBMITIT_LOCAL_LOCALID": "1"},
        (1, 1, 2, 2, 0, 1, "127.0.0.1", 21756, (HOST,), "777", 0, "submitit")),
    # ddp_hpc's local launcher: 2 pretend nodes x 2.
    "local launcher": (
        {**torchrun_task(2, 0, world=4, local_world=2), "DDP_HPC_LAUNCHER": "local", "DDP_HPC_NUM_NODES": "2",
         "DDP_HPC_JOB_ID": "local-1"},
        (2, 0, 4, 2, 1, 2, "127.0.0.1", 29500, (HOST, HOST), "local-1", 0, "local")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_detect_table(name):
    environ, expected = CASES[name]
    env = envmod.detect(environ, ancestors=ancestors_ok)
    assert tuple(getattr(env, f) for f in FIELDS) == expected
    slurm_step = "SLURM_STEP_ID" in environ or (env.launcher == "submitit" and "SLURM_JOB_ID" in environ)
    assert env.in_slurm == (slurm_step and env.launcher != "local"), name


def test_single_process_gets_a_free_port():
    env = detect({})
    assert (env.rank, env.world_size, env.local_world_size, env.num_nodes, env.launcher) == (0, 1, 1, 1, "single")
    assert env.master_addr == "127.0.0.1" and env.job_id is None and env.restart_count == 0
    with socket.socket() as s:  # the port was free when chosen: binding it works
        s.bind(("127.0.0.1", env.master_port))


def test_a_free_port_is_outside_the_ephemeral_range():
    """Chosen now, bound by rank 0 seconds later: an ephemeral port could go to any outgoing
    connection meanwhile (EADDRINUSE in a loaded test run), so free ports come from below it."""
    low, high = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    ports = [free_port() for _ in range(20)]
    assert all(FREE_BASE <= p < FREE_BASE + FREE_SPAN and not low <= p <= high for p in ports), ports
    for p in ports:     # each free when chosen
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


@pytest.mark.parametrize("key, port", [("4242", 22835), ("5000_3", 24407), ("777", 21756), ("1234_1", 20543),
                                       ("1234_2", 26261), ("local-1", 23114)])
def test_derived_port_of_a_job_key(key, port):
    assert derive_port(key) == port


def test_user_port_wins_and_is_checked():
    assert user_port({}) is None and user_port({"MASTER_PORT": ""}) is None
    assert user_port({"MASTER_PORT": "31337", "DDP_HPC_MASTER_PORT": "25000"}) == 31337
    assert user_port({"DDP_HPC_MASTER_PORT": "25000"}) == 25000
    with pytest.raises(EnvError, match=r"DDP_HPC_MASTER_PORT=0 is not a TCP port"):
        user_port({"DDP_HPC_MASTER_PORT": "0"})


def test_port_is_a_pure_function_of_the_job_and_in_range():
    ports = {derive_port(str(j)) for j in range(1000, 1200)}
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)
    assert len(ports) > 190  # concurrent jobs sharing a node get different ports
    assert derive_port("1234_1") != derive_port("1234_2")  # array tasks differ
    ranks = [envmod.detect(srun_task(r, r % 2, r // 2), ancestors=ancestors_ok).master_port for r in range(4)]
    assert len(set(ranks)) == 1  # every rank agrees
    override = envmod.detect(srun_task(0, 0, 0, extra={"DDP_HPC_MASTER_PORT": "25000"}), ancestors=ancestors_ok)
    assert override.master_port == 25000


def test_each_run_of_a_job_gets_a_port_of_its_own():
    """A restart's ranks (in-allocation restarts: DDP_HPC_ALLOC_RESTARTS; requeues:
    SLURM_RESTART_COUNT) may start while the old step's rank 0 still holds the last run's port."""
    def port(run_vars, rank=0):
        return envmod.detect(srun_task(rank, rank % 2, rank // 2, extra=run_vars), ancestors=ancestors_ok).master_port
    ports = [port({}), port({"DDP_HPC_ALLOC_RESTARTS": "1"}), port({"DDP_HPC_ALLOC_RESTARTS": "2"}),
             port({"SLURM_RESTART_COUNT": "1"})]
    assert ports[0] == derive_port("4242") and ports[1] == ports[3] == derive_port("4242.run1")
    assert len(set(ports[:3])) == 3
    assert {port({"DDP_HPC_ALLOC_RESTARTS": "2"}, r) for r in range(4)} == {ports[2]}   # every rank agrees


def test_export_sets_and_never_replaces():
    env = envmod.detect(srun_task(3, 1, 1), ancestors=ancestors_ok)
    target = {"RANK": "3"}
    newly = env.export(target)
    assert target.pop("DDP_HPC_EXPORTED").endswith(":slurm")
    assert target == {"MASTER_ADDR": "n1", "MASTER_PORT": str(PORT_4242), "RANK": "3", "WORLD_SIZE": "4",
                      "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert "RANK" not in newly
    with pytest.raises(EnvError, match=r"RANK='0' \(derived: '3'\)"):
        env.export({"RANK": "0"})


# --------------------------------------------------------------------------- preflight errors


def only_error(environ, ancestors=ancestors_ok):
    problems = preflight(environ, ancestors=ancestors)
    assert len(problems) == 1, problems
    with pytest.raises(EnvError):
        envmod.detect(environ, ancestors=ancestors)
    return str(problems[0])


def test_batch_script_without_srun():
    e = srun_task(0, 0, 0)
    for k in ("SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NODELIST", "SLURM_STEP_NUM_TASKS",
              "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NUM_NODES"):
        del e[k]
    msg = only_error(e)
    assert "batch script" in msg and "SLURM_NTASKS=4" in msg
    assert "HINT: Start the training with `srun python" in msg
    # one task in the allocation: running without srun is fine
    env = envmod.detect({**e, "SLURM_NTASKS": "1", "SLURM_TASKS_PER_NODE": "1"}, ancestors=ancestors_ok)
    assert (env.world_size, env.launcher, env.job_id) == (1, "slurm", "4242")


def test_uneven_tasks_per_node():
    msg = only_error(srun_task(2, 0, 1, tpn="2,1", ntasks=3))
    assert "SLURM_STEP_TASKS_PER_NODE=2,1" in msg and "--ntasks=3" in msg
    assert "HINT: Request --nodes=2 --ntasks-per-node=" in msg


def test_tasks_per_node_not_equal_to_visible_gpus():
    msg = only_error(srun_task(1, 1, 0, extra={"SLURM_GPUS_PER_NODE": "4", "SLURM_GPUS_ON_NODE": "4",
                                               "CUDA_VISIBLE_DEVICES": "0,1,2,3"}))
    assert "2 tasks on node 0 but each sees 4 GPUs" in msg and "2 GPUs would stay idle" in msg
    assert "HINT: Use one task per GPU: --ntasks-per-node=4" in msg


def test_two_tasks_sharing_one_gpu():
    msg = only_error(srun_task(1, 1, 0, extra={"SLURM_GPUS_PER_NODE": "1", "SLURM_GPUS_ON_NODE": "1",
                                               "CUDA_VISIBLE_DEVICES": "0"}))
    assert "2 tasks on node 0 but only SLURM_GPUS_ON_NODE=1 GPUs" in msg and "has no GPU to bind" in msg


def test_gpus_per_task_two_each_is_fine():
    # --gpus-per-task=2 --ntasks-per-node=2: each task owns two of the node's four GPUs
    e = srun_task(1, 1, 0, extra={"SLURM_GPUS_ON_NODE": "4", "CUDA_VISIBLE_DEVICES": "2,3"})
    assert preflight(e, ancestors=ancestors_ok) == []


def test_local_rank_without_gpu():
    e = srun_task(3, 3, 0, tpn="4", ntasks=4, nodes="n1",
                  extra={"SLURM_GPUS_ON_NODE": "2", "CUDA_VISIBLE_DEVICES": "0,1", "SLURM_STEP_NUM_NODES": "1"})
    msg = only_error(e)
    assert "local rank 3 has no GPU to bind" in msg and "CUDA_VISIBLE_DEVICES=0,1" in msg
    assert "4 tasks on node 0 but only SLURM_GPUS_ON_NODE=2 GPUs" in msg


def test_gpus_requested_none_visible():
    msg = only_error(srun_task(0, 0, 0, extra={"SLURM_GPUS_ON_NODE": "2", "CUDA_VISIBLE_DEVICES": ""}))
    assert "this task sees none" in msg


def test_inherited_from_enclosing_job():
    # The task pid of the step that set the variables is not one of our ancestors.
    msg = only_error(srun_task(0, 0, 0, extra={"SLURM_TASK_PID": "999999"}), ancestors=lambda: [10, 1])
    assert "SLURM_TASK_PID=999999" in msg and "inherited" in msg and "HINT:" in msg
    # A node outside the job's node list: copied from another job.
    msg = only_error(srun_task(0, 0, 0, extra={"SLURMD_NODENAME": "login1"}))
    assert "SLURMD_NODENAME=login1 is not in SLURM_JOB_NODELIST=n[1-2]" in msg


def test_inconsistent_slurm_variables():
    msg = only_error(srun_task(0, 0, 0, tpn="2(x3)"))
    assert "Slurm variables disagree" in msg and "tasks per node 2(x3)" in msg


def test_bad_values_are_named():
    with pytest.raises(EnvError, match=r"SLURM_PROCID='zero' is not an integer"):
        envmod.detect(srun_task(0, 0, 0, extra={"SLURM_PROCID": "zero"}), ancestors=ancestors_ok)
    with pytest.raises(EnvError, match=r"rank=5 is outside 0..world_size-1 \(3\)"):
        envmod.detect(torchrun_task(5, 1), ancestors=ancestors_ok)
    with pytest.raises(EnvError, match=r"MASTER_PORT=70000 is not a TCP port"):
        envmod.detect({"MASTER_PORT": "70000"})
    problems = preflight(srun_task(0, 0, 0, nodes="n[1-"), ancestors=ancestors_ok)
    assert problems and "n[1-" in str(problems[0])


def test_detect_after_export_keeps_the_launcher():
    environ: dict[str, str] = {}
    single = detect(environ)
    single.export(environ)
    again = detect(environ)
    assert again == single  # not re-read as torchrun, same port
    slurm_env = srun_task(1, 1, 0)
    envmod.detect(slurm_env, ancestors=ancestors_ok).export(slurm_env)
    assert envmod.detect(slurm_env, ancestors=ancestors_ok).launcher == "slurm"


def test_distenv_is_frozen():
    env = detect({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        env.rank = 3  # type: ignore[misc]
    assert isinstance(env, DistEnv) and detect({}).launcher == "single"


# --------------------------------------------------------------------------- CLI


def run_cli(args, environ):
    return subprocess.run([sys.executable, "-m", "ddp_hpc.env", *args], env=environ, capture_output=True, text=True,
                          timeout=60)


def test_cli_json_and_check(monkeypatch):
    import os

    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "RANK", "MASTER", "WORLD", "LOCAL_"))}
    environ = {**base, **torchrun_task(1, 1, world=2, local_world=2)}
    out = run_cli(["--json"], environ)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert (data["rank"], data["world_size"], data["launcher"], data["master_port"]) == (1, 2, "torchrun", 29500)
    out = run_cli(["--check"], environ)
    assert out.returncode == 0 and out.stdout.startswith("OK rank 1/2 local 1/2 node 0/1")
    out = run_cli([], environ)
    assert "launcher" in out.stdout and "torchrun" in out.stdout


def test_cli_check_fails_with_hint():
    import os

    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    e = srun_task(0, 0, 0, tpn="2,1", ntasks=3)
    e["SLURM_TASK_PID"] = "1"  # init is everyone's ancestor
    out = run_cli(["--check"], {**base, **e})
    assert out.returncode == 1
    assert "env [n1 task 0]: error: Uneven tasks per node" in out.stderr and "\nHINT: Request" in out.stderr


@pytest.mark.parametrize("var", ["SLURM_PROCID", "SLURM_NODEID", "SLURM_LOCALID"])
def test_task_ids_without_a_step_id_are_refused_not_rank_0_of_1(var):
    """srun variables partly stripped (a container): non-zero task ids but no SLURM_STEP_ID."""
    from ddp_hpc.env import EnvError, detect
    environ = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n1", var: "3"}
    with pytest.raises(EnvError) as exc:
        detect(environ)
    assert f"{var}=3" in str(exc.value) and "no SLURM_STEP_ID" in str(exc.value)
    assert "rank 0 of 1" in str(exc.value)


def test_a_resumed_runs_restart_numbers_follow_the_earlier_runs():
    """DDP_HPC_RESTART_BASE (a job that resumes a stopped run) adds to every launcher's count;
    JobFacts.requeues stays the scheduler's own."""
    base = {"DDP_HPC_RESTART_BASE": "2"}
    assert detect(srun_task(0, 0, 0, extra={**base, "SLURM_RESTART_COUNT": "1"}),
                  ancestors=ancestors_ok).restart_count == 3
    assert detect({**torchrun_task(0, 0), **base}).restart_count == 2
    assert detect({**torchrun_task(0, 0), "DDP_HPC_LAUNCHER": "local", **base}).restart_count == 2
    assert detect(base).restart_count == 2 and detect({}).restart_count == 0
    facts = envmod.job_facts({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1", **base})
    assert (facts.restart_count, facts.restart_base, facts.requeues) == (3, 2, 1)
    facts = envmod.job_facts({"DDP_HPC_RESTART_BASE": "x"})
    assert (facts.restart_count, facts.restart_base, facts.requeues) == (0, 0, 0)


@pytest.mark.parametrize("environ,nodes,usable", [
    ({}, (), False),                                            # no GPU driver on this machine
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, (), False),               # a fake GRES without a driver
    ({}, ("/dev/nvidiactl",), True),
    ({"CUDA_VISIBLE_DEVICES": ""}, ("/dev/nvidiactl",), False),  # the driver, but no device exposed
    ({"CUDA_VISIBLE_DEVICES": "-1"}, ("/dev/nvidiactl",), False),
    ({"CUDA_VISIBLE_DEVICES": "1"}, ("/dev/kfd",), True),       # AMD ROCm
])
def test_gpu_usable(environ, nodes, usable):
    from ddp_hpc.env import gpu_usable
    assert gpu_usable(environ, exists=lambda p: p in nodes) is usable
