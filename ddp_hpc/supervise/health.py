"""The supervisor's health check of the next step's nodes, before the first start and before
every restart: one short ``srun`` of ``python -m ddp_hpc.supervise.nodecheck`` over the step's
nodes (one task per node; the check itself takes well under a second), read back as one JSON line
per node.

The check asks each node only about what this job will put on it (`job_needs`, from the run
logs: the staged data, the memory snapshots, the checkpoint folder). A node that fails (its GPUs
do not answer NVML, wait for a reset, or their uncorrected ECC count grew since the node's last
check; it cannot hold the job's staged data; it has no route to the rendezvous address) or gives
no answer within `CHECK_TIMEOUT_S` is excluded like a lost node
(``plan.next_nodes``: a spare takes its place, else the job goes on with fewer nodes down to
``--min-nodes``), and the check runs again over the new set, until every node passed or too few
are left. `health_row` is what ``restarts.jsonl`` keeps of a check that excluded a node, so status
says why (``n2 excluded: /tmp full (0.1 GB free, the staged data needs 1.5 GB)``).

Never a reason to exclude, said once in the supervisor's line instead (`Checked.notes`): the
checkpoint folder's problem (it is on the shared filesystem: every node's alike, and excluding
nodes would not fix it), a memory snapshot that does not fit (snapshots step back), and an ECC
count a node shows at its first check (volatile: it counts since the driver loaded, an earlier
job's error included; what the supervisor keeps between checks is `Seen`).
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, NamedTuple

import yaml

from ddp_hpc.fsutil import file_size
from ddp_hpc.judge.nodefiles import rank_events
from ddp_hpc.runlogs.schema import CONFIG_FILE
from ddp_hpc.slurm.cli import SlurmCLI, SlurmError
from ddp_hpc.slurm.hostlist import compress
from ddp_hpc.supervise.plan import NodePlan, Policy, next_nodes

__all__ = ["Checked", "Needs", "Seen", "CHECK_TIMEOUT_S", "NO_CHECKPOINT_NEED_BYTES", "checkpoint_need",
           "job_needs", "check_args", "ecc_problems", "read_checks", "failures", "check_nodes", "health_row"]

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
    notes: tuple[str, ...] = ()     # said, no node excluded for them (the module's last paragraph)


@dataclass
class Seen:
    """What the supervisor keeps from one check to the next: each node's uncorrected ECC counts
    (node -> GPU -> count) and the notes already said (each is said once)."""

    ecc: dict[str, dict[str, int]] = field(default_factory=dict)
    said: set[str] = field(default_factory=set)


#: the supervisor's own (one supervisor process per allocation, checks before every start)
SEEN = Seen()


class Needs(NamedTuple):
    """What this job writes on a node: its checkpoint folders and one checkpoint's size, the
    memory snapshots' size (None: the job keeps none), its staged copies (bytes, path)."""

    ckpt_dirs: list[str]
    ckpt_bytes: int
    snapshot_bytes: int | None
    stage: list[tuple[int, str]]


