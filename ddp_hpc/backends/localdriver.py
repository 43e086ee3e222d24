"""The local driver: the process that runs a local job's plan, N x G processes laid out as N
pretend nodes (gloo on CPU), through ``ddp_hpc.launch.start_local``.

Why a driver process: a sweep is several runs one after another, and without ``--wait`` the
submit command must return at once while the runs go on. So the local backend
(``ddp_hpc.backends.local``) writes a small plan (``local-plan.json`` in the job's log
directory: nodes, procs_per_node, runs of argv / log_dir / job_id / task_id, record_id, workdir,
ddp_hpc_home) and runs this module's driver on it, in the foreground with ``--wait`` (rank 0's
output, its progress lines included, copied to the terminal as it is written) or detached in its
own session otherwise (``python -m ddp_hpc.backends.localdriver PLAN``). The driver keeps the job record's
``pids`` current, so ``ddp_hpc.status`` can tell a running local job from a dead one.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

from ddp_hpc import records
from ddp_hpc.backends import wait
from ddp_hpc.exits import exit_status_of_signal
from ddp_hpc.judge import kept
from ddp_hpc.judge.reader import RunLogs
from ddp_hpc.launch import start_local
from ddp_hpc.launch.tree import start_time
from ddp_hpc.runlogs.schema import rank_out
from ddp_hpc.text import plural

__all__ = ["run_plan", "ending_words", "main"]

#: the ``source`` of the final states the driver keeps in the record
DRIVER = "the local driver"


def _set_pids(plan: dict, pids: list[int]) -> None:
    """Keep the record's pids (and when each started) current."""
    _update(plan, pids=pids)


def _set_final(plan: dict, finals: dict) -> None:
    """Keep how runs ended (task id, None for a single run -> `records.local_final`) in the record."""
    _update(plan, finals=finals)


def _update(plan: dict, pids: list[int] | None = None, finals: dict | None = None) -> None:
    if not plan.get("record_id"):
        return
    env = {"DDP_HPC_HOME": plan["ddp_hpc_home"]} if plan.get("ddp_hpc_home") else None
    try:
        rec = records.load_record(plan["record_id"], environ=env)
        if finals:
            records.store_final(rec, finals, env)
        if pids is not None:
            rec = records.load_record(plan["record_id"], environ=env)
            rec.pids, rec.pid_times = pids, [start_time(p) for p in pids]
            records.update_record(rec, env)
    except (records.JobRecordError, OSError) as exc:
        print(f"ddp_hpc: could not update the job record: {exc}", file=sys.stderr)


def _ending(res, started: float) -> dict:
    """The final state of one run, from how its ranks ended: a stop from outside is CANCELLED
    (SIGTERM: `ddp-hpc cancel`, kill) or INTERRUPTED (Ctrl-C), never FAILED."""
    if res.ok:
        return records.local_final("COMPLETED", started, time.time(), DRIVER)
    if res.interrupted:
        state = "INTERRUPTED" if res.interrupted == "SIGINT" else "CANCELLED"
        return records.local_final(f"{state} by {res.interrupted}", started, time.time(), DRIVER)
    rc = res.returncodes[res.first_failed_rank]
    return records.local_final("FAILED", started, time.time(), DRIVER,
                               reason=f"rank {res.first_failed_rank} exited with {rc}",
                               exit_code=f"{rc}:0" if rc >= 0 else f"0:{-rc}")


def _summary(log_dir: str) -> dict | None:
    """What the job table shows of the run's logs, kept in its record (`ddp_hpc.judge.kept`)."""
    try:
        return kept.summarize(RunLogs(log_dir, ends_only=True))
    except (OSError, ValueError) as exc:  # the table reads the logs instead; the run's end is still kept
        print(f"ddp_hpc local: the logs' summary was not kept: {exc}", file=sys.stderr)
        return None


