"""Where jobs queued by an earlier ddp_hpc find the task functions submitit pickled for them.

submitit pickles a job's function by its module path when the job is submitted and unpickles it
when the job starts, and again at every requeue, days later perhaps, with the ddp_hpc installed
then. These functions now live in ``ddp_hpc.backends.slurmjob``; without these names a job
submitted before the move would fail at its start with ``ModuleNotFoundError``. New jobs pickle the
new path.
"""
from ddp_hpc.backends.slurmjob import run_command_task, run_task

__all__ = ["run_task", "run_command_task"]
