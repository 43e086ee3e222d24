"""Free the memory snapshots of jobs that ended without a clean end.

A run removes its snapshots when it ends cleanly (`memsnap.MemSnapshots.finish`). A job that
failed, was cancelled, ran out of time or lost a node leaves its node folders behind in
``/dev/shm``: node memory, a model and optimizer state per job and node, held until the node
reboots unless the site's epilog cleans up. So when a run's snapshots start on a node, the node's
local rank 0 sweeps this user's other job folders there, on a thread of its own (training does not
wait for the scheduler's answer), and removes those whose job has ended:

- a Slurm job (its key ``123`` or ``123_4``): ``squeue --states=all`` lists it in a final state
  (completed, failed, cancelled, timed out, ...) or no longer lists it. Every state, not squeue's
  default: within MinJobAge of a ``scontrol requeue`` the default leaves out the job that will
  run again under the same id, with these snapshots to restore from. Any other state (pending,
  requeued, held, suspended, running, one this code does not know) keeps the folder, and so does
  an squeue that fails, times out or prints what cannot be read: nothing is removed then.
- a local job (``local-...``, `ddp_hpc.launch`): no process of this user on this machine carries
  its ``DDP_HPC_JOB_ID`` and nothing was written in its folder for `LOCAL_IDLE_S`.

Each job folder names its job and cluster in a ``.job`` file (`memsnap.NodeStore.make`); a folder
of another cluster's job is left alone, and one without the file is judged by its name when that
is unambiguous (a Slurm key), else left alone too.
"""
from __future__ import annotations

import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

from ddp_hpc.slurm.cli import SlurmCLI
from ddp_hpc.slurm.states import parse_state

__all__ = ["JOB_FILE", "LOCAL_IDLE_S", "SLURM_KEY", "job_file_text", "folder_job", "live_slurm_keys",
           "local_alive", "stale", "sweep", "sweep_in_background"]

JOB_FILE = ".job"             # in a job folder: the job's key, then its cluster's name
LOCAL_IDLE_S = 3600.0         # a local job's folder unwritten this long, and no process of it: ended
SQUEUE_TIMEOUT_S = 30.0
SLURM_KEY = re.compile(r"^\d+(?:_\d+)?$")


def job_file_text(key: str, cluster: str) -> str:
    return f"{key}\n{cluster}\n"


def folder_job(folder: Path, prefix: str) -> tuple[str | None, str | None]:
    """(job key, cluster name) of a job folder: its ``.job`` file, else its name when that is a
    Slurm key (``<prefix>123``, optionally ``-<10 hex>``; cluster None: unknown). (None, None)
    when it cannot be told."""
    try:
        lines = (folder / JOB_FILE).read_text(encoding="utf-8").splitlines()
        if lines and lines[0].strip():
            return lines[0].strip(), (lines[1].strip() if len(lines) > 1 else "")
    except OSError:
        pass
    m = re.fullmatch(re.escape(prefix) + r"(\d+(?:_\d+)?)(?:-[0-9a-f]{10})?", folder.name)
    return (m.group(1), None) if m else (None, None)


def live_slurm_keys(user: str, cli=None) -> set[str] | None:
    """This user's jobs the scheduler lists in any state but a final one (pending, requeued,
    held, suspended, running, unknown), as the keys `env.job.job_key` makes (``123`` and, for an
    array task, ``123_4``); None when squeue cannot be asked or its answer cannot be read."""
    cli = cli or SlurmCLI(timeout=SQUEUE_TIMEOUT_S)
    try:
        rows = cli.squeue(user=user, all_states=True)
    except Exception:  # noqa: BLE001 - no answer: nothing can be called ended
        return None
    keys = set()
    for row in rows:
        if parse_state(row.get("State")).job_state.terminal:
            continue            # ended within MinJobAge: its folder may go
        for field in ("JobArrayID", "JobID"):
            if row.get(field):
                keys.add(row[field].strip())
    return keys


def local_alive(key: str, proc: str = "/proc") -> bool:
    """A process of this user on this machine carries ``DDP_HPC_JOB_ID=key``."""
    needle = f"DDP_HPC_JOB_ID={key}".encode()
    uid = os.getuid()
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        try:
            if os.stat(f"{proc}/{pid}").st_uid != uid:
                continue
            with open(f"{proc}/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    return True
        except OSError:
            continue
    return False


def _last_write(folder: Path) -> float:
    """The newest change to ``folder`` or a folder or file below it."""
    newest = 0.0
    for path in (folder, *folder.rglob("*")):
        try:
            newest = max(newest, path.lstat().st_mtime)
        except OSError:
            continue
    return newest


def stale(folders: Iterable[Path], prefix: str, live: Callable[[], set[str] | None], cluster: str = "",
          alive: Callable[[str], bool] = local_alive, now: float | None = None) -> list[Path]:
    """The job folders among ``folders`` whose job has ended (see the module's rules; ``cluster``:
    this job's cluster name, SLURM_CLUSTER_NAME). ``live`` is asked once, only when a folder of
    a Slurm job of this cluster is there to judge."""
    now = time.time() if now is None else now
    asked, keys = False, None
    out = []
    for folder in folders:
        key, its_cluster = folder_job(folder, prefix)
        if key is None:
            continue
        if SLURM_KEY.fullmatch(key):
            if its_cluster is not None and its_cluster != cluster:
                continue        # another cluster's job: this one's squeue cannot tell
            if not asked:
                asked, keys = True, live()
            if keys is not None and key not in keys:
                out.append(folder)
        elif now - _last_write(folder) > LOCAL_IDLE_S and not alive(key):
            out.append(folder)
    return out


def _size(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        try:
            total += path.lstat().st_size if path.is_file() else 0
        except OSError:
            continue
    return total


def sweep(root: Path, prefix: str, own: Path, user: str, cluster: str = "",
          note: Callable[[str], None] | None = None) -> list[Path]:
    """Remove the ended jobs' folders ``root/<prefix>*`` other than ``own``; ``note`` hears what
    was freed. Returns the folders removed."""
    folders = [p for p in root.glob(prefix + "*") if p.is_dir() and not p.is_symlink() and p != own]
    gone = stale(folders, prefix, lambda: live_slurm_keys(user), cluster)
    if not gone:
        return []
    keys = ", ".join(sorted(str(folder_job(f, prefix)[0] or f.name) for f in gone))
    freed = 0
    for folder in gone:
        freed += _size(folder)
        shutil.rmtree(folder, ignore_errors=True)
    if note is not None:
        note(f"memory snapshots: freed {freed / 2**20:.1f} MiB in {root} left by ended jobs ({keys})")
    return gone


def sweep_in_background(root: Path, prefix: str, own: Path, user: str, cluster: str = "",
                        note: Callable[[str], None] | None = None) -> threading.Thread:
    """`sweep` on a daemon thread (its failure is only a missed clean-up)."""
    def run():
        try:
            sweep(root, prefix, own, user, cluster, note)
        except Exception:  # noqa: BLE001 - a clean-up that failed costs nothing now
            pass

    thread = threading.Thread(target=run, name="ddp_hpc-memsnap-sweep", daemon=True)
    thread.start()
    return thread
