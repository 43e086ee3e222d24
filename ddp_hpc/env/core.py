"""Derive one `DistEnv` (ranks, sizes, master address/port, launcher) from the process environment.

This is the only module that reads ``os.environ`` for rank facts. It understands:

- ``slurm``:    a task started by ``srun`` (SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURM_NTASKS,
                SLURM_STEP_NODELIST, SLURM_STEP_TASKS_PER_NODE, SLURM_JOB_ID, array ids, restarts);
- ``torchrun``: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_*; torchrun's
                ranks win over Slurm's when torchrun runs inside an srun step;
- ``submitit``: submitit's Slurm tasks (SUBMITIT_EXECUTOR=slurm, Slurm variables) or its local
                executor (SUBMITIT_LOCAL_*);
- ``local``:    ddp_hpc's own local launcher (torchrun-style variables plus DDP_HPC_LAUNCHER=local);
- ``single``:   nothing at all: one process.

Inconsistent setups that would make ``init_process_group`` hang (a batch script that runs Python
without ``srun``, uneven tasks per node, more tasks than GPUs, stale variables of an enclosing job)
raise `EnvError` with the values seen and a ``HINT:`` line with the fix.

    srun python -m ddp_hpc.env --check     # one-line diagnostic per task, non-zero exit on a problem
    python -m ddp_hpc.env --json           # the derived environment of this process
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import zlib
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass

from ddp_hpc.env.job import job_key
from ddp_hpc.slurm import hostlist

LAUNCHERS = ("slurm", "torchrun", "submitit", "local", "single")

#: MASTER_PORT derived from a job id lies in [PORT_BASE, PORT_BASE + PORT_SPAN): above the
#: well-known and registered ranges most services use, below Linux's default ephemeral range
#: (32768-60999 overlaps; a collision there fails loudly at bind, and MASTER_PORT overrides).
PORT_BASE = 20000
PORT_SPAN = 10000

#: Slurm's step ids for the batch script and the extern step (SLURM_BATCH_SCRIPT, SLURM_EXTERN_CONT).
_NON_SRUN_STEPS = {"batch", "extern", "4294967294", "4294967295", "4294967292"}


class EnvError(RuntimeError):
    """A distributed setup that cannot work; the message names what was seen and ends in a HINT."""

    def __init__(self, problem: str, hint: str):
        super().__init__(f"{problem}\nHINT: {hint}")
        self.problem = problem
        self.hint = hint


@dataclass(frozen=True, kw_only=True)
class DistEnv:
    """Where this process sits in the job. Build it with `DistEnv.detect()`."""

    rank: int
    """Global rank, 0 .. world_size-1."""
    local_rank: int
    """Rank among the processes of this node; the GPU index with --gpus-per-node."""
    world_size: int
    local_world_size: int
    """Processes on this node (may differ between nodes only when uneven layouts are allowed)."""
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    hostnames: tuple[str, ...]
    """One entry per node, in node-rank order (pretend nodes of the local launcher share a host)."""
    job_id: str | None
    """Slurm job id (``ARRAYJOB_TASK`` inside an array), or the launcher's own id; None when unknown."""
    restart_count: int
    """How often the job was requeued (SLURM_RESTART_COUNT) or restarted by torchrun."""
    launcher: str
    in_slurm: bool = False
    """True inside a Slurm job step (srun, submitit's Slurm executor, torchrun under srun): the
    job can be requeued with scontrol and its time limit read from squeue."""

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher={self.launcher!r} is not one of {LAUNCHERS}")
        checks = [
            (self.world_size >= 1, f"world_size={self.world_size} must be >= 1"),
            (0 <= self.rank < self.world_size, f"rank={self.rank} is outside 0..world_size-1 ({self.world_size - 1})"),
            (self.local_world_size >= 1, f"local_world_size={self.local_world_size} must be >= 1"),
            (0 <= self.local_rank < self.local_world_size,
             f"local_rank={self.local_rank} is outside 0..local_world_size-1 ({self.local_world_size - 1})"),
            (0 <= self.node_rank < self.num_nodes, f"node_rank={self.node_rank} is outside 0..num_nodes-1 ({self.num_nodes - 1})"),
            (0 < self.master_port < 65536, f"master_port={self.master_port} is not a TCP port"),
        ]
        for ok, msg in checks:
            if not ok:
                raise EnvError(f"Inconsistent distributed environment ({self.launcher}): {msg}.",
                               "Run `python -m ddp_hpc.env` in the same place to see every variable used.")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        """Derive this process's environment (see the module docstring); raises `EnvError`."""
        return detect(environ)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["hostnames"] = list(self.hostnames)
        return d

    def export(self, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
        """Set MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE for ``env://``.

        A variable the user already set to a *different* value is never replaced: that raises
        `EnvError` naming both values. Returns what this call set.
        """
        target = os.environ if environ is None else environ
        wanted = {
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
        }
        clashes = [f"{k}={target[k]!r} (derived: {v!r})" for k, v in wanted.items() if k in target and target[k] != v]
        if clashes:
            raise EnvError(
                "Refusing to overwrite variables already set to other values: " + ", ".join(clashes) + ".",
                "Unset them (they may come from an enclosing job or an old shell), or make them agree.",
            )
        newly = {k: v for k, v in wanted.items() if k not in target}
        target.update(newly)
        # Remember who exported, so a later detect() in this same process keeps the launcher
        # (RANK & co. would otherwise read as torchrun's); child processes ignore the mark.
        target["DDP_HPC_EXPORTED"] = f"{os.getpid()}:{self.launcher}"
        return newly


# --------------------------------------------------------------------------- reading variables


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise EnvError(f"{name} is not set but is needed here.",
                           f"Start the job with a launcher that sets {name} (srun, torchrun, ddp_hpc.launch).")
        return default
    try:
        return int(raw)
    except ValueError:
        raise EnvError(f"{name}={raw!r} is not an integer.", f"Fix or unset {name}.") from None


def _port(environ: Mapping[str, str], job_key: str | None) -> int:
    for name in ("MASTER_PORT", "DDP_HPC_MASTER_PORT"):
        if environ.get(name):
            port = _int(environ, name)
            if not 0 < port < 65536:
                raise EnvError(f"{name}={port} is not a TCP port.", f"Set {name} to a free port in 1024..65535.")
            return port
    if job_key:
        return derive_port(job_key)
    return free_port()


def derive_port(job_key: str) -> int:
    """MASTER_PORT for a job: identical on every rank, spread over PORT_SPAN ports by job id."""
    return PORT_BASE + zlib.crc32(job_key.encode()) % PORT_SPAN


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` of this machine right now (for single-machine runs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _this_host() -> str:
    return socket.gethostname()


def _slurm_job_key(environ: Mapping[str, str]) -> str | None:
    return job_key(environ)


def _restart_count(environ: Mapping[str, str]) -> int:
    if environ.get("SLURM_RESTART_COUNT"):
        return _int(environ, "SLURM_RESTART_COUNT")
    return _int(environ, "TORCHELASTIC_RESTART_COUNT", 0)


def launcher_of(environ: Mapping[str, str]) -> str:
    """Which launcher started this process (see the module docstring for the precedence)."""
    pid, _, exported = environ.get("DDP_HPC_EXPORTED", "").partition(":")
    if pid == str(os.getpid()) and exported in LAUNCHERS and exported not in ("torchrun", "local"):
        return exported  # RANK & co. came from our own export(), not from torchrun
    if environ.get("DDP_HPC_LAUNCHER") == "local":
        return "local"
    if "RANK" in environ and "WORLD_SIZE" in environ and "LOCAL_RANK" in environ:
        return "torchrun"
    if environ.get("SUBMITIT_EXECUTOR") in ("slurm", "local") and (
        "SLURM_PROCID" in environ or "SUBMITIT_LOCAL_GLOBALID" in environ
    ):
        return "submitit"
    if "SLURM_JOB_ID" in environ or "SLURM_PROCID" in environ:
        return "slurm"
    return "single"


# --------------------------------------------------------------------------- per launcher


def _from_torchrun(environ: Mapping[str, str], launcher: str) -> DistEnv:
    world = _int(environ, "WORLD_SIZE")
    rank = _int(environ, "RANK")
    local_world = _int(environ, "LOCAL_WORLD_SIZE", world)
    node_rank = _int(environ, "GROUP_RANK", rank // local_world)
    num_nodes = _int(environ, "GROUP_WORLD_SIZE", _int(environ, "DDP_HPC_NUM_NODES", -(-world // local_world)))
    slurm_nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if slurm_nodes and len(hostlist.expand(slurm_nodes)) == num_nodes:
        hosts = tuple(hostlist.expand(slurm_nodes))
    else:
        hosts = (_this_host(),) * num_nodes
    if "MASTER_ADDR" not in environ and world > 1:
        raise EnvError(f"{launcher} variables are set (RANK={rank}, WORLD_SIZE={world}) but MASTER_ADDR is not.",
                       "Set MASTER_ADDR and MASTER_PORT, or start the processes with torchrun / ddp_hpc.launch.")
    job_key = _slurm_job_key(environ) or environ.get("DDP_HPC_JOB_ID") or None
    return DistEnv(
        rank=rank, local_rank=_int(environ, "LOCAL_RANK"), world_size=world, local_world_size=local_world,
        node_rank=node_rank, num_nodes=num_nodes, master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_port(environ, job_key), hostnames=hosts, job_id=job_key,
        restart_count=_restart_count(environ), launcher=launcher,
        in_slurm=launcher == "torchrun" and _slurm_job_key(environ) is not None,
    )


def _from_submitit_local(environ: Mapping[str, str]) -> DistEnv:
    job = environ.get("SUBMITIT_LOCAL_JOB_ID") or None
    world = _int(environ, "SUBMITIT_LOCAL_NTASKS", 1)
    num_nodes = _int(environ, "SUBMITIT_LOCAL_JOB_NUM_NODES", 1)
    return DistEnv(
        rank=_int(environ, "SUBMITIT_LOCAL_GLOBALID", 0), local_rank=_int(environ, "SUBMITIT_LOCAL_LOCALID", 0),
        world_size=world, local_world_size=world // num_nodes, node_rank=_int(environ, "SUBMITIT_LOCAL_NODEID", 0),
        num_nodes=num_nodes, master_addr=environ.get("MASTER_ADDR", "127.0.0.1"), master_port=_port(environ, job),
        hostnames=(_this_host(),) * num_nodes, job_id=job, restart_count=0, launcher="submitit",
    )


def _in_batch_step(environ: Mapping[str, str]) -> bool:
    """True in the batch script (or an salloc shell): Slurm variables but no srun step."""
    step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID"))
    return step is None or step in _NON_SRUN_STEPS


def _from_slurm(environ: Mapping[str, str], launcher: str) -> DistEnv:
    job_key = _slurm_job_key(environ)
    if _in_batch_step(environ):
        ntasks = _int(environ, "SLURM_NTASKS", 1)
        if ntasks > 1:
            raise EnvError(
                f"This process runs in Slurm job {job_key}'s batch script (no srun step: SLURM_STEP_ID="
                f"{environ.get('SLURM_STEP_ID', 'unset')}), but the allocation has SLURM_NTASKS={ntasks} tasks; "
                f"it would wait forever for {ntasks - 1} peers that were never started.",
                "Start the training with `srun python ...` inside the batch script (one task per GPU), "
                "or request --ntasks=1.",
            )
        hosts = tuple(hostlist.expand(environ["SLURM_JOB_NODELIST"])) if environ.get("SLURM_JOB_NODELIST") else (_this_host(),)
        return DistEnv(
            rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
            master_addr=environ.get("MASTER_ADDR", hosts[0]), master_port=_port(environ, job_key),
            hostnames=hosts[:1], job_id=job_key, restart_count=_restart_count(environ), launcher=launcher,
            in_slurm=True,
        )

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
    world = _int(environ, "SLURM_STEP_NUM_TASKS", _int(environ, "SLURM_NTASKS", sum(per_node)))
    node_rank = _int(environ, "SLURM_NODEID")
    rank = _int(environ, "SLURM_PROCID")
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
    return DistEnv(
        rank=rank, local_rank=_int(environ, "SLURM_LOCALID"), world_size=world, local_world_size=per_node[node_rank],
        node_rank=node_rank, num_nodes=len(hosts), master_addr=environ.get("MASTER_ADDR") or hosts[0],
        master_port=_port(environ, job_key), hostnames=hosts, job_id=job_key,
        restart_count=_restart_count(environ), launcher=launcher, in_slurm=True,
    )


def _derive(environ: Mapping[str, str]) -> DistEnv:
    launcher = launcher_of(environ)
    if launcher in ("torchrun", "local"):
        return _from_torchrun(environ, launcher)
    if launcher == "submitit":
        if environ.get("SUBMITIT_EXECUTOR") == "local":
            return _from_submitit_local(environ)
        return _from_slurm(environ, "submitit")
    if launcher == "slurm":
        return _from_slurm(environ, "slurm")
    host = _this_host()
    return DistEnv(
        rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"), master_port=_port(environ, None),
        hostnames=(host,), job_id=None, restart_count=0, launcher="single",
    )


# --------------------------------------------------------------------------- preflight

def _ancestors() -> list[int]:
    import psutil

    proc = psutil.Process()
    return [proc.pid] + [p.pid for p in proc.parents()]


def visible_gpus(environ: Mapping[str, str]) -> int | None:
    """GPUs CUDA will expose given CUDA_VISIBLE_DEVICES; None when the variable is unset."""
    if "CUDA_VISIBLE_DEVICES" not in environ:
        return None
    raw = environ["CUDA_VISIBLE_DEVICES"].strip()
    if raw in ("", "NoDevFiles") or raw.startswith("-"):
        return 0
    ids = [d.strip() for d in raw.split(",") if d.strip()]
    # CUDA stops at the first invalid entry ("0,-1,2" exposes one device)
    return next((i for i, d in enumerate(ids) if d.startswith("-")), len(ids))


def gpu_index(env: DistEnv, environ: Mapping[str, str], visible: int) -> int | None:
    """The CUDA index this rank binds among ``visible`` devices, or None for CPU; pure.

    What Slurm 22.05 sets (seen on the test cluster, 2 tasks per node; srun tasks get no
    SLURM_GPUS_PER_TASK, and SLURM_GPUS_ON_NODE counts the step's GPUs on the node):

    =================================  ====================  ==================  ===========
    request                            CUDA_VISIBLE_DEVICES  SLURM_GPUS_ON_NODE  index
    =================================  ====================  ==================  ===========
    --gpus-per-node=2                  0,1 (every task)      2                   local rank
    --gpus-per-task=1                  0 / 1                 2                   0
    --gpus-per-task=2                  0,1 / 2,3             4                   0
    --gpus-per-node=4 --gpu-bind=...   0 / 1                 4                   0
    =================================  ====================  ==================  ===========

    A task that sees fewer GPUs than its node has (or one GPU, or SLURM_GPUS_PER_TASK is set)
    owns them and takes cuda:0; tasks that all see the node's GPUs take cuda:local_rank. Fewer
    GPUs than tasks on a node, and (under Slurm) more GPUs than tasks, are `EnvError`s.
    """
    if visible == 0:
        return None
    seen = f"CUDA_VISIBLE_DEVICES={environ.get('CUDA_VISIBLE_DEVICES', '<unset>')} ({visible} visible)"
    raw_on_node = environ.get("SLURM_GPUS_ON_NODE", "")
    on_node = int(raw_on_node) if raw_on_node.isdigit() else 0
    where = f"{env.local_world_size} tasks on node {env.node_rank}"
    if 0 < on_node < env.local_world_size:
        raise EnvError(
            f"{where} but only SLURM_GPUS_ON_NODE={on_node} GPUs there ({seen}): "
            f"local rank {env.local_rank} has no GPU to bind.",
            f"Use one task per GPU: --ntasks-per-node={on_node} with --gpus-per-node={on_node}, or --gpus-per-task=1.")
    if visible == 1 or visible < on_node or environ.get("SLURM_GPUS_PER_TASK"):
        return 0  # this task's own device(s): the first is cuda:0
    if env.local_rank >= visible:
        raise EnvError(
            f"local rank {env.local_rank} (rank {env.rank}, {where}) has no GPU to bind: {seen}.",
            f"Use one task per GPU: --ntasks-per-node={visible} with --gpus-per-node={visible}, or "
            "--gpus-per-task=1; for CPU-only runs set CUDA_VISIBLE_DEVICES= (empty).")
    if on_node and env.local_world_size < visible:
        raise EnvError(
            f"{where} but each sees {visible} GPUs ({seen}, SLURM_GPUS_ON_NODE={on_node}): "
            f"{visible - env.local_world_size} GPUs would stay idle.",
            f"Use one task per GPU: --ntasks-per-node={visible} with --gpus-per-node={visible}, or --gpus-per-task=1.")
    return env.local_rank


def _check_gpus(env: DistEnv, environ: Mapping[str, str]) -> EnvError | None:
    """Under Slurm, when GPUs were requested, every task must have exactly one GPU to bind."""
    requested = [k for k in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS",
                             "SLURM_GPUS_PER_TASK", "SLURM_GPUS") if environ.get(k)]
    if not requested or env.launcher not in ("slurm", "submitit"):
        return None
    visible = visible_gpus(environ) or 0
    if not visible:
        seen = ", ".join(f"{k}={environ[k]}" for k in requested)
        return EnvError(
            f"GPUs were requested ({seen}) but this task sees none "
            f"(CUDA_VISIBLE_DEVICES={environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}), "
            f"local rank {env.local_rank} on {env.hostnames[env.node_rank]}.",
            "Check --gpus-per-node/--gres on the sbatch line and that srun does not override it "
            "(e.g. --gpus=0 or --gres=none in the srun line).",
        )
    try:
        gpu_index(env, environ, visible)
    except EnvError as e:
        return e
    return None


def _check_inherited(environ: Mapping[str, str], ancestors: Callable[[], list[int]]) -> EnvError | None:
    """SLURM_* variables copied from an enclosing job or step into an unrelated process."""
    job_nodes = environ.get("SLURM_JOB_NODELIST")
    node = environ.get("SLURMD_NODENAME")
    if job_nodes and node:
        try:
            inside = node in hostlist.expand(job_nodes)
        except ValueError:
            inside = True
        if not inside:
            return EnvError(
                f"SLURMD_NODENAME={node} is not in SLURM_JOB_NODELIST={job_nodes}: these SLURM_* variables were "
                f"inherited from another job (SLURM_JOB_ID={environ.get('SLURM_JOB_ID')}).",
                "Unset SLURM_* before launching (`for v in $(compgen -e SLURM_); do unset $v; done`), "
                "or start the work with srun inside its own allocation.",
            )
    task_pid = environ.get("SLURM_TASK_PID")
    if task_pid and task_pid.isdigit() and not _in_batch_step(environ):
        if int(task_pid) not in ancestors():
            return EnvError(
                f"SLURM_TASK_PID={task_pid} (job {environ.get('SLURM_JOB_ID')}, step {environ.get('SLURM_STEP_ID')}) is "
                "neither this process nor one of its parents: these SLURM_* variables were inherited from an "
                "enclosing job or step, so the ranks they describe are not this process's.",
                "Launch with srun from inside the allocation (srun sets fresh variables), or unset SLURM_* "
                "before using another launcher.",
            )
    return None


def _preflight(environ: Mapping[str, str], ancestors: Callable[[], list[int]]) -> tuple[DistEnv | None, list[EnvError]]:
    problems: list[EnvError] = []
    if launcher_of(environ) in ("slurm", "submitit"):
        inherited = _check_inherited(environ, ancestors)
        if inherited:
            problems.append(inherited)
    try:
        env = _derive(environ)
    except EnvError as e:
        return None, problems + [e]
    except ValueError as e:  # hostlist grammar errors already quote their input
        return None, problems + [EnvError(str(e), "Fix the Slurm host list variable named above.")]
    gpu = _check_gpus(env, environ)
    return env, problems + ([gpu] if gpu else [])


def preflight(environ: Mapping[str, str] | None = None, *, ancestors: Callable[[], list[int]] = _ancestors) -> list[EnvError]:
    """Every problem that would make this task hang or misbehave, each an `EnvError` with a HINT."""
    return _preflight(os.environ if environ is None else environ, ancestors)[1]


def detect(environ: Mapping[str, str] | None = None, *, ancestors: Callable[[], list[int]] = _ancestors) -> DistEnv:
    """Derive the `DistEnv` of this process; raise the first problem `preflight` would report."""
    env, problems = _preflight(os.environ if environ is None else environ, ancestors)
    if problems:
        raise problems[0]
    assert env is not None
    return env


# --------------------------------------------------------------------------- CLI


def _table(env: DistEnv) -> str:
    rows = env.to_dict()
    rows["hostnames"] = hostlist.compress(env.hostnames) if env.hostnames else ""
    width = max(map(len, rows))
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddp_hpc.env",
        description="Print the distributed environment this task derives (srun python -m ddp_hpc.env --check).",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--check", action="store_true", help="one line per task; exit 1 with the reason on a problem")
    args = parser.parse_args(argv)
    env, problems = _preflight(os.environ, _ancestors)
    if problems:
        tag = f"[{os.environ.get('SLURMD_NODENAME') or _this_host()} task {os.environ.get('SLURM_PROCID', os.environ.get('RANK', '?'))}]"
        for p in problems:
            print(f"ddp_hpc.env {tag} ERROR: {p}", file=sys.stderr)
        return 1
    assert env is not None
    if args.json:
        print(json.dumps({**env.to_dict(), "hostname": _this_host()}, sort_keys=True))
    elif args.check:
        print(f"OK rank {env.rank}/{env.world_size} local {env.local_rank}/{env.local_world_size} "
              f"node {env.node_rank}/{env.num_nodes} on {_this_host()} master {env.master_addr}:{env.master_port} "
              f"launcher {env.launcher} job {env.job_id}")
    else:
        print(_table(env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
