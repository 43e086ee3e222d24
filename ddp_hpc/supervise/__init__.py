"""Recovering a job from a fault, in its allocation and across requeues (docs/restarts.md).

Inside the allocation: the batch step of a job submitted with ``--max-restarts N`` (sbatch
backend, ``slurm/train.sbatch``) runs ``python -m ddp_hpc.supervise``, which starts the ranks as
one ``srun --no-kill`` step, watches them, and after a lost node, a killed rank or a hang stops
every rank, excludes what failed and starts them again on healthy nodes (spares first), where they
resume from their newest checkpoint. ``plan`` (what is restartable, which nodes next: pure),
``watch`` (one step: srun, events, node states; stopping it), ``health`` (the next step's nodes
checked before each start: ``nodecheck`` on every node), ``loop`` (the supervisor), ``cli`` (its
command line).

Across requeues: ``avoid`` keeps a requeued job off the nodes that failed its earlier runs
(`failed_nodes`, from the run logs, ``restarts.jsonl`` and ``sacct -D``; `requeue_avoiding`, the
requeue that the training core and ``ddp_hpc.preemption`` make; the batch script's prologue
``python -m ddp_hpc.supervise.avoid LOG_DIR``).
"""
