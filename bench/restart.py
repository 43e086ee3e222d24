"""Restarts inside the allocation on the local test cluster: how long a fault costs, how many steps
are done twice, and whether the run still ends where an uninterrupted one does.

    python -m ddp_hpc.testcluster run --nodes 3 --lock-wait 1200 -- .venv/bin/python bench/restart.py

Two layouts of ddp_hpc's own loop (jobs/demo.yaml with slow data, a checkpoint every 5 steps, a
20 s collective timeout), each first run once without a fault: 2 nodes x 2 tasks plus 1 spare
node (``--spare-nodes 1``), and 2 nodes x 2 tasks with no spare (``--min-nodes 1``: a lost node
leaves 1 node). Faults, each in a job of its own once every rank did 12 steps: rank 3's process
SIGKILLed; every process of rank 3's node killed (``ddp_hpc.testcluster.nodefail``, its slurmd
too); rank 3 SIGSTOPped (its peers' collective timeout ends the run); rank 3 SIGSTOPped under a
collective timeout of 600 s ("hang rank 3": the supervisor's hang limit, ``--hang-timeout``, ends
it, docs/restarts.md "A hang"). ``--layout`` and ``--fault`` pick some of them. Per scenario it
prints:

- fault -> step: seconds from the fault to the first training step after the restart (target
  <= 60 s; a hang: the collective timeout + <= 60 s);
- steps recomputed: the steps done before the fault that the restart does again (target: <= the
  checkpoint interval, 5);
- final loss against the uninterrupted run of the same layout (|difference|; the same world size
  replays the same samples in the same order, so it is equal up to float noise);
- the job id and Slurm's restart count (0: no requeue, the fault was healed inside the job);
- the restart's phases (``ddp_hpc.judge.restarts.phases``: detect, stop, start, import,
  rendezvous, restore, first step; docs/restarts.md, "Where the seconds go").

Writes bench/restart.json. Takes about 8 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddp_hpc.judge.reader import RunLogs, read_events  # noqa: E402
from ddp_hpc.judge.restarts import phases, read_restarts  # noqa: E402
from ddp_hpc.testcluster.nodefail import fail_node, revive_node  # noqa: E402
from ddp_hpc.testcluster.spec import DEFAULT_STATE_DIR  # noqa: E402

PY = sys.executable
CKPT_EVERY = 5
TIMEOUT_S = 20
OVERRIDES = ["data.dataset=tests.cluster.status_helpers:slow_synthetic", "data.kwargs.delay=0.004",
             "data.kwargs.size=16384", "log.every_n_steps=1", "train.epochs=1", "data.eval_split=0.0",
             f"checkpoint.every_steps={CKPT_EVERY}", f"train.collective_timeout_s={TIMEOUT_S}",
             "schedule.warmup_steps=0"]
LAYOUTS = {"2x2 + 1 spare": ["--spare-nodes", "1"], "2x2, no spare": ["--min-nodes", "1"]}
FAULTS = ("kill rank 3", "kill rank 3's node", "stop rank 3", "hang rank 3")
#: the collective timeout of the "hang rank 3" row: long, so only the supervisor's hang limit heals it
HANG_TIMEOUT_S = 600


def _events(log_dir: Path, rank: int) -> list[dict]:
    return read_events(log_dir / f"rank{rank}.events.jsonl").events


def _steps(log_dir: Path, rank: int, restart: int) -> list[dict]:
    return [e for e in _events(log_dir, rank) if e["event"] == "step" and e.get("restart") == restart]


def _wait(what: str, cond, timeout: float = 300.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := cond():
            return got
        time.sleep(0.25)
    raise SystemExit(f"bench/restart.py: timed out waiting for {what}")


def _slurm(args: list[str], env: dict) -> str:
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=60).stdout


def _submit(work: Path, name: str, layout: list[str], env: dict, extra=()) -> tuple[str, Path]:
    p = subprocess.run([PY, "-m", "ddp_hpc.submit", "--backend", "sbatch", "-N", "2", "-G", "2", "-t", "15",
                        "--max-restarts", "2", *layout, "-J", name, str(ROOT / "jobs" / "demo.yaml"), "--",
                        f"log.dir={work / 'runs'}", *OVERRIDES, *extra], cwd=str(ROOT), env=env,
                       capture_output=True, text=True, timeout=120)
    if p.returncode:
        raise SystemExit(p.stderr)
    return p.stdout.split()[-1], _wait("the log directory", lambda: next((work / "runs").glob(f"{name}-*"), None))


def _end(job: str, env: dict) -> dict:
    def done():
        shown = _slurm(["scontrol", "show", "job", "-o", job], env)
        state = re.search(r"\bJobState=(\S+)", shown)
        return shown if state and state.group(1) not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING") else None
    shown = _wait(f"job {job} to end", done, 600)
    return dict(w.split("=", 1) for w in shown.split() if "=" in w)


def _final_loss(log_dir: Path) -> float:
    steps = [e for e in _events(log_dir, 0) if e["event"] == "step"]
    return float(max(steps, key=lambda e: (e["step"], e["restart"]))["loss"])


def _inject(fault: str, log_dir: Path, state_dir: Path) -> tuple[float, str | None]:
    start = next(e for e in _events(log_dir, 3) if e["event"] == "start" and e.get("restart") == 0)
    t = time.time()
    if fault == "kill rank 3":
        os.kill(int(start["pid"]), signal.SIGKILL)
    elif fault in ("stop rank 3", "hang rank 3"):
        os.kill(int(start["pid"]), signal.SIGSTOP)
    else:
        fail_node(state_dir, start["host"])
        return t, start["host"]
    return t, None


def scenario(work: Path, layout: str, fault: str | None, env: dict, state_dir: Path) -> dict:
    name = re.sub(r"[^a-z0-9]+", "-", f"{layout}-{fault or 'none'}".lower()).strip("-")[:40]
    extra = [f"train.collective_timeout_s={HANG_TIMEOUT_S}"] if fault == "hang rank 3" else []
    job, log_dir = _submit(work, name, LAYOUTS[layout], env, extra)
    row: dict = {"layout": layout, "fault": fault or "none", "job": job}
    if fault:
        _wait("12 steps on every rank", lambda: all(len(_steps(log_dir, r, 0)) >= 12 for r in range(4)))
        t_fault, dead = _inject(fault, log_dir, state_dir)
        try:
            first = _wait("a step after the restart", lambda: min(
                (e["time"] for r in range(4) for e in _steps(log_dir, r, 1)), default=None), 300)
        finally:
            if dead:
                revive_node(state_dir, dead)
        done_before = max(e["step"] for r in range(4) for e in _steps(log_dir, r, 0))
        resumed_at = min(e["step"] for r in range(4) for e in _steps(log_dir, r, 1)) - 1
        rows = read_restarts(log_dir)
        _wait("the first step of every rank", lambda: all(_steps(log_dir, r, 1) for r in range(4)), 120)
        row["phases"] = phases(rows[0], RunLogs(log_dir)) if rows else {}
        row.update(fault_to_step_s=round(first - t_fault, 1), steps_recomputed=done_before - resumed_at,
                   restarts=rows, world=f"{rows[0]['world_before']} -> {rows[0]['world_after']}" if rows else "-")
    final = _end(job, env)
    row.update(state=final.get("JobState"), slurm_restarts=int(final.get("Restarts", -1)),
               final_loss=_final_loss(log_dir))
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state-dir", type=Path,
                    default=Path(os.environ.get("DDP_HPC_TESTCLUSTER_DIR", DEFAULT_STATE_DIR)))
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "restart.json")
    ap.add_argument("--layout", action="append", choices=list(LAYOUTS), help="only this layout (repeatable)")
    ap.add_argument("--fault", action="append", choices=FAULTS, help="only this fault (repeatable)")
    args = ap.parse_args()
    if "SLURM_CONF" not in os.environ:
        raise SystemExit("bench/restart.py runs on the test cluster: " + __doc__.splitlines()[2].strip())
    work = Path(tempfile.mkdtemp(prefix="ddp_hpc-restart-bench-"))
    env = dict(os.environ, DDP_HPC_HOME=str(work / "home"), PYTHONPATH=str(ROOT))
    rows = []
    for layout in args.layout or LAYOUTS:
        base = scenario(work, layout, None, env, args.state_dir)
        rows.append(base)
        print(f"{layout}: uninterrupted job {base['job']} {base['state']}, final loss {base['final_loss']:.6f}",
              flush=True)
        for fault in args.fault or FAULTS:
            r = scenario(work, layout, fault, env, args.state_dir)
            r["loss_diff"] = abs(r["final_loss"] - base["final_loss"])
            rows.append(r)
            print(f"{layout:<14} {fault:<19} fault -> step {r['fault_to_step_s']:>5.1f} s  recomputed "
                  f"{r['steps_recomputed']:>2} steps  world {r['world']}  final loss {r['final_loss']:.6f} "
                  f"(|diff| {r['loss_diff']:.2e})  job {r['job']} {r['state']}, Slurm restarts "
                  f"{r['slurm_restarts']}", flush=True)
            print(f"{'':<14} phases: " + " + ".join(f"{k} {v:.1f}" for k, v in r["phases"].items()), flush=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
