"""The Slurm backends (submitit, rendered sbatch), the checks that run before anything is
submitted, and waiting for a job to end.

Why checks here and not left to sbatch: sbatch's own refusals ("Requested node configuration is
not available", "invalid partition specified") do not say which value was wrong or what would
work; sinfo does, so the request is compared against it first and the error names the fix.

Why clean SLURM_* first: a submission made from inside another job (an salloc shell, a batch
script that chains jobs) inherits that job's SLURM_* variables, and sbatch/srun read many of them
as defaults (SLURM_MEM_PER_NODE, SLURM_NTASKS, SLURM_CPUS_PER_TASK...), silently changing the new
job. Only SLURM_CONF (which cluster to talk to) is kept.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from ddp_hpc.submit.spec import JobSpec, SpecError, time_to_seconds
from ddp_hpc.fsutil import atomic_write_text

__all__ = ["clean_slurm_env", "cleaned_environ", "check_against_cluster", "submitit_parameters",
           "submit_submitit", "submit_sbatch", "wait_for_jobs", "run_verdict", "run_task"]

KEEP_SLURM = frozenset({"SLURM_CONF"})


def clean_slurm_env(environ: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """A copy without an enclosing job's SLURM_* / SRUN_* variables; also returns their names."""
    removed = sorted(k for k in environ
                     if (k.startswith("SLURM_") and k not in KEEP_SLURM) or k.startswith("SRUN_"))
    return {k: v for k, v in environ.items() if k not in removed}, removed


@contextlib.contextmanager
def cleaned_environ() -> Iterator[list[str]]:
    """Remove SLURM_* from os.environ while submitit runs sbatch (it inherits this process's
    environment), and put them back afterwards."""
    clean, removed = clean_slurm_env(os.environ)
    saved = {k: os.environ[k] for k in removed}
    for k in removed:
        del os.environ[k]
    try:
        yield removed
    finally:
        os.environ.update(saved)


def check_against_cluster(spec: JobSpec, partitions: Sequence[Mapping[str, Any]]) -> str:
    """Refuse what sinfo says cannot run; returns the partition the job will use."""
    if not partitions:
        raise SpecError("sinfo lists no partitions (--partition).\nHINT: ask the admins which "
                        "partition to use; `sinfo` should list it.")
    names = [p["name"] for p in partitions]
    if spec.partition is not None:
        match = [p for p in partitions if p["name"] == spec.partition]
        if not match:
            raise SpecError(f"partition {spec.partition!r} does not exist on this cluster "
                            f"(--partition / slurm.partition).\nHINT: use one of "
                            f"{', '.join(names)} (sinfo lists them)")
        part = match[0]
    else:
        defaults = [p for p in partitions if p.get("default")]
        if not defaults:
            raise SpecError(f"no --partition given and the cluster has no default partition.\n"
                            f"HINT: pass --partition with one of {', '.join(names)}")
        part = defaults[0]
    max_gpus = int(part.get("gpus_per_node") or 0)
    if spec.gpus_per_node > max_gpus:
        others = [f"{p['name']} ({p.get('gpus_per_node', 0)} GPUs)" for p in partitions
                  if int(p.get("gpus_per_node") or 0) >= spec.gpus_per_node]
        raise SpecError(
            f"--gpus {spec.gpus_per_node} asks for more GPUs per node than any node of partition "
            f"{part['name']!r} has (at most {max_gpus}, from sinfo).\nHINT: use --gpus "
            f"{max_gpus} or less and more --nodes"
            + (f", or a partition with more: {', '.join(others)}" if others else ""))
    if spec.nodes > int(part.get("nodes") or 0):
        raise SpecError(
            f"--nodes {spec.nodes} is more than partition {part['name']!r} has "
            f"({part.get('nodes')} nodes, from sinfo).\nHINT: use --nodes {part.get('nodes')} or "
            f"fewer")
    return part["name"]


# ----------------------------------------------------------------------------- submitit
def run_task(config: str, overrides: list[str], log_dir: str) -> int:
    """What every submitit task runs: ``ddp_hpc.run`` in-process with the job's log directory.
    (Module-level so submitit pickles it by reference.)"""
    os.environ["DDP_HPC_LOG_DIR"] = log_dir
    from ddp_hpc import run
    try:
        rc = run.main([config, *overrides])
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    if rc:
        raise RuntimeError(f"python -m ddp_hpc.run exited with status {rc}; see {log_dir}")
    return 0


def submitit_parameters(spec: JobSpec) -> dict[str, Any]:
    """The SlurmExecutor parameters for ``spec`` (what --dry-run shows for this backend)."""
    rank_out = (f"{spec.log_dir}/task%a/rank%t.out" if spec.is_array
                else f"{spec.log_dir}/rank%t.out")
    extra: dict[str, Any] = {
        "time": spec.time,                           # keeps D-HH:MM:SS; submitit wants minutes
        "signal": f"{spec.signal}@{spec.grace_s}",   # submitit's default is USR2@90
        "requeue": True,
    }
    extra.update({k: v for k, v in spec.sbatch_args})
    params: dict[str, Any] = {
        "job_name": spec.name, "nodes": spec.nodes, "ntasks_per_node": spec.tasks_per_node,
        "gpus_per_node": spec.gpus_per_node, "cpus_per_task": spec.cpus_per_task,
        "signal_delay_s": spec.grace_s,
        "setup": [f"export SRUN_CPUS_PER_TASK={spec.cpus_per_task}",
                  f"cd {_q(spec.workdir)}"],
        "srun_args": ["--kill-on-bad-exit=1", "--open-mode=append", f"--output={rank_out}",
                      f"--error={rank_out}"],
        "additional_parameters": extra,
    }
    for key in ("partition", "account", "qos", "mem", "constraint", "dependency"):
        if getattr(spec, key) is not None:
            params[key] = getattr(spec, key)
    if spec.exclusive:
        params["exclusive"] = True
    return params


