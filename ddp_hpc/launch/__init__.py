"""Local processes, the laptop stand-in for ``srun``: the process tree (tree), functions spawned
per rank (spawn), commands started as N pretend nodes x G processes (local), the CLI (cli)."""

from ddp_hpc.launch.local import LocalResult, LocalRun, run_local, start_local
from ddp_hpc.launch.spawn import RankFailedError, launch_distributed
from ddp_hpc.launch.tree import LaunchError, local_rank_env, node_layout, thread_env

__all__ = ["LaunchError", "LocalResult", "LocalRun", "RankFailedError", "launch_distributed",
           "local_rank_env", "node_layout", "run_local", "start_local", "thread_env"]
