"""Submission: job spec -> sbatch script / submitit executor / local processes."""