def _run_one(plan: dict, run: dict, env: Mapping[str, str] | None,
             follow: bool, announce: bool = True) -> tuple[int, bool]:
    """One run of the plan: (exit status, 0 when every rank exited 0; interrupted?).
    ``announce``: say where the run's logs are and that it completed (``submit --wait`` of a
    single run has said the first and says the second itself)."""
    n, g = plan["nodes"], plan["procs_per_node"]
    label = f"task {run['task_id']}" if run["task_id"] is not None else "job"
    if announce:
        print(f"ddp_hpc local: {label} {run['job_id']}: {plural(n * g, 'process')} on "
              f"{plural(n, 'pretend node')}, logs in {run['log_dir']}", flush=True)
    run_env = {**(os.environ if env is None else env), "DDP_HPC_LOG_DIR": run["log_dir"]}
    started = time.time()
    lr = start_local(run["argv"], nodes=n, procs_per_node=g, log_dir=run["log_dir"], env=run_env,
                     job_id=run["job_id"])
    _set_pids(plan, [os.getpid(), *lr.pids])
    res = lr.wait(echo=sys.stdout if follow else None)
    final = _ending(res, started)
    _set_final(plan, {_task_key(run): {**final, "logs": _summary(run["log_dir"])}})
    if res.ok:
        if not announce:
            return 0, False
        print(f"ddp_hpc local: {label} {run['job_id']} completed: "
              f"{'the process' if n * g == 1 else f'all {n * g} ranks'} exited 0", flush=True)
        return 0, False
    if res.interrupted:
        print(f"ddp_hpc local: {label} interrupted by {res.interrupted}", file=sys.stderr)
        return res.exitcode, True
    r = res.first_failed_rank
    culprit = wait.culprit_lines(run["log_dir"], "FAILED", [final.get("exit_code") or ""],
                                 job_id=run["job_id"])
    print(f"ddp_hpc local: {label} {run['job_id']} FAILED (exit status {res.exitcode})" + ("" if culprit else
          f": rank {r} exited with {res.returncodes[r]}; see {Path(run['log_dir']) / rank_out(r)}"),
          file=sys.stderr, flush=True)
    for line in culprit:
        print(line, file=sys.stderr, flush=True)
    return res.exitcode, False


def run_plan(plan_path: str | os.PathLike, follow: bool = False,
             env: Mapping[str, str] | None = None, announce: bool = True) -> int:
    """Run every run of the plan in turn with ``env`` (default: this process's environment);
    with ``follow``, rank 0's output is copied to stdout as it is written. Returns the exit
    status of the first failing run, else 0; an interrupted run ends the plan. ``announce``:
    a line where each run logs and one when it completed (a plan of several runs always has them)."""
    plan = json.loads(Path(plan_path).read_text())
    worst = 0
    announce = announce or len(plan["runs"]) > 1
    for i, run in enumerate(plan["runs"]):
        rc, interrupted = _run_one(plan, run, env, follow, announce)
        if interrupted:
            now = time.time()
            _set_final(plan, {_task_key(r): records.local_final(
                "CANCELLED", None, now, DRIVER, reason="not started: the job was stopped before this task")
                for r in plan["runs"][i + 1:]})
            _set_pids(plan, [])
            return rc
        worst = worst or rc
    _set_pids(plan, [])
    return worst


def ending_words(rc: int) -> str:
    """How a run of the plan ended, from its exit status, in words."""
    if rc == 0:
        return "completed"
    if rc == exit_status_of_signal(signal.SIGINT):
        return "interrupted (Ctrl-C, exit status 130)"
    if rc == exit_status_of_signal(signal.SIGTERM):
        return "cancelled (SIGTERM, exit status 143)"
    return f"failed (exit status {rc})"


def _task_key(run: dict) -> str | None:
    return None if run["task_id"] is None else str(run["task_id"])


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m ddp_hpc.backends.localdriver PLAN.json  (written by ddp_hpc.submit)",
              file=sys.stderr)
        return 2
    started = time.time()
    rc = run_plan(args[0])
    print(f"ddp_hpc local: driver done in {time.time() - started:.0f} s, exit status {rc}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
