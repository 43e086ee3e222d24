"""The ``local`` backend: the same job on this machine, N x G processes laid out as N pretend
nodes (gloo on CPU), through ``ddp_hpc.launch.run_local``.

Why a driver process: a sweep is several runs one after another, and without ``--wait`` the
submit command must return at once while the runs go on. So the submitter writes a small plan
(``local-plan.json`` in the job's log directory) and runs this module's driver on it, in the
foreground with ``--wait`` (following rank 0's output on the terminal) or detached in its own
session otherwise (``python -m ddp_hpc.submit.local PLAN``). The driver keeps the job record's
``pids`` current, so ``ddp_hpc.status`` can tell a running local job from a dead one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Mapping, Sequence

from ddp_hpc.submit.spec import JobSpec
from ddp_hpc.fsutil import atomic_write_json

__all__ = ["write_plan", "run_plan", "start_detached", "main"]

PLAN_NAME = "local-plan.json"


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


class _Follow(threading.Thread):
    """Copy new lines of one file to stdout until stopped (rank 0's output under --wait)."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.stop = path, threading.Event()

    def run(self) -> None:
        pos = 0
        while True:
            stopping = self.stop.is_set()
            try:
                with open(self.path, "rb") as f:
                    f.seek(pos)
                    data = f.read()
                    pos += len(data)
            except FileNotFoundError:
                data = b""
            if data:
                sys.stdout.write(data.decode(errors="replace"))
                sys.stdout.flush()
            if stopping:
                return
            self.stop.wait(0.5)


def _set_pids(plan: dict, pids: list[int]) -> None:
    if not plan.get("record_id"):
        return
    from ddp_hpc import records
    env = {"DDP_HPC_HOME": plan["ddp_hpc_home"]} if plan.get("ddp_hpc_home") else None
    try:
        rec = records.load_record(plan["record_id"], environ=env)
        rec.pids = pids
        records.update_record(rec, env)
    except (records.JobRecordError, OSError) as exc:
        print(f"ddp_hpc: could not update the job record: {exc}", file=sys.stderr)


def run_plan(plan_path: str | os.PathLike, follow: bool = False,
             env: Mapping[str, str] | None = None) -> int:
    """Run every run of the plan in turn with ``env`` (default: this process's environment);
    the exit status of the first failing run, else 0."""
    from ddp_hpc.launch import start_local

    plan = json.loads(Path(plan_path).read_text())
    n, g = plan["nodes"], plan["procs_per_node"]
    worst = 0
    for i, run in enumerate(plan["runs"]):
        label = f"task {run['task_id']}" if run["task_id"] is not None else "job"
        print(f"ddp_hpc local: {label} {run['job_id']}: {n * g} processes on {n} pretend node(s), "
              f"logs in {run['log_dir']}", flush=True)
        run_env = {**(os.environ if env is None else env), "DDP_HPC_LOG_DIR": run["log_dir"]}
        lr = start_local(run["argv"], nodes=n, procs_per_node=g, log_dir=run["log_dir"], env=run_env,
                         job_id=run["job_id"])
        _set_pids(plan, [os.getpid(), *lr.pids])
        tail = _Follow(Path(run["log_dir"]) / "rank0.out") if follow else None
        if tail:
            tail.start()
        try:
            res = lr.wait()
        finally:
            if tail:
                tail.stop.set()
                tail.join()
        if res.ok:
            print(f"ddp_hpc local: {label} {run['job_id']} completed: all {n * g} ranks exited 0",
                  flush=True)
            continue
        if res.interrupted:
            print(f"ddp_hpc local: {label} interrupted by {res.interrupted}", file=sys.stderr)
            return res.exitcode
        r = res.first_failed_rank
        print(f"ddp_hpc local: {label} {run['job_id']} FAILED: rank {r} exited with "
              f"{res.returncodes[r]}; see {Path(run['log_dir']) / f'rank{r}.out'}",
              file=sys.stderr, flush=True)
        worst = worst or res.exitcode
    _set_pids(plan, [])
    return worst


def start_detached(plan_path: Path, env: Mapping[str, str], python: str = sys.executable) -> int:
    """Start the driver in its own session (it outlives this command); returns its pid."""
    out = Path(plan_path).parent / "local-driver.out"
    with open(out, "ab") as f:
        proc = subprocess.Popen([python, "-m", "ddp_hpc.submit.local", str(plan_path)],
                                env=dict(env), stdin=subprocess.DEVNULL, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return proc.pid


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m ddp_hpc.submit.local PLAN.json  (written by ddp_hpc.submit)",
              file=sys.stderr)
        return 2
    started = time.time()
    rc = run_plan(args[0])
    print(f"ddp_hpc local: driver done in {time.time() - started:.0f} s, exit status {rc}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
