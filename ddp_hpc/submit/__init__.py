"""Submission: a job config, a script or a function and the Slurm options -> one checked
``JobSpec`` (spec, target) -> an sbatch script (render, pure), submitit or sbatch on Slurm
(slurm), or N x G processes here (local), handed over by dispatch; waiting for the end (wait);
the ``ddp-hpc submit`` command (cli); the Python API (api).

This package is also callable: ``ddp_hpc.submit(fn_or_command, nodes=2, gpus=4, ...)`` is
``ddp_hpc.submit.api.submit``. The name must stay this package (``python -m ddp_hpc.submit``,
``ddp_hpc.submit.cli``); ``ddp_hpc`` itself keeps its attribute ``submit`` the function for
``help()`` and ``inspect.signature``, with this package's modules as its other attributes.
"""

import sys
import types


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        from ddp_hpc.submit.api import submit

        return submit(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
