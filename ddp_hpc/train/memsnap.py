"""In-memory snapshots: the newest training state in node-local shared memory, so that a restart
inside the allocation goes on from the last step instead of the last file checkpoint.

Where: ``/dev/shm`` (``$SLURM_TMPDIR`` when set and /dev/shm is absent), in this user's private
folder (``data.stagedir.private_root``: ``ddp_hpc-<uid>``, 0700, refused when anybody else could
have made it), then ``ddp_hpc-memsnap-<user>-<job id>[-<hash of the checkpoint directory>]/<node>/``
(0700). One folder per node: the
node's local rank 0 writes the model and optimizer state as ``ckpt-<step>.pt`` (the file
checkpoints' own format, ``train/checkpoint.py``), every rank writes its small part
(``rank<R>-<step>.pt``: its RNG states; the sampler position is global and in the state).

Atomic: each file is written under a temporary name and renamed (tmpfs needs no fsync), so a reader
sees a whole snapshot or the one before; older snapshots go only after the new one is renamed. The
files live outside the rank processes: a killed rank leaves them whole. The training thread only
copies the tensors into buffers kept between snapshots (pinned when on CUDA); a background thread
per rank writes them, at most one snapshot in flight per rank, and the model's writer holds the
node folder's lock, so never two model copies are in flight on one node.

When: every ``checkpoint.memory_every_steps`` steps; 0 (the default) chooses the interval from
the measured cost (the training thread's time per snapshot, the copy and any wait for the last
write) so that it stays at most 1% of the step time: every rank measures, and one all_reduce of
the largest cost ratio (after the first snapshot, then every `RETUNE_STEPS` steps) gives every
rank the same interval. Kept across a restart inside the allocation (the job id is the same);
removed at the loop's clean end (`MemSnapshots.finish`); the folders of jobs that ended without
one are swept when a later run's snapshots start on the node (`train/memsweep.py`).
"""
from __future__ import annotations

import hashlib
import math
import os
import pwd
import re
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ddp_hpc.data.stagedir import private_root
from ddp_hpc.dist import group_initialized
from ddp_hpc.env import job_facts
from ddp_hpc.fsutil import atomic_write_text, locked
from ddp_hpc.train.asyncsave import Snapshot
from ddp_hpc.train.checkpoint import FORMAT, checkpoint_path, list_checkpoints, rng_state
from ddp_hpc.train.memroom import does_not_fit, state_bytes
from ddp_hpc.train.memsweep import JOB_FILE, job_file_text, sweep_in_background

__all__ = ["NodeStore", "MemSnapshots", "store_for", "node_label", "RETUNE_STEPS", "TARGET_FRACTION", "event_of"]

TARGET_FRACTION = 0.01       # auto: a snapshot costs at most this share of the step time
RETUNE_STEPS = 100           # auto: the ranks agree on the interval again every this many steps
_PART = re.compile(r"^rank(\d+)-(\d{9})\.pt$")
_TMP = ".memsnap-tmp-"
PREFIX = "ddp_hpc-memsnap-"


def node_label(env) -> str:
    """This node's name (pretend nodes on one host: the host and the node's number)."""
    host = env.hostnames[env.node_rank] if env.node_rank < len(env.hostnames) else "node"
    return host if len(set(env.hostnames)) == len(env.hostnames) else f"{host}-node{env.node_rank}"


def _user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def job_folder(job_id: str | None, environ=None, key: str | None = None) -> Path:
    """``<private root>/ddp_hpc-memsnap-<user>-<job>[-<hash of key>]``: the job's snapshots, one
    folder per node. ``key``: the run's checkpoint directory (ddp_hpc's loop), so that two runs
    in one allocation (a sweep's tasks) never take each other's snapshots."""
    facts = job_facts(environ)
    base = "/dev/shm" if os.path.isdir("/dev/shm") else (facts.node_tmpdir or tempfile.gettempdir())
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", str(job_id or "nojob"))
    tail = f"-{hashlib.sha1(key.encode()).hexdigest()[:10]}" if key else ""
    return Path(private_root(base)) / f"{user_prefix()}{safe}{tail}"


def user_prefix() -> str:
    """The start of every job folder's name of this user."""
    return f"{PREFIX}{_user()}-"


def store_for(env, environ=None, key: str | None = None) -> NodeStore:
    """The node folder of this rank's job (``env``: its DistEnv; ``key``: see `job_folder`)."""
    return NodeStore(job_folder(env.job_id, environ, key) / node_label(env), node_label(env),
                     job=env.job_id, cluster=job_facts(environ).cluster)


