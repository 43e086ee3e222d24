"""One source per launcher: which launcher started this process, and the `DistEnv` its variables give.

- ``slurm``:    a task started by ``srun`` (SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURM_NTASKS,
                SLURM_STEP_NODELIST, SLURM_STEP_TASKS_PER_NODE, SLURM_JOB_ID, array ids, restarts);
- ``torchrun``: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_*; torchrun's
                ranks win over Slurm's when torchrun runs inside an srun step;
- ``submitit``: submitit's Slurm tasks (SUBMITIT_EXECUTOR=slurm, Slurm variables) or its local
                executor (SUBMITIT_LOCAL_*);
- ``local``:    ddp_hpc's own local launcher (torchrun-style variables plus DDP_HPC_LAUNCHER=local);
- ``single``:   nothing at all: one process.

`launcher_of` picks the launcher in that order of trust: our own export, the local launcher,
torchrun, submitit, Slurm, a single process. Variables that contradict each other raise
`EnvError` with the values seen.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping

from ddp_hpc.env.job import ALLOC_RESTARTS_VAR, alloc_restarts, job_key, restart_base
from ddp_hpc.env.model import LAUNCHERS, DistEnv, EnvError, int_var
from ddp_hpc.env.ports import master_port
from ddp_hpc.slurm import hostlist

#: Slurm's step ids for the batch script and the extern step (SLURM_BATCH_SCRIPT, SLURM_EXTERN_CONT).
NON_SRUN_STEPS = {"batch", "extern", "4294967294", "4294967295", "4294967292"}
#: DDP_HPC_LAUNCHER's value in the ranks of ddp_hpc's local launcher (``launch.tree`` sets it)
LOCAL_LAUNCHER = "local"
#: SUBMITIT_EXECUTOR's value in the tasks of submitit's local executor (its Slurm one says "slurm")
SUBMITIT_HERE = "local"


def this_host() -> str:
    return socket.gethostname()


def restart_count(environ: Mapping[str, str]) -> int:
    """The run's restart number: `restart_base` (a resumed run's first) plus the launcher's count
    (Slurm's requeues and the in-allocation supervisor's restarts, else torchrun's)."""
    if environ.get("SLURM_RESTART_COUNT") or environ.get(ALLOC_RESTARTS_VAR):
        return restart_base(environ) + int_var(environ, "SLURM_RESTART_COUNT", 0) + alloc_restarts(environ)
    return restart_base(environ) + int_var(environ, "TORCHELASTIC_RESTART_COUNT", 0)


def in_batch_step(environ: Mapping[str, str]) -> bool:
    """True in the batch script (or an salloc shell): Slurm variables but no srun step."""
    step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID"))
    return step is None or step in NON_SRUN_STEPS


def launcher_of(environ: Mapping[str, str]) -> str:
    """Which launcher started this process (see the module docstring for the precedence)."""
    pid, _, exported = environ.get("DDP_HPC_EXPORTED", "").partition(":")
    if pid == str(os.getpid()) and exported in LAUNCHERS and exported not in ("torchrun", "local"):
        return exported  # RANK & co. came from our own export(), not from torchrun
    if environ.get("DDP_HPC_LAUNCHER") == LOCAL_LAUNCHER:
        return LOCAL_LAUNCHER
    if "RANK" in environ and "WORLD_SIZE" in environ and "LOCAL_RANK" in environ:
        return "torchrun"
    if environ.get("SUBMITIT_EXECUTOR") in ("slurm", SUBMITIT_HERE) and (
        "SLURM_PROCID" in environ or "SUBMITIT_LOCAL_GLOBALID" in environ
    ):
        return "submitit"
    if "SLURM_JOB_ID" in environ or "SLURM_PROCID" in environ:
        return "slurm"
    return "single"


def from_torchrun(environ: Mapping[str, str], launcher: str = "torchrun") -> DistEnv:
    world = int_var(environ, "WORLD_SIZE")
    rank = int_var(environ, "RANK")
    local_world = int_var(environ, "LOCAL_WORLD_SIZE", world)
    num_nodes = int_var(environ, "GROUP_WORLD_SIZE", int_var(environ, "DDP_HPC_NUM_NODES", -(-world // local_world)))
    slurm_nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if slurm_nodes and len(hostlist.expand(slurm_nodes)) == num_nodes:
        hosts = tuple(hostlist.expand(slurm_nodes))
    else:
        hosts = (this_host(),) * num_nodes
    if "MASTER_ADDR" not in environ and world > 1:
        raise EnvError(f"{launcher} variables are set (RANK={rank}, WORLD_SIZE={world}) but MASTER_ADDR is not.",
                       "Set MASTER_ADDR and MASTER_PORT, or start the processes with torchrun / ddp_hpc.launch.")
    slurm_key = job_key(environ)
    key = slurm_key or environ.get("DDP_HPC_JOB_ID") or None
    return DistEnv(
        rank=rank, local_rank=int_var(environ, "LOCAL_RANK"), world_size=world, local_world_size=local_world,
        node_rank=int_var(environ, "GROUP_RANK", rank // local_world), num_nodes=num_nodes,
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"), master_port=master_port(environ, key),
        hostnames=hosts, job_id=key, restart_count=restart_count(environ), launcher=launcher,
        in_slurm=launcher == "torchrun" and slurm_key is not None,
    )


def from_local(environ: Mapping[str, str]) -> DistEnv:
    """ddp_hpc.launch sets torchrun's variables plus DDP_HPC_LAUNCHER, _NUM_NODES and _JOB_ID."""
    return from_torchrun(environ, "local")


def from_submitit(environ: Mapping[str, str]) -> DistEnv:
    if environ.get("SUBMITIT_EXECUTOR") != SUBMITIT_HERE:
        return from_slurm(environ, "submitit")
    job = environ.get("SUBMITIT_LOCAL_JOB_ID") or None
    world = int_var(environ, "SUBMITIT_LOCAL_NTASKS", 1)
    num_nodes = int_var(environ, "SUBMITIT_LOCAL_JOB_NUM_NODES", 1)
    return DistEnv(
        rank=int_var(environ, "SUBMITIT_LOCAL_GLOBALID", 0), local_rank=int_var(environ, "SUBMITIT_LOCAL_LOCALID", 0),
        world_size=world, local_world_size=world // num_nodes, node_rank=int_var(environ, "SUBMITIT_LOCAL_NODEID", 0),
        num_nodes=num_nodes, master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=master_port(environ, job), hostnames=(this_host(),) * num_nodes, job_id=job,
        restart_count=restart_base(environ), launcher="submitit",
    )


def from_slurm(environ: Mapping[str, str], launcher: str = "slurm") -> DistEnv:
    """An srun task; in the batch script itself (no srun step) one process of the allocation."""
    if in_batch_step(environ):
        return _slurm_batch_script(environ, launcher)
    key = job_key(environ)
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    tpn_raw = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if not nodelist or not tpn_raw:
        raise EnvError(
            f"Slurm task (SLURM_PROCID={environ.get('SLURM_PROCID')}) without a node list or tasks-per-node "
            f"(SLURM_STEP_NODELIST={nodelist!r}, SLURM_STEP_TASKS_PER_NODE={tpn_raw!r}).",
            "Start tasks with srun inside an sbatch/salloc allocation; do not copy SLURM_* variables by hand.",
        )
    hosts = tuple(hostlist.expand(nodelist))
    per_node = hostlist.parse_tasks_per_node(tpn_raw)
    world = int_var(environ, "SLURM_STEP_NUM_TASKS", int_var(environ, "SLURM_NTASKS", sum(per_node)))
    node_rank = int_var(environ, "SLURM_NODEID")
    if len(per_node) != len(hosts) or sum(per_node) != world or node_rank >= len(hosts):
        raise EnvError(
            f"Slurm variables disagree: nodes {hostlist.compress(hosts)} ({len(hosts)}), tasks per node {tpn_raw} "
            f"(sum {sum(per_node)}), tasks {world}, this task's node id {node_rank}.",
            "These usually come from an enclosing job or an edited environment: start the step with srun "
            "from a clean allocation (or `env -u` the stale SLURM_* variables).",
        )
    if len(set(per_node)) > 1 and environ.get("DDP_HPC_ALLOW_UNEVEN") != "1":
        raise EnvError(
            f"Uneven tasks per node: SLURM_STEP_TASKS_PER_NODE={tpn_raw} ({per_node}) over {len(hosts)} nodes "
            f"for {world} tasks (SLURM_NTASKS_PER_NODE={environ.get('SLURM_NTASKS_PER_NODE', 'unset')}).",
            f"Request --nodes={len(hosts)} --ntasks-per-node=<GPUs per node> instead of --ntasks={world} "
            "(or set DDP_HPC_ALLOW_UNEVEN=1 if the uneven layout is intended, e.g. on CPUs).",
        )
    run = restart_count(environ)
    # a port of its own per run: a restart inside the allocation may start its ranks while the old
    # step's rank 0 still holds the last run's port (its tasks are being killed; the warm standby
    # starts in a fraction of a second); run 0 keeps the job's port
    port_key = f"{key}.run{run}" if key and run else key
    return DistEnv(
        rank=int_var(environ, "SLURM_PROCID"), local_rank=int_var(environ, "SLURM_LOCALID"), world_size=world,
        local_world_size=per_node[node_rank], node_rank=node_rank, num_nodes=len(hosts),
        master_addr=environ.get("MASTER_ADDR") or hosts[0], master_port=master_port(environ, port_key),
        hostnames=hosts, job_id=key, restart_count=run, launcher=launcher, in_slurm=True,
    )


def _slurm_batch_script(environ: Mapping[str, str], launcher: str) -> DistEnv:
    key = job_key(environ)
    ids = {k: environ[k] for k in ("SLURM_PROCID", "SLURM_NODEID", "SLURM_LOCALID")
           if environ.get(k, "0").strip() not in ("", "0")}
    if ids:   # an srun task whose step variables were stripped (a container, a wrapper script)
        raise EnvError(
            f"This process has task variables of an srun step ({', '.join(f'{k}={v}' for k, v in ids.items())}) "
            f"but no SLURM_STEP_ID, so it cannot tell its place in Slurm job {key}; it would "
            "run as rank 0 of 1 beside its peers.",
            "Pass Slurm's variables into the container unchanged (e.g. apptainer/singularity keep them; "
            "for docker/enroot add --env SLURM_STEP_ID and the other SLURM_STEP_* variables), or "
            "start the process with srun directly.",
        )
    ntasks = int_var(environ, "SLURM_NTASKS", 1)
    if ntasks > 1:
        raise EnvError(
            f"This process runs in Slurm job {key}'s batch script (no srun step: SLURM_STEP_ID="
            f"{environ.get('SLURM_STEP_ID', 'unset')}), but the allocation has SLURM_NTASKS={ntasks} tasks; "
            f"it would wait forever for {ntasks - 1} peers that were never started.",
            "Start the training with `srun python ...` inside the batch script (one task per GPU), "
            "or request --ntasks=1.",
        )
    nodes = environ.get("SLURM_JOB_NODELIST")
    hosts = tuple(hostlist.expand(nodes)) if nodes else (this_host(),)
    return DistEnv(
        rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
        master_addr=environ.get("MASTER_ADDR", hosts[0]), master_port=master_port(environ, key),
        hostnames=hosts[:1], job_id=key, restart_count=restart_count(environ), launcher=launcher,
        in_slurm=True,
    )


def from_single(environ: Mapping[str, str]) -> DistEnv:
    return DistEnv(
        rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"), master_port=master_port(environ, None),
        hostnames=(this_host(),), job_id=None, restart_count=restart_base(environ), launcher="single",
    )


SOURCES: dict[str, Callable[[Mapping[str, str]], DistEnv]] = {
    "slurm": from_slurm, "torchrun": from_torchrun, "submitit": from_submitit, "local": from_local,
    "single": from_single,
}


def derive(environ: Mapping[str, str]) -> DistEnv:
    """The `DistEnv` of the launcher `launcher_of` finds; raises `EnvError` (or the host list's
    `ValueError`) on variables that contradict each other."""
    return SOURCES[launcher_of(environ)](environ)


def node_index(environ: Mapping[str, str]) -> int:
    """This process's node within its job (``DistEnv.node_rank``: ``SLURM_NODEID``, torchrun's
    ``GROUP_RANK``, ...); where the variables contradict each other (the launcher's own checks
    report that), the launcher's raw count of nodes (``SLURM_NODEID``, else ``GROUP_RANK``); 0 where
    none is told (one machine). Never raises: it names a node's run-log file."""
    try:
        return derive(environ).node_rank
    except Exception:  # noqa: BLE001 - a file name must not fail a run
        for var in ("SLURM_NODEID", "GROUP_RANK"):
            value = str(environ.get(var, "")).strip()
            if value.isdigit():
                return int(value)
        return 0
