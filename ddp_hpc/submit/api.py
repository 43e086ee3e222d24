"""``ddp_hpc.submit_job(...)`` from Python, submitit-like: submit a function or a command as a DDP
job and get a handle back.

    import ddp_hpc
    job = ddp_hpc.submit_job(train, args=(cfg,), nodes=2, gpus=4, time="02:00:00", partition="gpu")
    job.job_id, job.state()        # "PENDING", "RUNNING", "COMPLETED", "FAILED", ...
    value = job.result()           # rank 0's return value; the first failing rank's error raised
    job = ddp_hpc.submit_job(["train.py", "--lr", "0.1"], nodes=2, gpus=4)   # a script, as the CLI

A function runs on every rank with torchrun's variables set (``ddp_hpc.backends.functions``),
through a backend that takes functions (submitit on Slurm, local processes here); a command goes
the way ``ddp-hpc submit`` sends it (``dispatch``, any backend). Backend ``auto`` picks as the CLI does. The
Slurm keywords are the fields of ``ddp_hpc.config.SlurmOptions`` (``time``, ``partition``,
``account``, ``qos``, ``mem``, ``cpus_per_task``, ``signal``, ``sbatch_args``, ...), checked the same
way; every job leaves a record, so ``ddp-hpc status`` lists it.
"""

from __future__ import annotations

import dataclasses
import pickle
import shlex
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ddp_hpc import backends
from ddp_hpc.backends.base import GRACE_S, Backend, SubmitOptions, say
from ddp_hpc.backends.functions import describe
from ddp_hpc.backends.spec import SpecError, build_command_spec, stage_items
from ddp_hpc.config import SlurmOptions
from ddp_hpc.config.slurm_options import merged
from ddp_hpc.judge.reader import RunLogs
from ddp_hpc.launch import RankFailedError
from ddp_hpc.slurm.states import JobState
from ddp_hpc.submit.target import script_command

__all__ = ["submit_job", "Job"]