def _q(s: str) -> str:
    import shlex
    return shlex.quote(s)


def submit_submitit(spec: JobSpec) -> list[str]:
    """Submit through submitit; returns the job ids (``123`` or ``123_0``, ``123_1`` ...)."""
    import submitit

    ex = submitit.SlurmExecutor(folder=spec.log_dir, max_num_timeout=1000)
    ex.update_parameters(**submitit_parameters(spec))
    with cleaned_environ():
        if spec.is_array:
            ex.update_parameters(array_parallelism=len(spec.tasks))
            jobs = ex.map_array(run_task, [spec.config] * len(spec.tasks),
                                [list(spec.overrides) + list(t.overrides) for t in spec.tasks],
                                [t.log_dir for t in spec.tasks])
        else:
            jobs = [ex.submit(run_task, spec.config, list(spec.overrides), spec.log_dir)]
    return [str(j.job_id) for j in jobs]


# ----------------------------------------------------------------------------- sbatch
def submit_sbatch(spec: JobSpec, script_text: str, cli) -> tuple[str, Path]:
    """Write the script into the log directory (kept for the record) and submit it."""
    path = Path(spec.log_dir) / "job.sbatch"
    atomic_write_text(path, script_text)
    job_id = cli.sbatch(script_text, cwd=spec.workdir)
    return job_id, path


# ----------------------------------------------------------------------------- waiting
def _state_of(row: Mapping[str, str]):
    from ddp_hpc.slurm.states import parse_state
    return parse_state(row.get("State"))


def wait_for_jobs(cli, job_id: str, timeout: float | None = None, interval: float = 2.0,
                  echo=print, progress=None, progress_every: float = 15.0,
                  unlisted_grace: float = 60.0) -> dict[str, str]:
    """Poll squeue (sbatch --wait notices the end late) until every task of ``job_id`` is in a
    terminal state; one line per state change, and ``progress()`` (e.g. rank 0's latest step)
    every ``progress_every`` seconds while it changes. Returns {job or task id: final state}."""
    start, last, seen = time.monotonic(), None, {}
    last_progress, last_progress_t = None, 0.0
    while True:
        rows = cli.squeue([job_id])
        states = {r["JobArrayID"]: _state_of(r) for r in rows}
        seen.update({k: v.label for k, v in states.items()})
        line = ", ".join(f"{k} {v.label}" for k, v in sorted(states.items()))
        if line != last and line:
            echo(f"ddp_hpc: {line}")
            last = line
        if states and all(s.state.terminal for s in states.values()):
            return seen
        if not rows and (seen or time.monotonic() - start > unlisted_grace):
            return seen    # gone from squeue (MinJobAge passed): last known states
        now = time.monotonic()
        if progress is not None and now - last_progress_t >= progress_every:
            text = progress()
            if text and text != last_progress:
                echo(f"ddp_hpc: {text}")
                last_progress = text
            last_progress_t = now
        if timeout is not None and now - start > timeout:
            raise TimeoutError(f"job {job_id} still not finished after {timeout:.0f} s "
                               f"(states: {line or 'not listed'})")
        time.sleep(interval)


def latest_step(log_dirs: Sequence[str | os.PathLike]) -> str | None:
    """``task0 step 40/87 loss 1.23`` from the newest step event of rank 0 of each log dir."""
    parts = []
    for d in log_dirs:
        p = Path(d) / "rank0.events.jsonl"
        try:
            with open(p, "rb") as f:
                f.seek(max(0, p.stat().st_size - 8192))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            continue
        for line in reversed(lines):
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("event") in ("step", "epoch", "end"):
                loss = ev.get("loss")
                label = f"{Path(d).name} " if len(log_dirs) > 1 else ""
                parts.append(f"{label}step {ev.get('step')}/{ev.get('total_steps', '?')}"
                             + (f" loss {loss:.4g}" if isinstance(loss, (int, float)) else "")
                             + (f" ({ev.get('status')})" if ev["event"] == "end" else ""))
                break
    return ", ".join(parts) or None


def run_verdict(log_dir: str | os.PathLike, world_size: int) -> tuple[bool, str]:
    """From the run logs: did every rank write ``end`` with status completed?"""
    d = Path(log_dir)
    ends: dict[int, str] = {}
    for r in range(world_size):
        p = d / f"rank{r}.events.jsonl"
        try:
            lines = p.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict) and ev.get("event") == "end":
                ends[r] = str(ev.get("status"))
    done = [r for r, s in ends.items() if s == "completed"]
    if len(done) == world_size:
        return True, f"all {world_size} ranks completed"
    missing = [r for r in range(world_size) if r not in ends]
    bad = {r: s for r, s in ends.items() if s != "completed"}
    parts = []
    if bad:
        parts.append("ended " + ", ".join(f"rank {r}: {s}" for r, s in sorted(bad.items())))
    if missing:
        parts.append(f"no end event from ranks {missing}")
    return False, "; ".join(parts) + f" (logs in {d})"


def minutes(spec: JobSpec) -> int:
    return max(1, time_to_seconds(spec.time) // 60)
