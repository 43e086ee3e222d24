"""Goodput with a killed rank every 40 s of training, on the local test cluster: ddp_hpc's
in-allocation restarts against torchrun's elastic agent on the same schedule (issue 32's target:
at least 0.93, 1.0 = the same run with no faults and no checkpoints).

    python -m ddp_hpc.testcluster run --nodes 3 --lock-wait 1800 -- .venv/bin/python bench/goodput.py

The program is ddp_hpc's loop on jobs/demo.yaml (4 ranks, one epoch of ``--steps`` steps of slow
data, a step event per step) with, by ``--state-mb`` (default 150; 0: the demo's tiny model), an MLP
of about that much model + optimizer state (bench/bigstate.py). The runs (``--run``, repeatable;
default all, in this order):

- ``reference``: no faults, no checkpoints (``checkpoint.every_steps=0 every_epochs=0
  memory_every_steps=-1``), submitted as the ddp_hpc run is;
- ``checkpoints``: no faults, the demo's checkpoint settings plus one every 20 steps (the cost of
  checkpointing alone);
- ``ddp_hpc``: the same checkpoints, ``--max-restarts 3 --spare-nodes 1 --warm-standby`` (2 x 2 plus 1 spare:
  the first killed rank's node is swapped for the spare, later ones restart on the same nodes);
- ``torchrun``: the same program and checkpoints under ``torchrun --nnodes 2 --nproc-per-node 2
  --max-restarts 3 --rdzv-backend c10d`` in one srun step (bench/clusterjobs.py), on 2 nodes;
- ``requeue``: the Slurm requeue path, what a job gets without in-allocation restarts: the same
  checkpoints, ``--max-restarts 0`` (no supervisor), so a killed rank ends the step and the job
  (FAILED, srun's ``--kill-on-bad-exit``); the bench then requeues it at once (``scontrol
  requeue``, as a batch script's ``srun ... || scontrol requeue $SLURM_JOB_ID`` or Slurm's own
  requeue after a node failure would; it asks scontrol every 0.25 s, so up to 0.25 s of the
  fault's cost is the bench's). The job waits in the test cluster's queue (empty but for it),
  starts again on its nodes and resumes from its newest state: ddp_hpc's node-memory snapshot
  where it is still on the node (a requeue onto the same nodes), else the newest checkpoint file.

A fault: SIGKILL of one rank's process 40 s (``--every``) after the first training step of the
current run (the job's first step, or the first step after the previous fault), ranks 3, 1, 2 in
turn (``--ranks``), 3 faults (``--faults``). Per run it prints and writes to bench/goodput.json:

- wall s: from the first training step to the step event of the last step (training only: the
  start-up before and the final checkpoint after are outside, in every run alike);
- goodput: the reference's wall / this run's wall;
- restarts: the faults healed; mean fault -> step: from the SIGKILL to the first training step of
  a process started after it; steps recomputed: the steps done before a fault and trained again,
  summed over the faults; where the restarted ranks' state came from (``restored`` events);
- ddp_hpc's own goodput of the run (``ddp_hpc.judge.goodput``: useful step time / wall since the
  first step, with the rest by part): for ddp_hpc's runs from ``ddp-hpc status JOB --json``; for
  torchrun the same function on the run logs, each rank's processes numbered in file order (the
  agents number their restarts each on its own) and the restarts' phases from the events
  (``judge.restarts.phases``: no detect/stop marks, so ``start`` is the fault to the new
  processes' start).

``--quick``: 150 steps and 1 fault, a smoke check. The fault-free run should take 300-360 s of
training; the printed step time says which ``--steps`` gives that on the machine at hand.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bigstate
import clusterjobs as cj

from ddp_hpc.judge.goodput import goodput
from ddp_hpc.judge.reader import RunLogs
from ddp_hpc.judge.restarts import PHASES, phases, read_restarts
from ddp_hpc.testcluster.spec import DEFAULT_STATE_DIR

RUNS = ("reference", "checkpoints", "ddp_hpc", "torchrun", "requeue")
BATCH = 64
COMMON = ["data.dataset=tests.cluster.status_helpers:slow_synthetic", "log.every_n_steps=1", "train.epochs=1",
          "data.eval_split=0.0", "schedule.warmup_steps=0", "train.collective_timeout_s=60",
          f"train.batch_size={BATCH}"]
NO_CHECKPOINTS = ["checkpoint.every_steps=0", "checkpoint.every_epochs=0", "checkpoint.memory_every_steps=-1"]
CHECKPOINTS = ["checkpoint.every_steps=20"]
SUPERVISED = ["--max-restarts", "3", "--spare-nodes", "1", "--warm-standby"]
UNSUPERVISED = ["--max-restarts", "0"]
#: how often the requeue run asks scontrol whether the killed rank's job has ended, seconds
REQUEUE_POLL_S = 0.25


def _overrides(run: str, args) -> list[str]:
    delay = "data.kwargs.delay=0.001" if args.state_mb > 0 else "data.kwargs.delay=0.004"
    size = f"data.kwargs.size={args.steps * 4 * BATCH}"
    return [*COMMON, delay, size, *bigstate.overrides(args.state_mb),
            *(NO_CHECKPOINTS if run == "reference" else CHECKPOINTS)]


def _submit(work: Path, run: str, env: dict, args) -> tuple[str, Path]:
    if run == "torchrun":
        return cj.submit_torchrun(work, f"goodput-{run}", _overrides(run, args), env, "2", 3)
    flags = UNSUPERVISED if run == "requeue" else SUPERVISED
    return cj.submit_ddp_hpc(work, f"goodput-{run}", flags, _overrides(run, args), env)


def _first_step(log_dir: Path, job: str, env: dict) -> float:
    over = cj.JobEnd(job, env)
    got = cj.wait("the first step", lambda: cj.first_step_after(log_dir, 4, 0.0) or (over() and "ended"), 900)
    if not isinstance(got, float):
        raise SystemExit(f"bench/goodput.py: job {job} ended before its first step; see {log_dir}")
    return got


def _faults(log_dir: Path, job: str, env: dict, args, t0: float, run: str) -> list[dict]:
    """Kill a rank every ``args.every`` s of training; one dict per fault."""
    out, run_start, last_fault = [], t0, 0.0
    over = cj.JobEnd(job, env)
    for i in range(args.faults):
        due = run_start + args.every
        if cj.wait("the time of the next fault", lambda: over() or time.time() >= due,  # noqa: B023
                   args.every + 900, 0.1) is not True:
            break   # the job ended first
        fault = _fault(log_dir, job, env, args, args.ranks[i % len(args.ranks)], last_fault, run == "requeue")
        out.append(fault)
        if fault["fault_to_step_s"] is None:
            break
        run_start, last_fault = fault["at"] + fault["fault_to_step_s"], fault["at"]
    return out


def _requeued(job: str, env: dict, t_fault: float) -> dict:
    """The requeue path after a fault: wait for the job to end (the killed rank ends its step and
    the job), ``scontrol requeue`` it at once; what happened, for the fault's row."""
    fields = cj.wait(f"job {job} to end after the fault",
                     lambda: (f := cj.job_fields(job, env)).get("JobState") in cj.ENDED and f, 300, REQUEUE_POLL_S)
    ended = time.time()
    p = subprocess.run(["scontrol", "requeue", job], env=env, capture_output=True, text=True, timeout=60)
    if p.returncode:
        raise SystemExit(f"bench/goodput.py: scontrol requeue {job} failed: {p.stderr.strip()}")
    return {"job_state": fields.get("JobState"), "ended_after_s": round(ended - t_fault, 2),
            "requeued_after_s": round(time.time() - t_fault, 2)}


