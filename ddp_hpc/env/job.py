"""Job-level facts (not rank facts): which job this is, how often it restarted, when it must end,
where its node-local disk and log directory are. One reader for all of ddp_hpc, so the job-key
rule and the variable names live in one place.

    facts = job_facts()            # from os.environ
    facts.key                      # "1234" or "1200_3" inside an array: ports, staging, records

Restart numbers: a run's restart number is ``DDP_HPC_RESTART_BASE`` (set by ``ddp-hpc submit``
when a job resumes a stopped run in the same run directory: one past the highest restart number
in its logs; 0 otherwise) plus the launcher's own count (``SLURM_RESTART_COUNT`` for a requeue,
``TORCHELASTIC_RESTART_COUNT`` under torchrun) plus ``DDP_HPC_ALLOC_RESTARTS``: how often the
supervisor (``ddp_hpc.supervise``) started the job's ranks again inside its allocation, counted
over all of the job's runs. So a resumed run's events follow the earlier run's instead of mixing
with them, a requeue of the resumed job counts on from there, and every in-allocation restart has
a number of its own.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ddp_hpc.parsing import to_float


@dataclass(frozen=True)
class JobFacts:
    job_id: str | None              #: SLURM_JOB_ID
    key: str | None                 #: ARRAYJOB_TASK inside an array, else the job id
    restart_count: int              #: restart_base + SLURM_RESTART_COUNT + alloc_restarts
    end_time: float | None          #: SLURM_JOB_END_TIME or DDP_HPC_JOB_END_TIME (unix seconds)
    node_tmpdir: str | None         #: SLURM_TMPDIR: the job's node-local scratch, when the site sets it
    tmpdir: str | None              #: TMPDIR
    log_dir: str | None             #: DDP_HPC_LOG_DIR: the run's log directory, set by the submit backends
    cluster: str                    #: SLURM_CLUSTER_NAME
    name: str | None                #: SLURM_JOB_NAME
    num_nodes: int                  #: SLURM_JOB_NUM_NODES (or SLURM_NNODES), 1 outside a job
    gpus_per_node: int              #: from SLURM_GPUS_PER_NODE ("gpu:2", "a100:4") or tasks per node
    submit_dir: str | None          #: SLURM_SUBMIT_DIR
    preempt_signal: str | None = None  #: DDP_HPC_PREEMPT_SIGNAL: the job's --signal (USR2, ...), for ddp_hpc.preemption
    node_list: str | None = None    #: SLURM_JOB_NODELIST: the job's nodes (a host list)
    #: DDP_HPC_EXCLUDE_FAILED_NODES (default on; 0/false/no/off: off): requeues avoid failed nodes
    exclude_failed_nodes: bool = True
    #: DDP_HPC_RESTART_BASE: the restart number of this job's first run (0 unless it resumes a run)
    restart_base: int = 0
    #: DDP_HPC_ALLOC_RESTARTS: restarts of the ranks inside the allocation (ddp_hpc.supervise)
    alloc_restarts: int = 0
    #: SLURM_CPUS_PER_TASK: the CPUs each task of this job step was given (None outside Slurm)
    cpus_per_task: int | None = None
    #: SLURM_STEP_ID: this process's job step (None outside an srun step)
    step_id: str | None = None
    #: SLURM_MEM_PER_NODE, else SLURM_MEM_PER_CPU x SLURM_CPUS_ON_NODE: the job's memory on this
    #: node in MB (None when Slurm does not say; 0, the whole node, too)
    memory_mb: int | None = None

    @property
    def requeues(self) -> int:
        """How often the scheduler restarted this job itself (``SLURM_RESTART_COUNT``)."""
        return self.restart_count - self.restart_base - self.alloc_restarts


#: the variable ``ddp-hpc submit`` sets for a job that resumes a stopped run (see the docstring)
RESTART_BASE_VAR = "DDP_HPC_RESTART_BASE"
#: the variable the in-allocation supervisor exports to the job steps it starts
ALLOC_RESTARTS_VAR = "DDP_HPC_ALLOC_RESTARTS"


def restart_base(environ: Mapping[str, str]) -> int:
    """``DDP_HPC_RESTART_BASE`` as a number (0 when unset or not a plain number)."""
    raw = environ.get("DDP_HPC_RESTART_BASE", "").strip()
    return int(raw) if raw.isdigit() else 0


def alloc_restarts(environ: Mapping[str, str]) -> int:
    """``DDP_HPC_ALLOC_RESTARTS`` as a number (0 when unset or not a plain number)."""
    raw = environ.get(ALLOC_RESTARTS_VAR, "").strip()
    return int(raw) if raw.isdigit() else 0


def _digits(value: str | None, default: int) -> int:
    m = re.search(r"(\d+)\s*$", value or "")
    return int(m.group(1)) if m else default


def job_key(environ: Mapping[str, str]) -> str | None:
    """``ARRAYJOB_TASK`` inside a job array, the plain job id otherwise, None outside Slurm: the key
    of a job's port, staging markers and record (array tasks share SLURM_JOB_ID's neighbours)."""
    array_job, array_task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and array_task:
        return f"{array_job}_{array_task}"
    return environ.get("SLURM_JOB_ID") or None


def job_facts(environ: Mapping[str, str] | None = None) -> JobFacts:
    env = os.environ if environ is None else environ
    restart, base, alloc = env.get("SLURM_RESTART_COUNT", ""), restart_base(env), alloc_restarts(env)
    return JobFacts(
        job_id=env.get("SLURM_JOB_ID") or None, key=job_key(env),
        restart_count=base + (int(restart) if restart.isdigit() else 0) + alloc,
        end_time=to_float(env.get("SLURM_JOB_END_TIME")) or to_float(env.get("DDP_HPC_JOB_END_TIME")),
        node_tmpdir=env.get("SLURM_TMPDIR") or None, tmpdir=env.get("TMPDIR") or None,
        log_dir=env.get("DDP_HPC_LOG_DIR") or None, cluster=env.get("SLURM_CLUSTER_NAME", ""),
        name=env.get("SLURM_JOB_NAME") or None,
        num_nodes=_digits(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES"), 1),
        gpus_per_node=_digits(env.get("SLURM_GPUS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE"), 1),
        submit_dir=env.get("SLURM_SUBMIT_DIR") or None,
        preempt_signal=env.get("DDP_HPC_PREEMPT_SIGNAL") or None,
        node_list=env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or None,
        exclude_failed_nodes=env.get("DDP_HPC_EXCLUDE_FAILED_NODES", "1").strip().lower()
        not in ("0", "false", "no", "off"),
        restart_base=base, alloc_restarts=alloc,
        cpus_per_task=_digits(env.get("SLURM_CPUS_PER_TASK"), 0) or None,
        step_id=env.get("SLURM_STEP_ID") if (env.get("SLURM_STEP_ID") or "").isdigit() else None,
        memory_mb=_memory_mb(env),
    )


def _memory_mb(env: Mapping[str, str]) -> int | None:
    per_node = _digits(env.get("SLURM_MEM_PER_NODE"), 0)
    per_cpu = _digits(env.get("SLURM_MEM_PER_CPU"), 0) * _digits(env.get("SLURM_CPUS_ON_NODE"), 0)
    return per_node or per_cpu or None
