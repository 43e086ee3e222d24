"""Resuming by submitting again: the same ``ddp-hpc submit`` of a config (the same config file,
overrides, sweep and backend, logs under the same log.dir) finds the job record of its earlier
run and, when that run stopped before completing and left a checkpoint, submits into the same run
directory, where the training core resumes from the newest checkpoint.

- the earlier run is the newest record with the same backend, config, overrides, array tasks and
  log root, whose resolved config (its ``config.yaml``, the Slurm section aside) is the one this
  submission trains with;
- interrupted, preempted, cancelled or failed with a checkpoint: resumed (one line says so);
- completed: a new run (one line says so); ``ddp-hpc run`` in a completed directory trains nothing;
- stopped before its first checkpoint: a new run;
- still queued or running, or this machine cannot tell (squeue does not answer, the job was
  submitted on another Slurm cluster, the processes were recorded on another host): refused
  (wait, cancel it, or ``--fresh``); a final state the record keeps is not trusted for a Slurm
  job (a requeued job runs again after it was kept);
- ``--fresh``: always a new run directory; the earlier one is never removed.

A resumed run's restart numbers follow the earlier run's (``JobSpec.restart_base``: one past the
highest restart number in the earlier run's event files; the backends pass it on as
``DDP_HPC_RESTART_BASE``), so its events, and ``ddp-hpc status``, keep the two apart.

Script and module jobs are not resumed this way: their checkpoints live where the script puts
them, and each submission gets its own run directory.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Sequence

import yaml

from ddp_hpc import records
from ddp_hpc.backends.base import Backend
from ddp_hpc.backends.spec import JobSpec, SpecError
from ddp_hpc.config import JobConfig, config_to_dict
from ddp_hpc.judge.reader import RunEnding, RunLogs, run_ending
from ddp_hpc.runlogs.schema import CONFIG_FILE

__all__ = ["earlier_run", "next_restart", "resume_or_new"]


def _task_overrides(spec: JobSpec) -> list[list[str]] | None:
    return [list(t.overrides) for t in spec.tasks] if spec.is_array else None


def _task_dirs(rec: records.JobRecord) -> list[str]:
    return [str(t.get("log_dir")) for t in rec.array] if rec.array else [rec.log_dir]


def _training_part(raw: object) -> str:
    """A resolved config as comparable text, without its Slurm section (options may change)."""
    d = dict(raw) if isinstance(raw, dict) else {}
    d.pop("slurm", None)
    return json.dumps(d, sort_keys=True, default=str)


def _same_training(rec: records.JobRecord, task_cfgs: Sequence[JobConfig]) -> bool:
    for log_dir, cfg in zip(_task_dirs(rec), task_cfgs):
        try:
            saved = yaml.safe_load((Path(log_dir) / CONFIG_FILE).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            return False
        ours = yaml.safe_load(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        if _training_part(saved) != _training_part(ours):
            return False
    return True


def earlier_run(spec: JobSpec, backend: Backend) -> records.JobRecord | None:
    """The newest record of a submission of the same config job (see the module's docstring)."""
    root = str(Path(spec.log_dir).parent)
    for rec in reversed(records.list_records()):
        if (rec.backend == backend.name and rec.config == spec.config and rec.command is None
                and list(rec.overrides) == list(spec.overrides)
                and ([list(t.get("overrides", ())) for t in rec.array] if rec.array else None)
                == _task_overrides(spec)
                and str(Path(rec.log_dir).parent) == root):
            return rec
    return None


def _refuse_if_live(rec: records.JobRecord, backend: Backend) -> None:
    """Refuse to resume into the earlier run's directory while its job may still run: queued or
    running, or when this machine cannot tell (the backend says why: squeue did not answer, the
    job was submitted on another cluster, its processes were recorded on another host): two
    jobs must never write into one run directory."""
    live, why = backend.active(rec)
    if live is False:
        return
    hint = (f"wait for it (ddp-hpc status {rec.id}), cancel it (ddp-hpc cancel {rec.id}), or pass "
            "--fresh for a separate new run")
    if live:
        raise SpecError(f"the earlier run of this config, job {rec.id} ({rec.log_dir}), is still "
                        f"queued or running", hint)
    raise SpecError(f"cannot tell whether the earlier run of this config, job {rec.id} "
                    f"({rec.log_dir}), still runs ({why}), so it is not resumed", hint)


def _steps(ends: Sequence[RunEnding]) -> str:
    if len(ends) == 1:
        return f"step {ends[0].checkpoint_step}"
    return "steps " + ", ".join("-" if e.checkpoint is None else str(e.checkpoint_step) for e in ends)


def resume_or_new(spec: JobSpec, backend: Backend, task_cfgs: Sequence[JobConfig], *, fresh: bool,
                  say: Callable[[str], None]) -> JobSpec:
    """``spec`` itself (a new run directory), or ``spec`` moved into the run directory of the
    earlier run it resumes; says which in one line whenever an earlier run exists."""
    rec = earlier_run(spec, backend)
    if rec is None:
        return spec
    name = Path(rec.log_dir).name
    if fresh:
        say(f"starting a new run (--fresh); the earlier run {name} stays in {rec.log_dir}")
        return spec
    _refuse_if_live(rec, backend)
    ends = [run_ending(d) for d in _task_dirs(rec)]
    if all(e.status == "completed" for e in ends):
        say(f"the earlier run {name} of this config completed (step {ends[0].step}, "
            f"{rec.log_dir}); starting a new run")
        return spec
    if not any(e.checkpoint for e in ends):
        say(f"the earlier run {name} stopped before its first checkpoint; starting a new run")
        return spec
    if not _same_training(rec, task_cfgs):
        say(f"the config file changed since the earlier run {name}; starting a new run")
        return spec
    say(f"resuming run {name} from its checkpoint at {_steps(ends)}; --fresh starts over")
    return _moved(spec, rec)


def next_restart(log_dirs: Sequence[str]) -> int:
    """One past the highest restart number in the event files of ``log_dirs`` (0 without any):
    where a resumed run's restart numbers start, in every task's directory."""
    return 1 + max((r for d in log_dirs for r in RunLogs(d).restarts()), default=-1)


def _moved(spec: JobSpec, rec: records.JobRecord) -> JobSpec:
    """``spec`` with the earlier run's directories (the same layout: ``task<i>`` per task) and
    restart numbers after the earlier run's."""
    dirs = _task_dirs(rec)
    tasks = tuple(dataclasses.replace(t, log_dir=d) for t, d in zip(spec.tasks, dirs, strict=True))
    return dataclasses.replace(spec, log_dir=rec.log_dir, tasks=tasks, restart_base=next_restart(dirs))
