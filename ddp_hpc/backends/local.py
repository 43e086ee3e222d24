"""The ``local`` backend: the job as N pretend nodes x G processes on this machine (gloo on the
CPU, or one GPU per rank). A command or config job goes to the local driver
(``ddp_hpc.backends.localdriver``: in the foreground with ``--wait``, else detached), a Python function to
``ddp_hpc.backends.functions.local_driver`` in a child process with a pipe back to its handle. Its
jobs' processes are in the record (``pids``, ``pid_times``): whether the job still runs and how it
is cancelled are read from them."""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import pickle
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ddp_hpc import records
from ddp_hpc.backends import localdriver as driver
from ddp_hpc.backends.base import (
    CancelError,
    Described,
    Plan,
    SubmitOptions,
    Submitted,
    clean_slurm_env,
    make_run_dirs,
    record,
    removed_note,
    say,
)
from ddp_hpc.backends.functions import describe, local_driver
from ddp_hpc.backends.spec import JobSpec, SpecError
from ddp_hpc.config import JobConfig
from ddp_hpc.data.scriptstage import encode_items
from ddp_hpc.env import host_gpus
from ddp_hpc.env.job import RESTART_BASE_VAR
from ddp_hpc.exits import signal_name
from ddp_hpc.fsutil import atomic_write_json
from ddp_hpc.launch.tree import (
    LaunchError,
    pretend_node_gpus,
    recorded_alive,
    recorded_processes,
    start_time,
    stop_processes,
    unrecorded_pids,
)
from ddp_hpc.runlogs.schema import LOCAL_DRIVER_OUT
from ddp_hpc.slurm.states import JobState, parse_state
from ddp_hpc.text import plural, prog, shown_path

__all__ = ["LocalBackend", "CANCEL", "check_gpus", "write_plan", "start_detached"]

PLAN_NAME = "local-plan.json"

#: the ``source`` of the final states `cancel` keeps in the record
CANCEL = "ddp-hpc cancel"


def _job_id(spec: JobSpec) -> str:
    return f"local-{Path(spec.log_dir).name}"


