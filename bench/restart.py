"""Restarts inside the allocation on the local test cluster: how long a fault costs, how many steps
are done twice, and whether the run still ends where an uninterrupted one does; against the Slurm
requeue path and torchrun's elastic agent, measured in the same run.

    python -m ddp_hpc.testcluster run --nodes 3 --lock-wait 1800 -- .venv/bin/python bench/restart.py

ddp_hpc's loop on jobs/demo.yaml with slow data (64 steps of 4 ranks, a checkpoint every 5 steps, a
20 s collective timeout) and, with ``--state-mb N`` (default 150; 0: the demo's tiny model), an MLP
wide enough for about N MB of model + optimizer state (bench/bigstate.py; the checkpoint file's
size and the step time are printed). Baselines (``--baseline``, repeatable; default all):

- ``ddp_hpc``: two layouts (``--layout``), each first run once without a fault: 2 nodes x 2 tasks
  plus 1 spare node (``--spare-nodes 1``), and 2 nodes x 2 tasks with no spare (``--min-nodes 1``:
  a lost node leaves 1 node), ``--max-restarts 2 --warm-standby``;
- ``requeue``: the same job with ``--max-restarts 0`` (ddp_hpc's batch script without the
  supervisor, ``#SBATCH --requeue``; the test cluster has JobRequeue=1): Slurm requeues a job
  whose node failed (NODE_FAIL) and it resumes from its checkpoint file; a killed rank ends the
  job (FAILED: no recovery without submitting it again), and the row says so;
- ``torchrun``: ``torchrun --nnodes 2 --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d``
  running ``python -m ddp_hpc.run jobs/demo.yaml`` in one ``srun --nodes=2 --ntasks-per-node=1``
  step of an sbatch job (bench/clusterjobs.py writes the script, with
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: without it torch 2.13's restarted workers failed their
  gloo rendezvous here); for a lost node ``--nnodes 1:2``, so the agent that is left may go on
  alone (``--nnodes 2`` cannot form again).

Faults (``--fault``), each in a job of its own once every rank did 12 steps: rank 3's process
SIGKILLed; every process of rank 3's node killed (``ddp_hpc.testcluster.nodefail``, its slurmd
too); rank 3 SIGSTOPped (its peers' collective timeout ends the run); rank 3 SIGSTOPped under a
collective timeout of 600 s ("hang rank 3": the supervisor's hang limit, ``--hang-timeout``, ends
it, docs/restarts.md "A hang"; ddp_hpc only). `BASELINE_FAULTS` lists which baseline runs which.
Per scenario it prints:

- fault -> step: seconds from the fault to the first training step of a process started after
  it (None: no step came, the job ended or 300 s passed; ``outcome`` says which);
- steps recomputed: the steps done before the fault that the restart does again;
- final loss against the first uninterrupted run (|difference|; the same world size replays the
  same samples in the same order, so it is equal up to float noise);
- the job id, its end state and Slurm's restart count (0: no requeue);
- the restart's phases (``ddp_hpc.judge.restarts.phases``: detect, stop, start, import,
  rendezvous, restore, first step; docs/restarts.md, "Where the seconds go"), counted from the
  restart record's ``fault_at``; for a stopped rank that is where the peers' collective timeout
  ended, and the final table's "before fault_at" column is the time from the SIGSTOP to it.
  Without a line in restarts.jsonl (a requeue, torchrun) there are no detect and stop marks:
  ``start`` is then the fault to the new processes' start (Slurm's or the agents' detection,
  stop and relaunch);
- where the state came from (the ``restored`` event's ``source``: a checkpoint file, a node's
  memory snapshot).

Writes bench/restart.json (``--out``). ``--no-uninterrupted`` skips the runs without a fault.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import bigstate
import clusterjobs as cj

from ddp_hpc.judge.reader import RunLogs
from ddp_hpc.judge.restarts import PHASES, phases, read_restarts
from ddp_hpc.slurm.hostlist import expand
from ddp_hpc.testcluster.nodefail import revive_node
from ddp_hpc.testcluster.spec import DEFAULT_STATE_DIR

CKPT_EVERY = 5
TIMEOUT_S = 20
OVERRIDES = ["data.dataset=tests.cluster.status_helpers:slow_synthetic", "data.kwargs.size=16384",
             "log.every_n_steps=1", "train.epochs=1", "data.eval_split=0.0",
             f"checkpoint.every_steps={CKPT_EVERY}", f"train.collective_timeout_s={TIMEOUT_S}",
             "schedule.warmup_steps=0"]
#: seconds of sleep per sample: the tiny model's steps are all data wait; the big one computes
DELAY = {True: "data.kwargs.delay=0.001", False: "data.kwargs.delay=0.004"}
BASELINES = ("ddp_hpc", "requeue", "torchrun")
LAYOUTS = {"2x2 + 1 spare": ["--spare-nodes", "1"], "2x2, no spare": ["--min-nodes", "1"]}
FAULTS = ("kill rank 3", "kill rank 3's node", "stop rank 3", "hang rank 3")
BASELINE_FAULTS = {"ddp_hpc": FAULTS, "requeue": ("kill rank 3", "kill rank 3's node"),
                   "torchrun": ("kill rank 3", "kill rank 3's node", "stop rank 3")}
BASELINE_LAYOUT = {"requeue": "2x2, --max-restarts 0", "torchrun": "2 agents x 2 workers"}
INJECT = {"kill rank 3": "kill", "kill rank 3's node": "node", "stop rank 3": "stop", "hang rank 3": "stop"}
#: the collective timeout of the "hang rank 3" row: long, so only the supervisor's hang limit heals it
HANG_TIMEOUT_S = 600
#: how long a fault may take to heal before the row says it did not
HEAL_TIMEOUT_S = 300


def _final(log_dir: Path) -> tuple[float | None, int | None]:
    """Rank 0's loss at the highest step it reached (the newest such event), and that step."""
    got = cj.steps(cj.events(log_dir, 0))
    if not got:
        return None, None
    last = max(got, key=lambda e: (e["step"], e["time"]))
    return float(last["loss"]), int(last["step"])