def _step_after(log_dir: Path, t_fault: float, job: str, env: dict, requeue: bool) -> float | None:
    """The run's first step after the fault: in the same job's allocation, or (``requeue``) in
    its next run, whatever the job's state in between."""
    if not requeue:
        return cj.finished(cj.step_or_end(log_dir, 4, t_fault, job, env, 600))
    try:
        return cj.wait("the requeued run's first step", lambda: cj.first_step_after(log_dir, 4, t_fault), 900)
    except TimeoutError:
        return None


def _fault(log_dir: Path, job: str, env: dict, args, rank: int, last_fault: float, requeue: bool = False) -> dict:
    """SIGKILL rank ``rank``'s process (``requeue``: then requeue the job once it ended) and wait
    for the run's first step after it."""
    before = max((e["step"] for r in range(4) for e in cj.steps(cj.events(log_dir, r))), default=0)
    t_fault, _ = cj.inject("kill", log_dir, rank, args.state_dir, last_fault)
    requeued = _requeued(job, env, t_fault) if requeue else None
    first = _step_after(log_dir, t_fault, job, env, requeue)
    fault = {"rank": rank, "at": t_fault, "steps_before": before, "fault_to_step_s": None}
    if requeued is not None:
        fault["requeue"] = requeued
    if first is None:
        fault["outcome"] = "no step after the fault"
        return fault
    try:
        cj.wait("every rank's first step", lambda: all(any(cj.steps(life) for life in ls) for ls in
                                                       cj.lives_after(log_dir, 4, t_fault).values()), 120)
    except TimeoutError:
        fault["note"] = "not every rank stepped within 120 s of the first"
    new = cj.lives_after(log_dir, 4, t_fault)
    resumed = min(cj.steps(life)[0]["step"] for ls in new.values() for life in ls if cj.steps(life)) - 1
    restored = [e.get("source") for ls in new.values() for life in ls[:1] for e in life if e["event"] == "restored"]
    fault.update(fault_to_step_s=round(first - t_fault, 2), steps_recomputed=max(before - resumed, 0),
                 restored_from=sorted(set(map(str, restored))),
                 phases=_phases(log_dir, t_fault))
    return fault


