"""Waiting for a submitted Slurm job: poll squeue until every task ended, show rank 0's progress
meanwhile, then judge each run from its run logs (did every rank write ``end: completed``?)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

from ddp_hpc.judge.attribution import SchedulerFacts
from ddp_hpc.judge.consequences import failure_lines
from ddp_hpc.judge.nodefiles import NODE_RANKS, log_events, rank_events
from ddp_hpc.judge.reader import RunLogs
from ddp_hpc.runlogs.schema import events_file, node_events_file, rank_out
from ddp_hpc.slurm.states import parse_state
from ddp_hpc.text import prog, shown_path

__all__ = ["wait_for_jobs", "latest_step", "run_verdict", "wait_and_judge", "culprit_lines"]


def _state_of(row: Mapping[str, str]):
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
        if states and all(s.job_state.terminal for s in states.values()):
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
        own = Path(d) / events_file(0)      # rank 0's own file (the earlier layout), else node 0's
        p = own if own.exists() else Path(d) / node_events_file(0)
        try:
            with open(p, "rb") as f:
                f.seek(max(0, p.stat().st_size - (8192 if p == own else 8192 * NODE_RANKS)))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            continue
        for line in reversed(lines):
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict) and ev.get("rank", 0) == 0 and ev.get("event") in ("step", "epoch", "end"):
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
    for r, stream in log_events(d).items():
        for ev in stream.events:
            if ev.get("event") == "end" and r < world_size:
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


def culprit_lines(log_dir: str | os.PathLike, state: str | None = "FAILED",
                  exit_codes: Sequence[str] = (), job_id: str | None = None) -> list[str]:
    """The first failure of the run in ``log_dir`` as ``ddp-hpc status`` judges it (the culprit
    rank, its node, its error and the tail of its traceback; what the others did as one line
    each), then where its whole output is; [] when the logs name no failing rank. ``state`` and
    ``exit_codes``: what the scheduler (or the local driver) said of the run."""
    try:
        f = RunLogs(log_dir).first_failure(assume_failed=True,
                                           sched=SchedulerFacts(state, [c for c in exit_codes if c]))
    except (OSError, ValueError):
        return []
    if f is None:
        return []
    return failure_lines(f) + [f"Its output: {shown_path(Path(log_dir) / rank_out(f.rank))}"] + (
        [f"Every rank: {prog('status')} {job_id}"] if job_id else [])


def world_that_ran(log_dir: str | os.PathLike, default: int) -> int:
    """The world size in rank 0's newest ``start`` event (a job with a node range MIN-MAX runs
    with the nodes it got), else ``default``."""
    for ev in reversed(rank_events(log_dir, 0).events):
        if ev.get("event") == "start" and isinstance(ev.get("world_size"), int):
            return ev["world_size"]
    return default


def wait_and_judge(spec, job_id: str, cli, timeout: float | None, say) -> int:
    """``submit --wait`` on Slurm: wait for the end, then one verdict per run from its run logs;
    0 when every run completed on every rank."""
    states = wait_for_jobs(cli, job_id, timeout=timeout,
                           echo=lambda m: print(m, file=sys.stderr, flush=True),
                           progress=lambda: latest_step([t.log_dir for t in spec.tasks]))
    ok_all, culprits = True, []
    for t in spec.tasks:
        world = spec.world_size
        if isinstance(spec.options.nodes, str):     # a range: as many ranks as the nodes it got
            world = world_that_ran(t.log_dir, world)
        ok, why = run_verdict(t.log_dir, world)
        label = f"task {t.task_id}" if t.task_id is not None else f"job {job_id}"
        say(f"{label}: {'completed' if ok else 'NOT completed'}: {why}")
        if not ok:
            key = f"{job_id}_{t.task_id}" if t.task_id is not None else job_id
            state = str(states.get(key) or "").split()[0] or None
            culprits += culprit_lines(t.log_dir, state, job_id=key)
        ok_all = ok_all and ok
    say("final Slurm state: " + ", ".join(f"{k} {v}" for k, v in sorted(states.items())))
    for line in culprits:   # the last lines: who broke it, as status judges it
        print(line, file=sys.stderr, flush=True)
    return 0 if ok_all else 1
