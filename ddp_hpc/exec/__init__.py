"""Run a user's own training script as one rank of a distributed job: ``python -m ddp_hpc.exec``.

    srun python -m ddp_hpc.exec -- python train.py --lr 0.1          # every rank, any launcher
    ddp_hpc.exec.run(["python", "train.py"], log_dir)                  # in-process (a submitit task)

Modules: ``wrapper`` (the command line, the torchrun variables, signals, the child's exit status),
``outcome`` (how the child ended, in run-log words), ``events`` (a run log that never raises),
``instrumented`` (torchrun's other variables, the flight recorder, ``ddp_hpc.instrument`` in a
Python child, and what it leaves: the exit record, the fault file, the elastic error file).
The script-side helpers are ``ddp_hpc.preemption``, ``ddp_hpc.checkpoint`` and ``ddp_hpc.report``;
docs/scripts.md describes the whole contract.
"""

from ddp_hpc.exec.wrapper import FORWARDED, main, run
from ddp_hpc.exits import EX_TEMPFAIL

__all__ = ["EX_TEMPFAIL", "FORWARDED", "main", "run"]
