"""Where function jobs queued by an earlier ddp_hpc find the rank entry submitit pickled for them
(``ddp_hpc.backends.functions`` holds it now; the reason is ``ddp_hpc.submit.slurm``'s)."""
from ddp_hpc.backends.functions import rank_entry

__all__ = ["rank_entry"]