def _submit(work: Path, baseline: str, layout: str, fault: str | None, env: dict, state_mb: float):
    name = re.sub(r"[^a-z0-9]+", "-", f"{baseline}-{layout}-{fault or 'none'}".lower()).strip("-")[:48]
    overrides = [*OVERRIDES, DELAY[state_mb > 0], *bigstate.overrides(state_mb)]
    if fault == "hang rank 3":
        overrides.append(f"train.collective_timeout_s={HANG_TIMEOUT_S}")
    if baseline == "torchrun":
        return cj.submit_torchrun(work, name, overrides, env, "1:2" if fault == "kill rank 3's node" else "2")
    flags = (["--max-restarts", "0"] if baseline == "requeue"
             else ["--max-restarts", "2", "--warm-standby", *LAYOUTS[layout]])
    return cj.submit_ddp_hpc(work, name, flags, overrides, env)


def _restored(log_dir: Path, t: float) -> str | None:
    """The ``source``s of the ``restored`` events of the processes started after ``t`` (a checkpoint
    file, a node's memory snapshot, a peer's)."""
    got = {str(e.get("source")) for ls in cj.lives_after(log_dir, 4, t).values() for life in ls[:1]
           for e in life if e.get("event") == "restored"}
    return ", ".join(sorted(got)) or None


def _after_fault(row: dict, baseline: str, log_dir: Path, t_fault: float, first: float) -> None:
    """The row's facts of the new run: steps recomputed, world sizes, phases, restore source."""
    before = [e["step"] for r in range(4) for e in cj.steps(cj.events(log_dir, r)) if e["time"] <= t_fault]
    new = cj.lives_after(log_dir, 4, t_fault)
    world = next((ls[0][0].get("world_size") for ls in new.values() if ls), None) or 4
    try:   # every rank of the new run stepped, for its phases
        cj.wait("the first step of every rank", lambda: all(
            any(cj.steps(life) for life in cj.lives_after(log_dir, 4, t_fault)[r]) for r in range(world)), 120)
    except TimeoutError:
        row["note"] = "not every rank of the new run stepped within 120 s"
    new = cj.lives_after(log_dir, 4, t_fault)
    firsts = [cj.steps(life)[0]["step"] for ls in new.values() for life in ls if cj.steps(life)]
    rows = read_restarts(log_dir) if baseline == "ddp_hpc" else []
    if rows:
        row["phases"] = phases(rows[0], RunLogs(log_dir))
    else:
        row["phases"] = phases({"restart": 1, "fault_at": t_fault}, cj.LivesView(log_dir, 4, t_fault))
    row.update(fault_to_step_s=round(first - t_fault, 1), steps_recomputed=max(before) - (min(firsts) - 1),
               restarts=rows, world=f"4 -> {world}", restored_from=_restored(log_dir, t_fault))


