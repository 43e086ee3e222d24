"""The model of where a process sits in a distributed job: `DistEnv`, and `EnvError` for a setup
that cannot work. Pure data; the sources (one per launcher) build it, the checks vet it."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from ddp_hpc.errors import HintError

LAUNCHERS = ("slurm", "torchrun", "submitit", "local", "single")


class EnvError(HintError, RuntimeError):
    """A distributed setup that cannot work: ``problem`` names the values seen, ``hint`` the fix."""


def int_var(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    """The integer in variable ``name``; ``default`` when unset or empty (an `EnvError` if None)."""
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


@dataclass(frozen=True, kw_only=True)
class DistEnv:
    """Where this process sits in the job. Build it with `ddp_hpc.env.detect()`."""

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
            (0 <= self.node_rank < self.num_nodes,
             f"node_rank={self.node_rank} is outside 0..num_nodes-1 ({self.num_nodes - 1})"),
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

    def child_environ(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """A copy of ``environ`` with the whole torchrun contract for a child process (what
        ``python -m ddp_hpc.exec`` gives the command it runs): `export`'s variables (same refusal
        to replace a different value), plus GROUP_RANK (node rank), GROUP_WORLD_SIZE, ROLE_RANK,
        ROLE_WORLD_SIZE, ROLE_NAME, TORCHELASTIC_RUN_ID (the job id; an outer torchrun's is kept
        when the job id is unknown) and DDP_HPC_JOB_ID / DDP_HPC_NUM_NODES, so the child's own
        `detect()` names the same job and node count."""
        child = dict(os.environ if environ is None else environ)
        self.export(child)
        del child["DDP_HPC_EXPORTED"]  # the mark is for this process only
        child.update({
            "GROUP_RANK": str(self.node_rank), "GROUP_WORLD_SIZE": str(self.num_nodes),
            "ROLE_RANK": str(self.rank), "ROLE_WORLD_SIZE": str(self.world_size), "ROLE_NAME": "default",
            "TORCHELASTIC_RUN_ID": self.job_id or child.get("TORCHELASTIC_RUN_ID") or "none",
            "DDP_HPC_NUM_NODES": str(self.num_nodes),
        })
        if self.job_id:
            child["DDP_HPC_JOB_ID"] = self.job_id
        return child