def _size(path: str) -> int:
    """A checkpoint's size: its file's, or the sum of a checkpoint folder's files."""
    if not os.path.isdir(path):
        return file_size(path)
    return sum(file_size(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def checkpoint_need(log_dir: str | Path) -> tuple[list[str], int]:
    """(the checkpoint folder, the free space one checkpoint needs) from rank 0's newest
    ``checkpoint`` event: its file's folder and size; ([], `NO_CHECKPOINT_NEED_BYTES`) before the
    run wrote one."""
    events = rank_events(log_dir, 0).events
    for e in reversed(events):
        ckpt = e.get("path") if e.get("event") == "checkpoint" else None
        if isinstance(ckpt, str) and ckpt:
            return [os.path.dirname(os.path.abspath(ckpt))], max(_size(ckpt), 1)
    return [], NO_CHECKPOINT_NEED_BYTES


def _config_snapshots(log_dir: str | Path) -> bool:
    """A config job's ``config.yaml`` keeps memory snapshots (checkpoint.memory_every_steps not
    -1, checkpoint.resume on: the loop's `restore.node_store`); False for a script job."""
    try:
        cfg = yaml.safe_load(Path(log_dir, CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return False
    ck = (cfg or {}).get("checkpoint") if isinstance(cfg, dict) else None
    ck = ck if isinstance(ck, dict) else {}
    return ck.get("memory_every_steps", 0) != -1 and ck.get("resume", True) is not False


def job_needs(log_dir: str | Path) -> Needs:
    """What this job writes on a node, from its run logs: the checkpoint folder and size
    (`checkpoint_need`; none before the first checkpoint), memory snapshots when its config keeps
    them or rank 0's events show them (a restore from memory or a peer, a step's ``snapshot_s``),
    the newest ``stage`` event of each staged source. Nothing known: nothing to check."""
    events = rank_events(log_dir, 0).events
    dirs, need = checkpoint_need(log_dir)
    size = need if dirs else 0
    used = _config_snapshots(log_dir) or any(
        (e.get("event") == "restored" and e.get("source") in ("memory", "peer"))
        or (e.get("event") == "step" and "snapshot_s" in e) for e in events)
    stage = {str(e.get("src")): (int(e["bytes"]), e["path"]) for e in events
             if e.get("event") == "stage" and isinstance(e.get("bytes"), int) and isinstance(e.get("path"), str)
             and os.path.isabs(e["path"])}
    return Needs(dirs, size, size if used else None, list(stage.values()))


def check_args(nodes: list[str], again: bool, needs: Needs) -> list[str]:
    """srun's arguments for the check: one task on each of ``nodes``, no task's failure ending the
    others; ``again`` (a restart): --overlap, as the real step (``loop.step_args``)."""
    return ["--no-kill", *(["--overlap"] if again else []), "--kill-on-bad-exit=0", f"--nodes={len(nodes)}",
            f"--ntasks={len(nodes)}", "--ntasks-per-node=1", f"--nodelist={compress(nodes)}",
            sys.executable, "-m", "ddp_hpc.supervise.nodecheck", *[f"--dir={d}" for d in needs.ckpt_dirs],
            f"--need-bytes={needs.ckpt_bytes}",
            *([f"--snapshot-bytes={needs.snapshot_bytes}"] if needs.snapshot_bytes is not None else []),
            *[f"--stage={size}:{path}" for size, path in needs.stage]]


def ecc_problems(node: str, before: Mapping[str, int] | None, now: Mapping[str, int]) -> tuple[list[str], list[str]]:
    """(problems, notes) of a node's uncorrected volatile ECC counts ``now`` against its last
    check's (``before``; None: its first): only growth is a problem. A count first seen is said,
    never held against the node: it counts since the driver loaded, an earlier job's error too."""
    problems, notes = [], []
    for gpu, count in now.items():
        last = None if before is None else before.get(gpu)
        if last is None and count:
            notes.append(f"{node}: GPU {gpu} had {count} uncorrected ECC error(s) since the driver loaded "
                         "(excluded only if the count grows)")
        elif last is not None and count > last:
            problems.append(f"GPU {gpu}: uncorrected ECC errors grew from {last} to {count} "
                            "since the last health check")
    return problems, notes


def _once(seen: Seen, text: str) -> bool:
    """True the first time ``text`` (its figures in brackets aside) is to be said."""
    key = re.sub(r"\s*\([^)]*\)", "", text)
    if key in seen.said:
        return False
    seen.said.add(key)
    return True


def read_checks(nodes: list[str], returncode: int | None, out: str, seen: Seen) -> tuple[dict[str, str], list[str]]:
    """(node -> why, for the ``nodes`` that failed the check or gave no answer in ``out``; the
    notes not said before) from the check step's stdout (one JSON line per node; ``returncode``
    None: killed at the timeout). ``seen``'s ECC counts are compared and then updated."""
    recs: dict[str, dict] = {}
    for line in out.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("node") in nodes:
            recs[rec["node"]] = rec
    silent = (f"no answer to the health check within {CHECK_TIMEOUT_S:g} s" if returncode is None
              else f"no answer to the health check (srun exited with status {returncode})")
    out_of: dict[str, str] = {}
    notes: list[str] = []
    for node in nodes:
        rec = recs.get(node)
        if rec is None:
            out_of[node] = silent
            continue
        counts = {str(g): c for g, c in (rec.get("ecc") or {}).items() if isinstance(c, int)}
        grew, first = ecc_problems(node, seen.ecc.get(node), counts)
        seen.ecc[node] = {**seen.ecc.get(node, {}), **counts}
        problems = [str(p) for p in rec.get("problems") or ()] + grew
        if problems or not rec.get("ok"):
            out_of[node] = "; ".join(problems) or "failed the health check"
        said = [*(rec.get("shared") or ()), *(f"{node}: {n}" for n in rec.get("notes") or ()), *first]
        notes += [str(n) for n in said if _once(seen, str(n))]
    return out_of, notes


def failures(nodes: list[str], returncode: int | None, out: str) -> dict[str, str]:
    """`read_checks`'s node -> why, with nothing kept from an earlier check."""
    return read_checks(nodes, returncode, out, Seen())[0]


def _say(text: str) -> None:
    print(f"ddp_hpc supervise: health check: {text}", file=sys.stderr, flush=True)


def check_nodes(cli: SlurmCLI, plan: NodePlan, policy: Policy, env: Mapping[str, str], again: bool,
                log_dir: str, seen: Seen | None = None, say: Callable[[str], None] | None = _say) -> Checked:
    """Check every node of ``plan.active`` for what this job writes on it (`job_needs`); exclude
    those that fail (as lost nodes: spares first, then fewer nodes down to the floor) and check
    the new set again, until all pass. ``seen``: what earlier checks left (`SEEN` by default);
    ``say`` hears each note as it comes (the supervisor's stderr, beside its line of the check)."""
    t0, failed, words, rounds, notes = time.monotonic(), {}, "", 0, []
    seen = SEEN if seen is None else seen
    needs = job_needs(log_dir)
    while True:
        rounds += 1
        try:
            rc, out = cli.run_step(check_args(plan.active, again, needs), env, CHECK_TIMEOUT_S)
        except SlurmError as exc:   # srun could not start: the real step would fail the same way
            return Checked(plan, failed, f"health check not run: {exc}", round(time.monotonic() - t0, 3), rounds,
                           tuple(notes))
        bad, said = read_checks(plan.active, rc, out, seen)
        notes += said
        for note in said if say is not None else ():
            say(note)
        if not bad:
            return Checked(plan, failed, words, round(time.monotonic() - t0, 3), rounds, tuple(notes))
        failed.update(bad)
        try:
            plan, words = next_nodes(plan, list(bad), [], policy)
        except ValueError as exc:
            return Checked(None, failed, str(exc), round(time.monotonic() - t0, 3), rounds, tuple(notes))


def health_row(c: Checked, run: int, key) -> dict:
    """The line of restarts.jsonl for a check that excluded nodes, or noted what it excludes no
    node for (a checkpoint folder that is full, snapshots that will step back), before run ``run``
    (`schema.ALLOC_HEALTH_KEYS`)."""
    return {"health_check": run, "job_id": key, "time": round(time.time(), 3), "seconds": c.seconds,
            "excluded": dict(c.failed), "nodes_after": list(c.plan.active) if c.plan else [],
            "not_started": None if c.plan else c.change, "notes": list(c.notes)}
