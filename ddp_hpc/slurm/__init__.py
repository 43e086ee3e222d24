"""Slurm: the one command runner (cli), a job's state from squeue / sacct (query), host lists, job
states, time strings."""