class Job:
    """A submitted job: ``job_id``, ``log_dir``, ``backend`` (the ``Backend``; ``str()`` is its
    name: local, submitit or sbatch) and
    ``backend_reason`` (why: asked for, or what ``auto`` found), ``record``; ``state()``,
    ``done()``, ``wait()``, ``result()``, ``cancel()``."""

    def __init__(self, record, *, submitit_job=None, driver=None, conn=None,
                 backend: Backend | None = None, backend_reason: str = "") -> None:
        self.record = record
        self.job_id: str = str(record.id)
        self.log_dir: str = record.log_dir
        self.backend: Backend = backend or backends.of_record(record)
        self.backend_reason: str = backend_reason
        self._submitit, self._driver, self._conn = submitit_job, driver, conn
        self._message: tuple | None = None
        self._cancelled = False

    def __repr__(self) -> str:
        return f"Job({self.job_id!r}, backend={self.backend.name!r}, log_dir={self.log_dir!r})"

    def _received(self) -> tuple | None:
        """The local driver's message, once it sent one."""
        if self._message is None and self._conn is not None and self._conn.poll():
            try:
                self._message = self._conn.recv()
            except EOFError:
                code = self._driver.exitcode if self._driver is not None else None
                self._message = ("err", RankFailedError(
                    -1, "DriverDied", f"the local driver process ended (exit code {code}) without "
                    "a result; when a script calls ddp_hpc.submit_job() at module level, put the call "
                    "under `if __name__ == '__main__':` (the new processes import that script "
                    "again)", exitcode=code))
        return self._message

    def state(self) -> str:
        """The job's state name (``ddp_hpc.slurm.states.JobState``), as ``ddp-hpc status``
        derives it (the scheduler, the processes, the run logs)."""
        if self._driver is not None:
            if self._cancelled:
                return JobState.CANCELLED.value
            msg = self._received()
            if msg is None:
                return JobState.RUNNING.value if self._driver.is_alive() else JobState.FAILED.value
            return JobState.COMPLETED.value if msg[0] == "ok" else JobState.FAILED.value
        from ddp_hpc.slurm.query import slurm_cli
        from ddp_hpc.status.collect import collect
        from ddp_hpc.status.targets import targets_from_records

        return collect(targets_from_records([self.record]), *slurm_cli())[0].state_name

    def done(self) -> bool:
        return JobState[self.state()].terminal

    def wait(self, timeout: float | None = None, poll: float = 2.0) -> str:
        """Block until the job ends; returns its final state. TimeoutError after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            state = self.state()
            if JobState[state].terminal:
                return state
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.job_id} still {state} after {timeout:g} s")
            if self._conn is not None:
                self._conn.poll(poll)
            else:
                time.sleep(poll)

    def result(self, timeout: float | None = None) -> Any:
        """Rank 0's return value (a function job; 0 for a command that completed). Raises
        ``ddp_hpc.launch.RankFailedError`` for the first failing rank, from the run logs."""
        state = self.wait(timeout)
        msg = self._received()
        if msg is not None:
            if msg[0] == "ok":
                return pickle.loads(msg[1])  # noqa: S301 - our own driver's bytes, this machine
            raise msg[1]
        if state == JobState.COMPLETED.value:
            return self._submitit.task(0).result() if self._submitit is not None else 0
        raise self._failure(state)

    def _failure(self, state: str) -> RankFailedError:
        logs = RunLogs(self.log_dir)
        f = logs.first_failure(assume_failed=True)
        if f is None:
            return RankFailedError(-1, state, f"job {self.job_id} ended {state}; no rank left an "
                                   f"error in {self.log_dir}")
        tb = f.traceback_tail
        tb = "\n".join(tb) if isinstance(tb, (list, tuple)) else str(tb or "")
        return RankFailedError(f.rank, str(f.exc_type or f.kind or state),
                               str(f.message or f.summary or state), tb)

    def cancel(self, grace: float = GRACE_S) -> None:
        """Stop the job: scancel a Slurm job, or every local process (SIGTERM, SIGKILL after
        ``grace`` seconds); its record and ``ddp-hpc status`` then say CANCELLED."""
        self._cancelled = True
        self.backend.cancel(self.record, self.job_id, grace)
        if self._driver is not None:
            self._driver.join(timeout=10)


def _options(nodes: int, gpus: int, backend: str, slurm: Mapping[str, Any]) -> SlurmOptions:
    unknown = sorted(set(slurm) - set(SlurmOptions.__dataclass_fields__))
    if unknown:
        raise SpecError(f"ddp_hpc.submit_job() got unknown keywords {unknown}",
                        f"use the SlurmOptions fields: {', '.join(SlurmOptions.__dataclass_fields__)}")
    return merged(SlurmOptions(), {"nodes": nodes, "gpus_per_node": gpus, "backend": backend, **slurm},
                  label=lambda name: f"ddp_hpc.submit_job({'gpus' if name == 'gpus_per_node' else name}=...)")


def _command(target: str | Sequence[str]) -> tuple[tuple[str, ...], str]:
    words = shlex.split(target) if isinstance(target, str) else [str(w) for w in target]
    if not words:
        raise SpecError("ddp_hpc.submit_job() got an empty command", "give e.g. ['train.py', '--lr', '0.1']")
    if words[0].endswith(".py"):
        return script_command(words[0], words[1:]), Path(words[0]).stem
    return tuple(words), Path(words[-1] if words[0].startswith("python") else words[0]).stem


def submit_job(target: Callable | str | Sequence[str], *, args: Sequence[Any] = (),
               kwargs: Mapping[str, Any] | None = None, nodes: int = 1, gpus: int = 1,
               backend: str = "auto", name: str | None = None, log_dir: str = "runs",
               **slurm: Any) -> Job:
    """Submit ``target`` (a function, or a command as a string or a list of words) as a DDP job of
    ``nodes`` x ``gpus`` ranks; returns a :class:`Job`. ``args``/``kwargs`` go to the function.

    ``backend``: ``"auto"`` (submitit when ``sbatch`` is on PATH and the controller answers, else
    ``"local"``: N x G processes on this machine), ``"submitit"``, ``"sbatch"`` (commands only) or
    ``"local"``; the choice and why are said in one line on stderr and kept as ``job.backend`` and
    ``job.backend_reason``. ``log_dir``: where the run directory goes. The other keywords are
    Slurm options, the fields of ``ddp_hpc.config.SlurmOptions`` (``time``, ``partition``,
    ``account``, ``qos``, ``mem``, ``cpus_per_task``, ``signal``, ``sbatch_args``, ...).
    ``stage=["/shared/train.lmdb", "/shared/hf=HF"]`` (``SRC`` or ``SRC=NAME``, as ``--stage``):
    copied once per node before the function or command starts; every rank finds the copy in
    ``$DDP_HPC_STAGE_<NAME>`` (``ddp_hpc.data.staged_path(NAME)``); removed after the job.

        job = ddp_hpc.submit_job(train, args=(cfg,), nodes=2, gpus=4, time="02:00:00")
        job.backend, job.job_id, job.state(), job.result()
    """
    opts = _options(nodes, gpus, backend, slurm)
    stage = stage_items([("ddp_hpc.submit_job(stage=...)", opts.stage)])   # before the backend is chosen, as --stage
    chosen, why = backends.choose(opts)
    say(f"backend {chosen.name}: {why}")
    opts = merged(opts, {"backend": chosen.name})
    if not callable(target):
        command, default_name = _command(target)
        spec = build_command_spec(opts, command=command, name=name or default_name, log_root=log_dir)
        done = backends.dispatch(dataclasses.replace(spec, stage=stage), chosen, SubmitOptions(quiet=True))
        return Job(done.record, backend=chosen, backend_reason=why)
    if not chosen.takes_functions:
        able = [n for n in backends.names() if backends.get(n).takes_functions]
        raise SpecError(f"a Python function cannot go through backend={chosen.name!r} (it cannot "
                        "carry a function)", f"use backend={' or '.join(map(repr, able))} or 'auto' "
                        "(or submit a script)")
    spec = build_command_spec(opts, command=[f"<function {describe(target)}>"],
                              name=name or getattr(target, "__name__", "function"), log_root=log_dir)
    spec = dataclasses.replace(spec, stage=stage)
    backends.check_options(spec, chosen)
    done = chosen.submit_function(spec, target, tuple(args), dict(kwargs or {}))
    return Job(done.record, backend=chosen, backend_reason=why, **done.handles)