def _phases(log_dir: Path, t_fault: float) -> dict[str, float]:
    """The phases of the restart after the fault at ``t_fault``: from its line of restarts.jsonl
    (ddp_hpc's supervisor: with its detect and stop marks), else from the events alone."""
    entry = min(read_restarts(log_dir), default=None, key=lambda e: abs((e.get("fault_at") or 0) - t_fault))
    if entry is not None and abs((entry.get("fault_at") or 0) - t_fault) < 30:
        return phases(entry, RunLogs(log_dir))
    return phases({"restart": 1, "fault_at": t_fault}, cj.LivesView(log_dir, 4, t_fault))


def _wall(log_dir: Path, t0: float) -> tuple[float | None, int | None]:
    """Seconds from the first step to the first event of the highest step on rank 0, and that step."""
    got = cj.steps(cj.events(log_dir, 0))
    if not got:
        return None, None
    top = max(e["step"] for e in got)
    return min(e["time"] for e in got if e["step"] == top) - t0, top


def _judge(run: str, job: str, log_dir: Path, faults: list[dict], env: dict) -> dict | None:
    """ddp_hpc's goodput of the run: status's for its own jobs, the same function for torchrun's."""
    if run != "torchrun":
        doc = cj.status_json(job, env)
        return doc.get("goodput") if isinstance(doc, dict) else None
    restarts = [{"restart": k + 1, "phases": f.get("phases")} for k, f in enumerate(faults) if f.get("phases")]
    g = goodput(cj.renumbered(log_dir, 4), restarts)
    return g.to_dict() if g is not None else None


def one_run(work: Path, run: str, env: dict, args) -> dict:
    load_before = round(os.getloadavg()[0], 1)
    job, log_dir = _submit(work, run, env, args)
    t0 = _first_step(log_dir, job, env)
    faults = _faults(log_dir, job, env, args, t0, run) if run in ("ddp_hpc", "torchrun", "requeue") else []
    final = cj.end(job, env, 1800)
    wall, top = _wall(log_dir, t0)
    healed = [f for f in faults if f["fault_to_step_s"] is not None]
    return {"run": run, "job": job, "log_dir": str(log_dir), "state": final.get("JobState"),
            "slurm_restarts": int(final.get("Restarts", -1)), "wall_s": wall, "last_step": top,
            "step_s": bigstate.step_s(cj.steps((cj.lives(log_dir, 0) or [[]])[0])),
            "checkpoint_bytes": bigstate.checkpoint_bytes(log_dir), "faults": faults, "restarts": len(healed),
            "mean_fault_to_step_s": statistics.mean(f["fault_to_step_s"] for f in healed) if healed else None,
            "steps_recomputed": sum(f["steps_recomputed"] for f in healed),
            "judge": _judge(run, job, log_dir, faults, env),
            "load_average": [load_before, round(os.getloadavg()[0], 1)]}


