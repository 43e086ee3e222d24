"""Submission: a job config and the Slurm options -> one checked ``JobSpec`` (spec) -> an sbatch
script (render, pure), submitit or sbatch on Slurm (slurm), or N x G processes here (local);
waiting for the end (wait); the ``ddp-hpc submit`` command (cli)."""
