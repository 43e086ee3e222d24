"""Rank and job facts of this process, derived from the launcher's variables: the only package
that reads them from the environment.

    env = detect()             # rank, sizes, master address/port, launcher; EnvError with a HINT
    facts = job_facts()        # job id and key, restarts, end time, node-local disk, log dir

Modules, one idea each: ``model`` (DistEnv, EnvError), ``sources`` (one per launcher: slurm,
torchrun, submitit, local, single, and what each reads), ``ports`` (the MASTER_PORT rule,
free_port), ``job`` (job-level facts and the job-key rule), ``gpus`` (GPU binding), ``network``
(the interface peers reach this rank on), ``checks`` (preflight, detect), ``cli`` (``ddp-hpc env``,
``python -m ddp_hpc.env``).
"""

from ddp_hpc.env.checks import detect, preflight
from ddp_hpc.env.gpus import HostGpus, gpu_index, gpu_usable, host_gpus, visible_gpus
from ddp_hpc.env.job import JobFacts, job_facts, job_key
from ddp_hpc.env.model import LAUNCHERS, DistEnv, EnvError
from ddp_hpc.env.network import interface_for, route_interface
from ddp_hpc.env.ports import PORT_BASE, PORT_SPAN, derive_port, free_port, master_port, user_port
from ddp_hpc.env.sources import launcher_of

__all__ = [
    "LAUNCHERS", "PORT_BASE", "PORT_SPAN", "DistEnv", "EnvError", "JobFacts", "derive_port", "detect",
    "free_port", "gpu_index", "HostGpus", "host_gpus",
    "interface_for", "job_facts", "job_key", "launcher_of", "master_port", "preflight",
    "route_interface", "user_port", "visible_gpus", "gpu_usable",
]