def comm_device() -> torch.device:
    """Where a collective's tensor must be: the GPU for NCCL, else the CPU."""
    if group_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def event_of(warn: Callable[[str], None]) -> Callable[..., Any]:
    """Where the ``memsnap`` event goes: the run log whose ``warning`` ``warn`` is (the loop
    passes its log's), else this process's run log (the script API's `_warn` writes there)."""
    owner = getattr(warn, "__self__", None)
    if callable(getattr(owner, "event", None)):
        return owner.event

    def to_rank_log(name: str, **fields: Any) -> None:
        from ddp_hpc.progress import rank_log  # the script API's log; not imported by the loop
        log = rank_log()
        if log is not None:
            log.event(name, **fields)
    return to_rank_log


def _atomic_save(obj: Any, final: Path, prefix: str) -> None:
    """Write under a temporary name, then rename; a killed writer's earlier temporary files with
    the same prefix (only one writer writes under it) go first."""
    for stale in final.parent.glob(prefix + "*"):
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=final.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class NodeStore:
    """One node's snapshot folder: write a snapshot or a rank's part, find the newest, remove."""

    def __init__(self, folder: str | Path, node: str, job: str | None = None, cluster: str = ""):
        self.folder, self.node = Path(folder), node
        self.job, self.cluster = job, cluster      # named in the job folder's JOB_FILE (memsweep)

    def make(self) -> None:
        os.makedirs(self.folder.parent, mode=0o700, exist_ok=True)
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        marker = self.folder.parent / JOB_FILE
        if self.job and not marker.exists():
            atomic_write_text(marker, job_file_text(self.job, self.cluster), tmp_prefix=_TMP + "job-")

    def sweep_ended_jobs(self, note: Callable[[str], None] | None = None) -> threading.Thread | None:
        """Free the snapshots that ended jobs left beside this job's folder (`memsweep`), on a
        thread of its own (returned); only for a job folder of this user's naming."""
        job_dir, prefix = self.folder.parent, user_prefix()
        if not (self.job and job_dir.name.startswith(prefix)):
            return None
        return sweep_in_background(job_dir.parent, prefix, job_dir, _user(), self.cluster, note)

    def held_bytes(self) -> int:
        """The bytes of the model snapshots here (a new one replaces them)."""
        return sum(p.stat().st_size for _, p in list_checkpoints(self.folder) if p.exists())

    def newest(self) -> tuple[int, Path] | None:
        """(step, path) of the newest whole snapshot here, None when there is none."""
        found = list_checkpoints(self.folder)
        return found[0] if found else None

    def write_state(self, step: int, state: dict) -> Path:
        """The model's snapshot (under the node's lock: one model copy in flight per node);
        older ones are removed once it is whole."""
        final = checkpoint_path(self.folder, step)
        with locked(self.folder / ".write.lock"):
            _atomic_save({"format": FORMAT, **state, "step": step}, final, _TMP + "model-")
            for old_step, old in list_checkpoints(self.folder):
                if old_step != step:
                    old.unlink(missing_ok=True)
        return final

    def write_part(self, step: int, rank: int, part: dict) -> None:
        _atomic_save({"step": step, "rank": rank, **part}, self.folder / f"rank{rank}-{step:09d}.pt",
                     f"{_TMP}rank{rank}-")
        for p in self.folder.glob(f"rank{rank}-*.pt"):
            m = _PART.fullmatch(p.name)
            if m and int(m.group(2)) != step:
                p.unlink(missing_ok=True)

    def parts(self, step: int) -> dict[int, dict]:
        """Every rank's part of ``step`` held here (rank -> part)."""
        out = {}
        for p in self.folder.glob(f"rank*-{step:09d}.pt"):
            m = _PART.fullmatch(p.name)
            if m:
                try:
                    out[int(m.group(1))] = torch.load(p, map_location="cpu", weights_only=True)
                except Exception:  # noqa: BLE001 - a part that does not load is a part not held
                    continue
        return out

    def remove(self) -> None:
        """This node's folder, and the job's folder when no other node's is left in it."""
        shutil.rmtree(self.folder, ignore_errors=True)
        job_dir = self.folder.parent
        try:
            if not any(p.is_dir() for p in job_dir.iterdir()):     # no other node's folder left
                (job_dir / JOB_FILE).unlink(missing_ok=True)
                job_dir.rmdir()
        except OSError:
            pass


