"""Recovering a job from faults: what to do when a run of it broke.

``avoid`` keeps a requeued job off the nodes that failed its earlier runs: `failed_nodes` (from
the run logs and ``sacct -D``), `requeue_avoiding` (the requeue that the training core and
``ddp_hpc.preemption`` make) and the batch script's prologue ``python -m ddp_hpc.recover.avoid
LOG_DIR`` (`check_placement`: a restart placed on such a node requeues itself elsewhere).
"""