def _measure(row: dict, baseline: str, job: str, log_dir: Path, env: dict, t_fault: float, dead: str | None) -> None:
    """The run after the fault at ``t_fault`` (``dead``: the node failed, if any), into ``row``."""
    if dead:
        row["node_failed"] = dead
        if baseline == "torchrun":   # the c10d store of the agents' rendezvous lives on the job's first node
            row["rendezvous_host"] = expand(cj.job_fields(job, env).get("NodeList", ""))[0]
    first = cj.finished(cj.step_or_end(log_dir, 4, t_fault, job, env, HEAL_TIMEOUT_S))
    if first is not None:
        _after_fault(row, baseline, log_dir, t_fault, first)
        return
    state = cj.job_fields(job, env).get("JobState")
    row["outcome"] = f"no step after the fault (job {state})" + (
        ": no recovery without submitting it again" if baseline == "requeue" and state == "FAILED" else "")
    cj.slurm(["scancel", job], env)


def _standby_ready(log_dir: Path) -> int:
    """How many of the supervisor's standby ranks said they are ready (standby.out)."""
    try:
        return (log_dir / "standby.out").read_text().count(" ready in ")
    except OSError:
        return 0


def scenario(work: Path, baseline: str, layout: str, fault: str | None, env: dict, args) -> dict:
    job, log_dir = _submit(work, baseline, layout, fault, env, args.state_mb)
    row: dict = {"baseline": baseline, "layout": layout, "fault": fault or "none", "job": job,
                 "log_dir": str(log_dir), "fault_to_step_s": None}
    over = cj.JobEnd(job, env)
    cj.wait("12 steps on every rank", lambda: over() or all(
        len(cj.steps(cj.events(log_dir, r))) >= 12 for r in range(4)), 600)
    first_life = (cj.lives(log_dir, 0) or [[]])[0]
    row["step_s"] = bigstate.step_s(cj.steps(first_life))
    if fault and baseline == "ddp_hpc" and not over():
        # the supervisor's warm standby (docs/restarts.md) starts at the first step and imports
        # for seconds on this machine: the fault comes once it is ready, as in a run whose faults
        # are more than a few seconds apart (the cold path is the lost-node row, and
        # --no-warm-standby's)
        want = 6 if "spare" in layout and "no spare" not in layout else 4
        t0 = time.time()
        cj.wait("the warm standby", lambda: over() or _standby_ready(log_dir) >= want, 180)
        row["standby_wait_s"] = round(time.time() - t0, 1)
    # A failed node comes back once the job is over: revived beside the requeued run of a lost node,
    # that run got a SIGTERM 2 s after its first step (the job then FAILED).
    dead = None
    try:
        if fault and not over():
            t_fault, dead = cj.inject(INJECT[fault], log_dir, 3, args.state_dir)
            _measure(row, baseline, job, log_dir, env, t_fault, dead)
        final = cj.end(job, env)
    finally:
        if dead:
            revive_node(args.state_dir, dead)
    row["final_loss"], row["final_step"] = _final(log_dir)
    row.update(state=final.get("JobState"), slurm_restarts=int(final.get("Restarts", -1)),
               checkpoint_bytes=bigstate.checkpoint_bytes(log_dir))
    return row


def _print(r: dict) -> None:
    if r["fault"] == "none":
        print(f"{r['baseline']:<9} {r['layout']:<22} uninterrupted job {r['job']} {r['state']}, final loss "
              f"{r['final_loss']}, step {r['step_s'] or 0:.3f} s, checkpoint {r['checkpoint_bytes']} bytes", flush=True)
        return
    if r["fault_to_step_s"] is None:
        print(f"{r['baseline']:<9} {r['layout']:<22} {r['fault']:<19} {r.get('outcome', '?')}; job {r['job']} "
              f"{r['state']}, Slurm restarts {r['slurm_restarts']}, final step {r['final_step']}", flush=True)
        return
    diff = f"{r['loss_diff']:.2e}" if r.get("loss_diff") is not None else "-"
    print(f"{r['baseline']:<9} {r['layout']:<22} {r['fault']:<19} fault -> step {r['fault_to_step_s']:>5.1f} s  "
          f"recomputed {r['steps_recomputed']:>2} steps  world {r['world']}  restored from {r['restored_from']}  "
          f"final loss {r['final_loss']:.6f} (|diff| {diff})  job {r['job']} {r['state']}, Slurm restarts "
          f"{r['slurm_restarts']}", flush=True)
    node = f"; node {r['node_failed']} failed" if r.get("node_failed") else ""
    rdzv = f" (the agents' rendezvous on {r['rendezvous_host']})" if r.get("rendezvous_host") else ""
    print(f"{'':<9} phases: " + " + ".join(f"{k} {v:.1f}" for k, v in r["phases"].items()) + node + rdzv, flush=True)


