"""Submission, the commands' side: ``ddp-hpc submit`` (cli, ``python -m ddp_hpc.submit``) reads a
job config, a script or a module off its command line (target), resumes an earlier run of the same
submission (resume) and hands one checked ``JobSpec`` to a backend (``ddp_hpc.backends``: local,
sbatch, submitit); the Python API (api: ``ddp_hpc.submit_job(fn_or_command, nodes=2, gpus=4,
...)``); ``ddp-hpc cancel`` (cancel). These ask ``ddp_hpc.status`` about jobs; the backends below
it never do.
"""
