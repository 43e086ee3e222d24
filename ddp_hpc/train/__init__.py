"""The training core: DDP loop, exact evaluation, atomic checkpoints, preemption -> requeue, run logs.

    from ddp_hpc.train import fit, train_ddp
"""
from ddp_hpc.train.api import fit, run_job, train_ddp
from ddp_hpc.train.result import TrainResult

__all__ = ["fit", "train_ddp", "run_job", "TrainResult"]
