"""Submission: a job config, a script or a function and the Slurm options -> one checked
``JobSpec`` (spec, target) -> a ``Backend`` (backends: local, sbatch, submitit; registered by
name in ``backends/__init__.py``) that plans it (the dry run) and submits it, handed over by
dispatch; an sbatch script (render, pure), submitit (slurm) or N x G processes here (local);
waiting for the end (wait); the ``ddp-hpc submit`` command (cli, ``python -m ddp_hpc.submit``);
the Python API (api: ``ddp_hpc.submit_job(fn_or_command, nodes=2, gpus=4, ...)``).
"""