class MemSnapshots:
    """The loop's snapshots: `after_step` on every rank after each optimizer step."""

    def __init__(self, store: NodeStore, *, rank: int, local_rank: int, every: int,
                 device: torch.device, distributed: bool, warn: Callable[[str], None],
                 nodes: list[str] | None = None):
        self.store, self.rank, self.writes_model = store, rank, local_rank == 0
        self.nodes = list(nodes or [store.node])      # this run's nodes: a restore names the lost
        self.auto, self.every = every == 0, max(every, 1)
        self.device, self.distributed, self.warn = device, distributed, warn
        self.event = event_of(warn)           # the `memsnap` event of a step back: status shows it
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="ddp_hpc-memsnap")
        self.pending: Future | None = None
        self.pending_step: int | None = None  # the step of the snapshot in flight
        self.copies = Snapshot()              # buffers kept between snapshots (pinned on CUDA)
        self.cost_s = self.step_s = 0.0       # the newest snapshot's cost; the step time (EMA)
        self.spent_s = 0.0                    # the training thread's seconds in snapshots (`take_spent`)
        self.start_step: int | None = None
        self.last_t: float | None = None
        self.taken = 0
        self.failed = False                   # stepped back for the run (`step_back`)
        self.checked = not self.writes_model  # the room for the model's snapshots (memroom.py)
        store.make()

    # ------------------------------------------------------------------ when
    def due(self, step: int) -> bool:
        if self.auto and self.taken == 0:
            return step == self.start_step + 1
        return step % self.every == 0

    def _retune(self, step: int) -> None:
        """auto: every rank the same interval, from the largest cost ratio of any rank."""
        since = step - self.start_step
        if not (since == 2 or (since > 2 and step % RETUNE_STEPS == 0)):
            return
        ratio = torch.tensor([self.cost_s / self.step_s if self.step_s > 0 else 0.0], dtype=torch.float64)
        if self.distributed:
            ratio = ratio.to(comm_device())
            dist.all_reduce(ratio, op=dist.ReduceOp.MAX)
        self.every = max(1, math.ceil(float(ratio.item()) / TARGET_FRACTION - 1e-9))

    def after_step(self, step: int, state: Callable[[], dict]) -> None:
        """Called on every rank after step ``step``: takes a snapshot when due (``state()``: this
        rank's training state without RNG states; only the node's local rank 0 calls it)."""
        now = time.perf_counter()
        if self.start_step is None:
            self.start_step = step - 1
        elif self.last_t is not None:
            gap = now - self.last_t
            self.step_s = gap if self.step_s == 0 else 0.9 * self.step_s + 0.1 * gap
        if self.due(step) and not self.failed:
            self.take(step, state)
            self.taken += 1
            self.cost_s = time.perf_counter() - now
            self.spent_s += self.cost_s
        if self.auto:
            self._retune(step)
        self.last_t = time.perf_counter()

    def take_spent(self) -> float:
        """The training thread's seconds in snapshots since the last call (the ``snapshot_s`` of
        a step event, which goodput counts as checkpoint time)."""
        spent, self.spent_s = self.spent_s, 0.0
        return spent

    # ------------------------------------------------------------------ how
    def take(self, step: int, state: Callable[[], dict]) -> None:
        """Copy the state on this thread (after the last write ended); the writer does the rest.
        Nothing once the snapshots stepped back (a script calls this every step)."""
        self.wait()
        if self.failed:
            return
        part = {"rng": rng_state()}
        copy = None
        if self.writes_model:
            live = {**state(), "nodes": self.nodes}
            if not self.checked:          # before the first copy: does it fit at all?
                self.checked = True
                why = does_not_fit(state_bytes(live), self.store.folder, self.store.held_bytes())
                if why is not None:
                    self.step_back(why, step)
                    return
            copy = self.copies.take(live)
            self.copies.ready()
        self.pending, self.pending_step = self.pool.submit(self._write, step, copy, part), step

    def step_back(self, why: str, step: int | None) -> None:
        """Snapshots off for the rest of the run (file checkpoints go on): one warning, one
        ``memsnap`` event for status, the copy's buffers freed."""
        self.failed = True
        self.warn(f"{why} (to turn them off: checkpoint.memory_every_steps=-1)")
        try:
            self.event("memsnap", status="off", why=why, step=step)
        except Exception:  # noqa: BLE001 - the run log is a witness, never a reason to stop
            pass
        self._free()

    def _free(self) -> None:
        """The copy's buffers given back (pinned memory also from torch's cache of it)."""
        self.copies = Snapshot()
        if self.device.type == "cuda" and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()

    def _write(self, step: int, copy: dict | None, part: dict) -> None:
        if copy is not None:
            self.store.write_state(step, copy)
        self.store.write_part(step, self.rank, part)

    def wait(self) -> None:
        """The last snapshot written; a failure (a full /dev/shm: the writer left no partial
        file) steps back for the run."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            pending.result()
        except Exception as exc:  # noqa: BLE001 - the memory tier is a cache: training goes on
            first = (str(exc).strip().splitlines() or [""])[0]
            self.step_back(f"memory snapshots off: cannot write into {self.store.folder}: "
                           f"{type(exc).__name__}: {first}; file checkpoints go on", self.pending_step)

    def close(self) -> None:
        """Writes done, the writer thread gone, the copy's buffers freed."""
        self.wait()
        self.pool.shutdown(wait=True)
        self._free()

    def finish(self) -> None:
        """The run's clean end: every rank's writes done, then each node's folder removed (no
        rank goes on before, so none reads a folder while it goes)."""
        self.close()
        if self.distributed:
            dist.barrier()
        if self.writes_model:
            self.store.remove()
        if self.distributed:
            dist.barrier()
