"""Rank and job facts of this process, derived from the launcher's variables (see core)."""

from ddp_hpc.env.core import (LAUNCHERS, PORT_BASE, PORT_SPAN, DistEnv, EnvError, _slurm_job_key,  # noqa: F401
                              derive_port, detect, free_port, gpu_index, launcher_of, main, preflight,
                              visible_gpus)
from ddp_hpc.env.job import JobFacts, job_facts, job_key  # noqa: F401
