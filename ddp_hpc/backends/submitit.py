"""The ``submitit`` backend: Slurm through submitit's executor (``ddp_hpc.backends.slurmjob``: its
parameters, what each task calls). It also takes a Python function as the job: submitit pickles
it, and every rank runs it under ``ddp_hpc.backends.functions.rank_entry``."""

from __future__ import annotations

import json
from typing import Any, Callable

from ddp_hpc.backends import slurmjob
from ddp_hpc.backends.base import Plan, Submitted, cleaned_environ, make_run_dirs, record
from ddp_hpc.backends.functions import rank_entry
from ddp_hpc.backends.onslurm import SlurmBackend, cluster_of
from ddp_hpc.backends.spec import JobSpec
from ddp_hpc.data.scriptstage import encode_items

__all__ = ["SubmititBackend"]


class SubmititBackend(SlurmBackend):
    name = "submitit"
    takes_functions = True

    def dry_run_text(self, spec: JobSpec) -> str:
        calls = [{"task_id": t.task_id, "function": f"{fn.__module__}.{fn.__name__}", "args": fargs}
                 for t, (fn, fargs) in zip(spec.tasks, slurmjob.submitit_calls(spec))]
        return json.dumps({"executor": "submitit.SlurmExecutor",
                           "folder": str(slurmjob.submitit_folder(spec)),
                           "parameters": slurmjob.submitit_parameters(spec), "calls": calls},
                          indent=2) + "\n"

    def queue(self, plan: Plan) -> tuple[str, str | None]:
        """Submit through submitit's executor (an array for a sweep: ids ``123_0``, ``123_1``
        ...); the job id and the batch script submitit wrote."""
        import submitit

        spec = plan.spec
        ex = submitit.SlurmExecutor(folder=slurmjob.submitit_folder(spec), max_num_timeout=1000)
        ex.update_parameters(**slurmjob.submitit_parameters(spec))
        calls = slurmjob.submitit_calls(spec)
        fn = calls[0][0]
        with cleaned_environ():
            if spec.is_array:
                ex.update_parameters(array_parallelism=len(spec.tasks))
                jobs = ex.map_array(fn, *(list(col) for col in zip(*(args for _, args in calls))))
            else:
                jobs = [ex.submit(fn, *calls[0][1])]
        job_id = str(jobs[0].job_id).split("_")[0]
        return job_id, slurmjob.submitit_script(spec, job_id)

    def submit_function(self, spec: JobSpec, fn: Callable, args: tuple, kwargs: dict) -> Submitted:
        import submitit

        self.check(spec, False)
        make_run_dirs(spec, None)
        ex = submitit.SlurmExecutor(folder=slurmjob.submitit_folder(spec), max_num_timeout=1000)
        ex.update_parameters(**slurmjob.submitit_parameters(spec))
        with cleaned_environ():
            sjob: Any = ex.submit(rank_entry, fn, args, kwargs, spec.log_dir, encode_items(spec.stage))
        rec = record(spec, str(sjob.job_id), self, cluster_of(self.client),
                     script=slurmjob.submitit_script(spec, str(sjob.job_id)))
        return Submitted(rec, handles={"submitit_job": sjob})
