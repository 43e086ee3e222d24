"""Local processes: functions spawned per rank, commands started as N pretend nodes (see core)."""

from ddp_hpc.launch.core import (RankFailedError, free_port, launch_distributed, local_rank_env,  # noqa: F401
                                 main, node_layout, run_local, start_local, thread_env)