def _table(rows: list[dict]) -> None:
    """Every faulted row as one markdown table, with its phases (a missing phase: "-")."""
    print("\n| baseline | layout | fault | fault -> step | before fault_at | " + " | ".join(PHASES)
          + " | recomputed | world | restored from | job end, Slurm restarts |")
    print("|---" * (len(PHASES) + 9) + "|")
    for r in rows:
        if r["fault"] == "none":
            continue
        took = f"{r['fault_to_step_s']:.1f} s" if r["fault_to_step_s"] is not None else r.get("outcome", "-")
        ph = [f"{r['phases'][k]:.1f}" if k in r.get("phases", {}) else "-" for k in PHASES]
        # a stopped rank's restart record puts the fault where the peers' collective timeout ended
        before = r["fault_to_step_s"] - sum(r["phases"].values()) if r["fault_to_step_s"] is not None else None
        lead = f"{before:.1f}" if before is not None and before >= 0.05 else "-"
        print(f"| {r['baseline']} | {r['layout']} | {r['fault']} | {took} | {lead} | " + " | ".join(ph)
              + f" | {r.get('steps_recomputed', '-')} | {r.get('world', '-')} | {r.get('restored_from', '-')} | "
              f"{r['state']}, {r['slurm_restarts']} |")


def _plan(args) -> list[tuple[str, str, str | None]]:
    """(baseline, layout, fault) in run order; the uninterrupted runs first."""
    out = []
    for baseline in args.baseline or BASELINES:
        layouts = (args.layout or list(LAYOUTS)) if baseline == "ddp_hpc" else [BASELINE_LAYOUT[baseline]]
        for layout in layouts:
            if baseline == "ddp_hpc" and not args.no_uninterrupted:
                out.append((baseline, layout, None))
            out += [(baseline, layout, f) for f in args.fault or FAULTS if f in BASELINE_FAULTS[baseline]]
    if not args.no_uninterrupted and not any(f is None for _, _, f in out):
        out.insert(0, ("ddp_hpc", "2x2, no spare", None))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state-dir", type=Path,
                    default=Path(os.environ.get("DDP_HPC_TESTCLUSTER_DIR", DEFAULT_STATE_DIR)))
    ap.add_argument("--out", type=Path, default=cj.ROOT / "bench" / "restart.json")
    ap.add_argument("--state-mb", type=float, default=150.0, help="model + optimizer state in MB (0: the demo's)")
    ap.add_argument("--baseline", action="append", choices=BASELINES, help="only this baseline (repeatable)")
    ap.add_argument("--layout", action="append", choices=list(LAYOUTS), help="only this ddp_hpc layout (repeatable)")
    ap.add_argument("--fault", action="append", choices=FAULTS, help="only this fault (repeatable)")
    ap.add_argument("--no-uninterrupted", action="store_true", help="no run without a fault (no loss comparison)")
    args = ap.parse_args()
    if "SLURM_CONF" not in os.environ:
        raise SystemExit("bench/restart.py runs on the test cluster: " + __doc__.splitlines()[4].strip())
    work = Path(tempfile.mkdtemp(prefix="ddp_hpc-restart-bench-"))
    env = cj.bench_environ(work)
    print(f"state: {args.state_mb:g} MB ({' '.join(bigstate.overrides(args.state_mb)) or 'the demo model'}); "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    rows, base = [], None
    for baseline, layout, fault in _plan(args):
        r = scenario(work, baseline, layout, fault, env, args)
        if fault is None and base is None:
            base = r["final_loss"]
        if fault and base is not None and r.get("final_loss") is not None:
            r["loss_diff"] = abs(r["final_loss"] - base)
        rows.append(r)
        _print(r)
        args.out.write_text(json.dumps(rows, indent=1) + "\n")   # what ran so far, should a later row fail
    _table(rows)
    print(f"wrote {args.out}; load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
