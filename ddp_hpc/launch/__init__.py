"""Local processes, the laptop stand-in for ``srun``: the process tree (tree), functions spawned
per rank (spawn), commands started as N pretend nodes x G processes (local), the CLI (cli)."""

from ddp_hpc.env import free_port  # noqa: F401  (kept for tests/test_dist.py, test_submit_torchrun_wrapper.py)
from ddp_hpc.launch.local import LocalResult, LocalRun, run_local, start_local  # noqa: F401
from ddp_hpc.launch.spawn import RankFailedError, launch_distributed  # noqa: F401
from ddp_hpc.launch.tree import LaunchError, local_rank_env, node_layout, thread_env  # noqa: F401
