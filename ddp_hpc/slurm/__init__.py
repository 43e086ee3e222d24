"""Slurm: the one command runner (cli), host lists, job states, time strings."""