class LocalBackend:
    """N pretend nodes x G processes here (module docstring). It has no scheduler to ask: a job's
    processes, recorded with their start times, say whether it runs."""

    name = "local"
    describes_with = "local"
    runs_here = True
    takes_functions = True
    takes_node_range = True       # runs the most of the range
    takes_container = False
    restarts_in_allocation = False
    devices_here = True
    #: why no Slurm controller answered when `backends.choose` fell back to this backend
    unreachable: str | None = None

    def __init__(self, client: Any = None, offline: str | None = None) -> None:
        """No client to hold: ``client`` and ``offline`` are a scheduler's, taken as every
        backend takes them."""

    def __repr__(self) -> str:
        return "<local backend>"

    def __str__(self) -> str:
        return self.name

    def check(self, spec: JobSpec, dry_run: bool) -> None:
        if isinstance(spec.options.nodes, str):
            say(f"--nodes {spec.options.nodes}: the local backend runs the most, "
                f"{plural(spec.nodes, 'pretend node')}")
        check_gpus(spec, clean_slurm_env(os.environ)[0])

    def plan(self, spec: JobSpec, task_cfgs: Sequence[JobConfig] | None) -> Plan:
        env, removed = clean_slurm_env(os.environ)
        if spec.is_command:
            env["DDP_HPC_PREEMPT_SIGNAL"] = spec.signal
        env.update(spec.stage_environ())   # --stage: what each pretend node copies first
        if spec.restart_base:   # resumes a stopped run: its restart numbers follow that run's
            env[RESTART_BASE_VAR] = str(spec.restart_base)
        return Plan(spec, functools.partial(_launcher_lines, spec), env, tuple(removed),
                    None if task_cfgs is None else tuple(task_cfgs))

    def submit(self, plan: Plan, opts: SubmitOptions) -> Submitted:
        spec, job_id = plan.spec, _job_id(plan.spec)
        if plan.removed:
            say(removed_note(plan.removed))
        make_run_dirs(spec, plan.task_cfgs)
        rec = record(spec, job_id, self, socket.gethostname())
        path = write_plan(spec, job_id, record_id=job_id,
                                 ddp_hpc_home=os.environ.get("DDP_HPC_HOME"))
        say(f"job {job_id}: {plural(spec.world_size, 'process')} "
            f"({plural(spec.nodes, 'pretend node')} x {spec.gpus_per_node})")
        say(f"logs in {shown_path(spec.log_dir)}")
        if opts.wait:
            rc = driver.run_plan(path, follow=True, env=plan.env, announce=False)
            words = driver.ending_words(rc)
            if len(spec.tasks) > 1 or not words.startswith("failed"):   # a failed run's last
                say(f"job {job_id} {words}")                            # lines: its first failure
            return Submitted(rec, rc)
        rec.pids = [start_detached(path, plan.env, spec.python)]
        rec.pid_times = [start_time(rec.pids[0])]
        records.update_record(rec)
        say(f"started in the background (driver pid {rec.pids[0]}); follow it with "
            f"`{prog('status')} {job_id}`")
        if not opts.quiet:
            print(job_id, flush=True)
        return Submitted(rec)

    def submit_function(self, spec: JobSpec, fn: Callable, args: tuple, kwargs: dict) -> Submitted:
        self.check(spec, False)
        make_run_dirs(spec, None)
        job_id = _job_id(spec)
        rec = record(spec, job_id, self, socket.gethostname())
        ctx = mp.get_context("spawn")
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=local_driver, name=f"ddp_hpc-{job_id}",
                           args=(fn, args, kwargs, spec.log_dir, spec.nodes, spec.gpus_per_node,
                                 send, encode_items(spec.stage)))
        try:
            proc.start()
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise SpecError(f"cannot send {describe(fn)} or its arguments to a new process: {exc}",
                            "submit a function defined at module level, with picklable arguments") from exc
        send.close()
        rec.pids, rec.pid_times = [proc.pid], [start_time(proc.pid)]
        records.update_record(rec)
        return Submitted(rec, handles={"driver": proc, "conn": recv})

    def describe(self, jobs: Sequence[Any], history: bool = False,
                 only: str | None = None) -> dict[str, Described]:
        """Each job's recorded processes, alive or gone (None: recorded on another host, or not
        recorded), and where its driver wrote (named when it ended before its ranks wrote)."""
        out = {}
        for j in jobs:
            rec = j.record
            alive = recorded_alive(rec.pids, rec.pid_times, rec.cluster) if rec is not None else None
            notes = (("pids recorded on another host; state from the logs",)
                     if alive is None and rec is not None and rec.pids else ())
            output = str(Path(rec.log_dir) / LOCAL_DRIVER_OUT) if rec is not None and rec.log_dir else None
            out[j.id] = Described(False, alive=alive, notes=notes, output=output)
        return out

    def active(self, rec: records.JobRecord) -> tuple[bool | None, str]:
        """From the recorded processes (`ddp_hpc.launch.tree.recorded_alive`): None when they
        were recorded on another host, or none were recorded."""
        alive = recorded_alive(rec.pids, rec.pid_times, rec.cluster)
        why = "" if alive is not None else (f"its processes were recorded on {rec.cluster}, not here"
                                            if rec.pids else "its record keeps no processes")
        return alive, why

    def signal_ranks(self, rec: records.JobRecord | None, job_id: str, signum: int) -> str:
        """The signal to every recorded process of the job (the driver, each rank's group)."""
        pids = [p for p in ((rec.pids if rec is not None else None) or []) if isinstance(p, int)]
        sent = []
        for pid in pids:
            try:
                os.kill(pid, signum)
                sent.append(pid)
            except (ProcessLookupError, PermissionError):
                continue
        if not sent:
            raise CancelError(f"job {job_id}: none of its processes {pids} is running here",
                              "--stacks asks a running job; for an ended one see its logs")
        return f"{signal_name(signum)} to processes {', '.join(map(str, sent))}"

    def cancel(self, rec: records.JobRecord | None, job_id: str, grace: float) -> str:
        """Stop every process of the record that is still the one recorded (SIGTERM, SIGKILL
        after ``grace`` seconds) and keep CANCELLED as the final state of each run that had not
        ended. A pid recorded without a start time is never signalled."""
        if rec is None:
            raise CancelError(f"no job record with id {job_id!r}", f"check the id with `{prog('status')}`")
        if rec.id != job_id:
            raise CancelError(f"{job_id!r} names one task of the local job {rec.id}; the tasks of a "
                              "local sweep run one after another under one driver.",
                              f"cancel the whole job: `{prog('cancel')} {rec.id}`.")
        pids = [int(p) for p in rec.pids or []]
        procs = recorded_processes(pids, rec.pid_times)
        unknown = unrecorded_pids(pids, rec.pid_times)
        left = (f"; left alone {plural(len(unknown), 'pid')} recorded without a start time "
                f"({', '.join(map(str, unknown))}): whatever runs there now is not the job's"
                if unknown else "")
        if not procs:
            ended = _ended_state(rec)
            return (f"job {rec.id}: no process of it runs any more"
                    + (f" ({ended}); nothing to stop" if ended else "; nothing to stop") + left)
        ranks = [p.pid for p in procs if p.pid != pids[0]]
        killed = stop_processes(procs, grace, groups=ranks)
        _keep_cancelled(rec)
        how = (f", {plural(len(killed), 'process')} SIGKILLed after {grace:g} s" if killed
               else " (SIGTERM)")
        return f"job {rec.id}: CANCELLED, stopped {plural(len(procs), 'process')}{how}{left}"


