"""The supervisor's health check of the next step's nodes, before the first start and before
every restart: one short ``srun`` of ``python -m ddp_hpc.supervise.nodecheck`` over the step's
nodes (one task per node; the check itself takes well under a second), read back as one JSON line
per node.

A node that fails (its GPUs do not answer NVML or have ECC errors, its scratch or the checkpoint
folder takes no file or has no room for one checkpoint, it has no route to the rendezvous
address) or gives no answer within `CHECK_TIMEOUT_S` is excluded like a lost node
(``plan.next_nodes``: a spare takes its place, else the job goes on with fewer nodes down to
``--min-nodes``), and the check runs again over the new set, until every node passed or too few
are left. `health_row` is what ``restarts.jsonl`` keeps of a check that excluded a node, so status
says why (``n2 excluded: /tmp full (0.1 GB free, checkpoint needs 1.5 GB)``).
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from ddp_hpc.fsutil import file_size
from ddp_hpc.judge.tails import read_events
from ddp_hpc.runlogs.schema import events_file
from ddp_hpc.slurm.cli import SlurmCLI, SlurmError
from ddp_hpc.slurm.hostlist import compress
from ddp_hpc.supervise.plan import NodePlan, Policy, next_nodes

__all__ = ["Checked", "CHECK_TIMEOUT_S", "NO_CHECKPOINT_NEED_BYTES", "checkpoint_need", "check_args",
           "failures", "check_nodes", "health_row"]

#: how long the check step may take before the nodes that gave no answer count as failed: srun's
#: start, Python's and the check's (about a second on a quiet node), with room for a loaded one
CHECK_TIMEOUT_S = 20.0
#: the free space asked for while the run has written no checkpoint yet (its size is not known)
NO_CHECKPOINT_NEED_BYTES = 100_000_000


@dataclass(frozen=True)
class Checked:
    """The outcome of the check: the plan to start (None: too few healthy nodes, ``change`` says
    why), the nodes excluded with why, what changed in words, the seconds it took, and how many
    check steps ran."""

    plan: NodePlan | None
    failed: dict[str, str] = field(default_factory=dict)
    change: str = ""
    seconds: float = 0.0
    rounds: int = 0


def _size(path: str) -> int:
    """A checkpoint's size: its file's, or the sum of a checkpoint folder's files."""
    if not os.path.isdir(path):
        return file_size(path)
    return sum(file_size(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def checkpoint_need(log_dir: str | Path) -> tuple[list[str], int]:
    """(the checkpoint folder, the free space one checkpoint needs) from rank 0's newest
    ``checkpoint`` event: its file's folder and size; ([], `NO_CHECKPOINT_NEED_BYTES`) before the
    run wrote one."""
    path = Path(log_dir, events_file(0))
    events = read_events(path).events if path.exists() else []
    for e in reversed(events):
        ckpt = e.get("path") if e.get("event") == "checkpoint" else None
        if isinstance(ckpt, str) and ckpt:
            return [os.path.dirname(os.path.abspath(ckpt))], max(_size(ckpt), 1)
    return [], NO_CHECKPOINT_NEED_BYTES


def check_args(nodes: list[str], again: bool, dirs: list[str], need_bytes: int) -> list[str]:
    """srun's arguments for the check: one task on each of ``nodes``, no task's failure ending the
    others; ``again`` (a restart): --overlap, as the real step (``loop.step_args``)."""
    return ["--no-kill", *(["--overlap"] if again else []), "--kill-on-bad-exit=0", f"--nodes={len(nodes)}",
            f"--ntasks={len(nodes)}", "--ntasks-per-node=1", f"--nodelist={compress(nodes)}",
            sys.executable, "-m", "ddp_hpc.supervise.nodecheck", *[f"--dir={d}" for d in dirs],
            f"--need-bytes={need_bytes}"]


def failures(nodes: list[str], returncode: int | None, out: str) -> dict[str, str]:
    """node -> why, for the ``nodes`` that failed the check or gave no answer in ``out`` (the
    check step's stdout: one JSON line per node; ``returncode`` None: killed at the timeout)."""
    seen: dict[str, dict] = {}
    for line in out.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("node") in nodes:
            seen[rec["node"]] = rec
    silent = (f"no answer to the health check within {CHECK_TIMEOUT_S:g} s" if returncode is None
              else f"no answer to the health check (srun exited with status {returncode})")
    out_of: dict[str, str] = {}
    for node in nodes:
        rec = seen.get(node)
        if rec is None:
            out_of[node] = silent
        elif not rec.get("ok"):
            out_of[node] = "; ".join(str(p) for p in rec.get("problems") or ()) or "failed the health check"
    return out_of


def check_nodes(cli: SlurmCLI, plan: NodePlan, policy: Policy, env: Mapping[str, str], again: bool,
                log_dir: str) -> Checked:
    """Check every node of ``plan.active``; exclude those that fail (as lost nodes: spares first,
    then fewer nodes down to the floor) and check the new set again, until all pass."""
    t0, failed, words, rounds = time.monotonic(), {}, "", 0
    dirs, need = checkpoint_need(log_dir)
    while True:
        rounds += 1
        try:
            rc, out = cli.run_step(check_args(plan.active, again, dirs, need), env, CHECK_TIMEOUT_S)
        except SlurmError as exc:   # srun could not start: the real step would fail the same way
            return Checked(plan, failed, f"health check not run: {exc}", round(time.monotonic() - t0, 3), rounds)
        bad = failures(plan.active, rc, out)
        if not bad:
            return Checked(plan, failed, words, round(time.monotonic() - t0, 3), rounds)
        failed.update(bad)
        try:
            plan, words = next_nodes(plan, list(bad), [], policy)
        except ValueError as exc:
            return Checked(None, failed, str(exc), round(time.monotonic() - t0, 3), rounds)


def health_row(c: Checked, run: int, key) -> dict:
    """The line of restarts.jsonl for a check that excluded nodes before run ``run``
    (`schema.ALLOC_HEALTH_KEYS`)."""
    return {"health_check": run, "job_id": key, "time": round(time.time(), 3), "seconds": c.seconds,
            "excluded": dict(c.failed), "nodes_after": list(c.plan.active) if c.plan else [],
            "not_started": None if c.plan else c.change}