def _print(rows: list[dict]) -> None:
    ref_row = next((r for r in rows if r["run"] == "reference" and r["wall_s"]), None)
    ref, ref_top = (ref_row["wall_s"], ref_row["last_step"]) if ref_row else (None, None)
    print(f"\n{'run':<12} {'wall s':>7} {'goodput':>8} {'restarts':>8} {'fault->step':>11} {'recomputed':>10}  "
          f"{'judge.goodput':>13}  state", flush=True)
    for r in rows:
        r["goodput"] = round(ref / r["wall_s"], 4) if ref and r["wall_s"] and r["last_step"] == ref_top else None
        j = r["judge"] or {}
        fts = f"{r['mean_fault_to_step_s']:.1f}" if r["mean_fault_to_step_s"] is not None else "-"
        print(f"{r['run']:<12} {r['wall_s'] or 0:>7.1f} {r['goodput'] or 0:>8.3f} {r['restarts']:>8} {fts:>11} "
              f"{r['steps_recomputed']:>10}  {j.get('goodput', 0):>13.3f}  {r['state']} (job {r['job']}, step "
              f"{r['step_s'] or 0:.3f} s, checkpoint {r['checkpoint_bytes']} bytes, last step {r['last_step']}, load "
              f"{r['load_average'][0]} -> {r['load_average'][1]})")
    for r in rows:
        j = r["judge"] or {}
        lost = ", ".join(f"{k} {v:.1f}" for k, v in (j.get("lost_s") or {}).items() if v)
        rp = j.get("restart_phases") or {}
        ph = ", ".join(f"{k} {rp[k]:.1f}" for k in PHASES if k in rp)
        print(f"{r['run']:<12} judge: useful {j.get('useful_s', 0):.1f} of {j.get('wall_s', 0):.1f} s; lost: "
              f"{lost or '-'}; restart phases: {ph or '-'}; redone {j.get('steps_redone', 0)} steps")
        for f in r["faults"]:
            rq = f.get("requeue")
            how = f" (job {rq['job_state']} {rq['ended_after_s']} s after the kill, requeued)" if rq else ""
            print(f"{'':<12} kill rank {f['rank']}{how}: fault -> step {f['fault_to_step_s']} s, recomputed "
                  f"{f.get('steps_recomputed')}, restored from {f.get('restored_from')}; phases "
                  + " + ".join(f"{k} {v:.1f}" for k, v in (f.get("phases") or {}).items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state-dir", type=Path,
                    default=Path(os.environ.get("DDP_HPC_TESTCLUSTER_DIR", DEFAULT_STATE_DIR)))
    ap.add_argument("--out", type=Path, default=cj.ROOT / "bench" / "goodput.json")
    ap.add_argument("--state-mb", type=float, default=150.0, help="model + optimizer state in MB (0: the demo's)")
    ap.add_argument("--steps", type=int, default=560, help="training steps (size the fault-free run to 300-360 s)")
    ap.add_argument("--every", type=float, default=40.0, help="seconds of training between faults")
    ap.add_argument("--faults", type=int, default=3)
    ap.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[3, 1, 2],
                    help="the ranks killed in turn (default 3,1,2)")
    ap.add_argument("--run", action="append", choices=RUNS, help="only this run (repeatable; goodput needs reference)")
    ap.add_argument("--quick", action="store_true", help="150 steps, 1 fault: a smoke check")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.faults = 150, 1
    if "SLURM_CONF" not in os.environ:
        raise SystemExit("bench/goodput.py runs on the test cluster: " + __doc__.splitlines()[4].strip())
    work = Path(tempfile.mkdtemp(prefix="ddp_hpc-goodput-bench-"))
    env = cj.bench_environ(work)
    print(f"state {args.state_mb:g} MB ({' '.join(bigstate.overrides(args.state_mb)) or 'the demo model'}), "
          f"{args.steps} steps, a killed rank every {args.every:g} s ({args.faults} faults, ranks {args.ranks}); "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    for run in args.run or RUNS:
        rows.append(one_run(work, run, env, args))
        r = rows[-1]
        print(f"{run}: job {r['job']} {r['state']}, wall {r['wall_s']} s, {r['restarts']} restarts; load average "
              f"{os.getloadavg()[0]:.1f}", flush=True)
    _print(rows)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1)
                        + "\n")
    print(f"wrote {args.out}; load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