def check_gpus(spec: JobSpec, environ: Mapping[str, str]) -> None:
    """Refuse a layout this machine's GPUs cannot hold, before anything starts: each pretend node
    takes ``--gpus`` GPUs of its own (``ddp_hpc.launch.tree.pretend_node_gpus``), so N x G must
    fit. A machine without a GPU runs any layout on the CPU (gloo)."""
    host = host_gpus(environ)
    try:
        pretend_node_gpus([spec.gpus_per_node] * spec.nodes, host)
    except LaunchError:
        n = len(host.ids)
        layout = f"--nodes {spec.nodes} --gpus {spec.gpus_per_node}"
        raise SpecError(
            f"{layout} asks the local backend for {spec.world_size} GPUs (one per rank), but this "
            f"machine has {plural(n, 'GPU')} ({host.source})",
            f"use --nodes 1 --gpus {n}" + (f" (or --nodes {n} --gpus 1: each pretend node takes "
                                           "GPUs of its own)" if n > 1 else "")
            + "; or run every rank on the CPU (gloo), any layout: CUDA_VISIBLE_DEVICES= "
              f"{prog('submit')} {layout} ...") from None


def write_plan(spec: JobSpec, job_id: str, record_id: str | None = None,
               ddp_hpc_home: str | None = None) -> Path:
    """One entry per run: argv, log dir, DDP_HPC_JOB_ID. Written atomically. The environment is
    not stored (it may hold secrets): the driver passes its own on to the ranks."""
    runs = []
    for task in spec.tasks:
        runs.append({
            "argv": spec.task_argv(task),
            "log_dir": task.log_dir,
            "job_id": job_id if task.task_id is None else f"{job_id}_{task.task_id}",
            "task_id": task.task_id,
        })
    plan = {"nodes": spec.nodes, "procs_per_node": spec.gpus_per_node, "runs": runs,
            "record_id": record_id, "workdir": spec.workdir, "ddp_hpc_home": ddp_hpc_home}
    path = Path(spec.log_dir) / PLAN_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_json(path, plan, indent=1)


def start_detached(plan_path: Path, env: Mapping[str, str], python: str = sys.executable) -> int:
    """Start the driver in its own session (it outlives this command); returns its pid."""
    out = Path(plan_path).parent / LOCAL_DRIVER_OUT
    with open(out, "ab") as f:
        proc = subprocess.Popen([python, "-m", "ddp_hpc.backends.localdriver", str(plan_path)],
                                env=dict(env), stdin=subprocess.DEVNULL, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return proc.pid


def _launcher_lines(spec: JobSpec) -> str:
    """What the local driver runs, as the equivalent launcher commands (the dry run)."""
    job_id = _job_id(spec)
    base = f"{RESTART_BASE_VAR}={spec.restart_base} " if spec.restart_base else ""
    base += "".join(f"{k}={shlex.quote(v)} " for k, v in spec.stage_environ().items())
    sig = f"DDP_HPC_PREEMPT_SIGNAL={spec.signal} " if spec.is_command else ""
    lines = []
    for t in spec.tasks:
        tid = job_id if t.task_id is None else f"{job_id}_{t.task_id}"
        lines.append(f"{sig}{base}DDP_HPC_LOG_DIR={shlex.quote(t.log_dir)} {shlex.quote(spec.python)} -m "
                     f"ddp_hpc.launch --nodes {spec.nodes} --procs-per-node {spec.gpus_per_node} "
                     f"--log-dir {shlex.quote(t.log_dir)} --job-id {tid} -- "
                     f"{shlex.join(spec.task_argv(t))}\n")
    return "".join(lines)


def _ended_state(rec: records.JobRecord) -> str | None:
    finals = [rec.final] if not rec.array else list((rec.final or {}).values())
    states = sorted({str(f.get("state")) for f in finals if isinstance(f, dict)})
    return ", ".join(states) or None


def _keep_cancelled(rec: records.JobRecord) -> None:
    """CANCELLED as the final state of every run that has none or whose driver saw the SIGTERM;
    a run that had completed or failed before keeps its state. The pids are cleared."""
    fresh = _reload(rec)
    now = time.time()
    keys = [str(t.get("task_id")) for t in fresh.array] if fresh.array else [None]
    finals = {}
    for key in keys:
        old = records.final_of(fresh, key)
        if old and parse_state(old.get("state")).job_state not in (JobState.CANCELLED, JobState.UNKNOWN):
            continue
        started = (old or {}).get("started_at") or (fresh.submitted_at if key is None else None)
        finals[key] = records.local_final("CANCELLED", started, now, CANCEL,
                                          reason=f"stopped with `{prog('cancel')}`")
    if finals:
        records.store_final(fresh, finals)
    fresh = _reload(fresh)
    fresh.pids, fresh.pid_times = [], []
    records.update_record(fresh)


def _reload(rec: records.JobRecord) -> records.JobRecord:
    return records.load_record(rec.id, cluster=rec.cluster)
