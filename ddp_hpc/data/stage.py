"""Copy a dataset once per node to node-local storage, atomically, and reuse it across requeues.

Why: N ranks reading a shared filesystem become one sequential read per node; after that every
read is local.  Local rank 0 of each node copies; the other local ranks poll a completion marker
(a file, so no collective is open while the copy runs and no collective timeout can trip).

Guarantees:
* atomic: the copy goes to ``.tmp-*`` inside the stage folder, its size and xxh3-64 hash are checked
  against the source stream, it is renamed, and only then ``COMPLETE.json`` is written; nobody
  uses a copy without that marker, so a copy killed half-way is never used (the next copier
  deletes the leftovers).
* one copier per stage folder at a time (``fcntl.flock``, released by the kernel if the copier
  dies), so racing local ranks, or two ranks that both believe they are local rank 0, copy once.
* reuse: the folder is keyed by job id and source fingerprint, so a requeued job (same job id,
  new ``SLURM_RESTART_COUNT``) finds the verified copy and skips the shared read.
* sharing: node leaders that see one stage folder (pretend nodes on one machine, a ``/tmp`` that
  is not node-local) copy once between them: the first copies, the others find the marker under
  the lock and reuse the copy (not hashed again in the same attempt).  Each registers on it, and
  :func:`cleanup_staged` removes it when the last of them is done (:mod:`ddp_hpc.data.stagefolder`).
* free space is checked first; too little is a :class:`StageError` naming both sizes and the fix.
* trust: in a folder other users can write to (``/tmp``), the stage folders go to this user's own
  subfolder (:mod:`ddp_hpc.data.stagedir`); a stage folder or an sbcast copy is used only when it
  is this user's; a copy keeps its source's permissions (never wider than the umask allows).

With ``python -m ddp_hpc.data sbcast`` run first in the batch script, Slurm's ``sbcast`` has
already put a copy and its manifest on every node; the copier verifies and adopts it instead of
reading the shared filesystem (see :mod:`ddp_hpc.data.sbcast`).

The copy kernels are :mod:`ddp_hpc.data.copy`'s, the checksums :mod:`ddp_hpc.data.hashing`'s.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, replace

from ddp_hpc.data.copy import CopyProgress, copy_dir_tar, copy_file, kept_mode, source_kind, source_size
from ddp_hpc.data.errors import StageError
from ddp_hpc.data.hashing import file_hash
from ddp_hpc.data.stagearchive import unpack_archive
from ddp_hpc.data.stagedir import owned, private_root, resolve_stage_dir
from ddp_hpc.data.stagefolder import MARKER, USERS, folder_lock, read_users, register_user, unregister_and_remove
from ddp_hpc.fsutil import atomic_write_json

__all__ = ["stage", "stage_result", "StageRequest", "StageResult", "resolve_stage_dir", "cleanup_staged", "StageError",
           "stage_key", "sbcast_paths", "staged_here"]

log = logging.getLogger("ddp_hpc.data.stage")
FAILED = "FAILED.json"
SPACE_MARGIN = 16 << 20


def stage_key(src: str, job_id: str | None) -> str:
    """Folder name: job id + hash of the source path, size and mtime (a changed source restages)."""
    st = os.stat(src)
    inner = os.path.join(src, "data.mdb")
    if os.path.isfile(inner):
        st = os.stat(inner)
    fp = hashlib.sha1(f"{src}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:12]
    job = "".join(c if c.isalnum() or c in "-_." else "_" for c in (job_id or "nojob"))
    return f"ddp_hpc-stage-{job}-{os.path.basename(src.rstrip('/'))}-{fp}"


def _read_marker(folder: str) -> dict | None:
    try:
        with open(os.path.join(folder, MARKER)) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _staged_ok(folder: str, marker: dict, recheck: bool) -> bool:
    path = os.path.join(folder, marker["name"])
    try:
        if marker["kind"] == "dir":
            return os.path.isdir(path)  # manifest was checked when written; folders are not re-read
        target = os.path.join(path, "data.mdb") if marker["kind"] == "lmdb" else path
        if os.path.getsize(target) != marker["bytes"]:
            return False
        return not recheck or file_hash(target) == (marker["bytes"], marker.get("xxh3_64"))
    except OSError:
        return False


def staged_here(src: str, dest: str, job_id: str | None) -> bool:
    """A complete copy of ``src`` for job ``job_id`` is below ``dest`` on this node (its marker),
    or an ``sbcast`` copy of it waits there to be adopted (its manifest)."""
    src, dest = os.path.abspath(src), os.path.abspath(dest)
    key = stage_key(src, job_id)
    return _read_marker(os.path.join(private_root(dest), key)) is not None or owned(sbcast_paths(dest, key)[1])


def sbcast_paths(dest: str, key: str) -> tuple[str, str]:
    """(data, manifest) that ``ddp_hpc.data.sbcast`` leaves in ``dest`` on each node for ``key``."""
    data = os.path.join(dest, f".{key}.sbcast")
    return data, data + ".json"


def _adopt_sbcast(req: StageRequest, kind: str, folder: str) -> dict | None:
    """Install a copy ``sbcast`` left on this node (verified against its manifest); None if none."""
    src = req.src
    data, manifest = sbcast_paths(req.dest, os.path.basename(folder))
    if not (owned(data) and owned(manifest)):
        if os.path.lexists(manifest):
            log.warning("stage: ignoring %s and %s: not this user's files; copying instead", data, manifest)
        return None
    try:
        with open(manifest) as f:
            m = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    t0 = time.monotonic()
    try:
        got = file_hash(data)
    except OSError:
        got = None
    if m.get("src") != src or m.get("kind") != kind or got != (m.get("bytes"), m.get("xxh3_64")):
        log.warning("stage: ignoring the sbcast copy %s (manifest %s, local %s); copying instead", data,
                    {k: m.get(k) for k in ("src", "kind", "bytes", "xxh3_64")}, got)
        for p in (data, manifest):
            if os.path.exists(p):
                os.remove(p)
        return None
    name = os.path.basename(src.rstrip("/"))
    _clear_leftovers(folder)
    tmp = os.path.join(folder, f".tmp-{os.getpid()}-{name}")
    if kind == "dir":   # one tar archive of the folder (ddp_hpc.data.stagearchive)
        try:
            unpack_archive(data, tmp, m)
        except StageError as e:
            log.warning("stage: ignoring the sbcast archive %s: %s; copying instead", data, e.problem)
            _clear_leftovers(folder)
            for p in (data, manifest):
                os.remove(p)
            return None
        os.rename(tmp, os.path.join(folder, name))
        os.remove(data)
    elif kind == "lmdb":
        os.mkdir(tmp, 0o700)
        os.chmod(data, kept_mode(os.path.join(src, "data.mdb")))
        os.rename(data, os.path.join(tmp, "data.mdb"))
        os.chmod(tmp, kept_mode(src))
        os.rename(tmp, os.path.join(folder, name))
    else:
        os.chmod(data, kept_mode(src))
        os.rename(data, os.path.join(folder, name))
    os.remove(manifest)
    nbytes, files = (m["payload"], m["files"]) if kind == "dir" else (got[0], 1)
    marker = {"bytes": nbytes, "xxh3_64": got[1], "files": files, "name": name, "kind": kind, "src": src,
              "attempt": req.attempt, "method": "sbcast", "seconds": time.monotonic() - t0,
              "host": os.uname().nodename, "created": time.time()}
    atomic_write_json(os.path.join(folder, MARKER), marker, indent=None)
    log.info("stage: adopted the sbcast copy of %s in %s", src, folder)
    return marker


def _clear_leftovers(folder: str) -> None:
    """Delete what a dead copier left in ``folder`` (the caller holds the lock; the users stay)."""
    for leftover in os.listdir(folder):
        if leftover not in (MARKER, USERS):
            p = os.path.join(folder, leftover)
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)


def _do_copy(req: StageRequest, kind: str, folder: str) -> dict:
    src = req.src
    name = os.path.basename(src.rstrip("/"))
    _clear_leftovers(folder)
    total, files = source_size(src, kind)
    free = shutil.disk_usage(folder).free
    if free < total + SPACE_MARGIN:
        raise StageError(f"stage: {src!r} needs {total} bytes (+{SPACE_MARGIN >> 20} MiB margin) but "
                         f"{folder!r} has {free} bytes free",
                         "set data.stage_to to a larger node-local filesystem (slurm_tmpdir, tmpdir, shm or "
                         "an absolute path) or use data.io=lmdb without staging")
    tmp = os.path.join(folder, f".tmp-{os.getpid()}-{name}")
    bar = CopyProgress(total, f"stage {name}", req.progress)
    t0 = time.monotonic()
    try:
        if kind == "file":
            info = copy_file(src, tmp, total, bar)
        elif kind == "lmdb":
            os.mkdir(tmp, 0o700)
            info = copy_file(os.path.join(src, "data.mdb"), os.path.join(tmp, "data.mdb"), total, bar)
            os.chmod(tmp, kept_mode(src))
        else:
            os.mkdir(tmp, 0o700)
            info = copy_dir_tar(src, tmp, total, files, bar)
    finally:
        bar.close()
    os.rename(tmp, os.path.join(folder, name))
    marker = dict(info, name=name, kind=kind, src=src, attempt=req.attempt, method="copy",
                  seconds=time.monotonic() - t0, host=os.uname().nodename, created=time.time())
    atomic_write_json(os.path.join(folder, MARKER), marker, indent=None)
    return marker


@dataclass(frozen=True)
class StageResult:
    """What :func:`stage_result` did on this process, for the run log."""

    path: str            #: the node-local copy to read
    src: str             #: the shared source
    method: str          #: copy | sbcast (adopted) | reused (a verified copy was there) | waited
    bytes: int           #: size of the copy
    files: int           #: files in it (1 for a file or an LMDB)
    seconds: float       #: this call's wall time: lock wait + copy, adoption or check
    copy_seconds: float  #: how long the copy (or adoption) itself took, whoever made it
    made_by: str         #: ``job:restart`` of the attempt that made the copy
    users: tuple[str, ...] = ()  #: node leaders registered on the copy after this call

    @property
    def mb_per_s(self) -> float | None:
        """MB/s of the copy this call made (None for reused or waited: nothing was copied)."""
        if self.method not in ("copy", "sbcast"):
            return None
        return self.bytes / 1e6 / max(self.copy_seconds, 1e-9)


@dataclass(frozen=True)
class StageRequest:
    """One process's ask for a node-local copy of ``src`` below ``dest`` (default:
    ``resolve_stage_dir('auto')``) in attempt ``job_id:restart_count``.

    ``copier`` is True on local rank 0 of each node; the others wait for its marker (up to
    ``wait_timeout`` s, polling every ``poll_s``).  ``user`` names this node's leader (the same
    name on its waiting local ranks) when several node leaders may share ``dest``: the copier
    registers it on the copy (cleanup removes the copy only when the last registered leader is
    done, :func:`cleanup_staged`), and the waiters wait until their own leader has verified the
    copy in this attempt.  ``recheck`` re-reads a staged file/LMDB's hash once per attempt,
    locally; ``progress`` shows a bar (None: when stderr is a terminal)."""

    src: str | os.PathLike
    dest: str | None = None
    job_id: str | None = None
    restart_count: int = 0
    copier: bool = True
    user: str | None = None
    wait_timeout: float = 6 * 3600
    poll_s: float = 0.2
    recheck: bool = True
    progress: bool | None = None

    @property
    def attempt(self) -> str:
        """``job:restart``: the markers' name for this attempt."""
        return f"{self.job_id}:{self.restart_count}"


def stage(src: str | os.PathLike, dest: str | None = None, *, job_id: str | None = None,
          restart_count: int = 0, copier: bool = True, wait_timeout: float = 6 * 3600,
          poll_s: float = 0.2, recheck: bool = True, progress: bool | None = None) -> str:
    """Copy ``src`` below ``dest`` once; return the local path.  The arguments are those of
    :class:`StageRequest` (reuse of a verified copy is free); :func:`stage_result` says more."""
    return stage_result(StageRequest(src, dest, job_id=job_id, restart_count=restart_count, copier=copier,
                                     wait_timeout=wait_timeout, poll_s=poll_s, recheck=recheck,
                                     progress=progress)).path


def stage_result(request: StageRequest) -> StageResult:
    """:func:`stage` for a :class:`StageRequest`, returning what was done (copy, sbcast, reused,
    waited), bytes and seconds."""
    t0 = time.monotonic()
    req = replace(request, src=os.path.abspath(os.fspath(request.src)),
                  dest=os.path.abspath(request.dest or resolve_stage_dir("auto")))
    kind = source_kind(req.src)
    if not os.path.isdir(req.dest):
        raise StageError(f"stage: destination {req.dest!r} is not a directory",
                         "set data.stage_to to an existing node-local folder")
    folder = os.path.join(private_root(req.dest), stage_key(req.src, req.job_id))
    if req.copier:
        marker, method, users = _copy_once(req, kind, folder)
    else:
        marker, method, users = _wait_for_copy(req, folder), "waited", {}
    return StageResult(path=os.path.join(folder, marker["name"]), src=req.src, method=method,
                       bytes=int(marker["bytes"]), files=int(marker.get("files", 1)),
                       seconds=time.monotonic() - t0, copy_seconds=float(marker.get("seconds", 0.0)),
                       made_by=str(marker.get("attempt")), users=tuple(sorted(users)))


def _reuse(folder: str, dest: str, attempt: str, recheck: bool) -> dict | None:
    """The folder's marker if its copy can be used as it is (the caller holds the lock), else
    None, with a stale marker removed.  A copy made or verified by this attempt is not hashed
    again: on a shared stage folder only the first node leader reads it."""
    marker = _read_marker(folder)
    if marker is None:
        return None
    fresh = marker.get("attempt") == attempt or attempt in read_users(folder).values()
    if _staged_ok(folder, marker, recheck and not fresh):
        for p in sbcast_paths(dest, os.path.basename(folder)):  # a requeue's repeated sbcast
            if owned(p):
                os.remove(p)
        return marker
    os.remove(os.path.join(folder, MARKER))
    return None


def _copy_once(req: StageRequest, kind: str, folder: str) -> tuple[dict, str, dict]:
    """The copier: under the folder's lock, reuse a verified copy, else adopt sbcast's or copy;
    -> (marker, method, registered users)."""
    attempt = req.attempt
    with folder_lock(folder):
        os.makedirs(folder, exist_ok=True)  # under the lock: a cleanup may just have removed it
        if not owned(folder):
            raise StageError(f"stage: {folder!r} is not this user's folder", f"remove {folder}, or set "
                             "data.stage_to to a node-local folder of your own")
        marker = _reuse(folder, req.dest, attempt, req.recheck)
        if marker is not None:
            method = "reused"
            log.info("stage: reusing %s (made by attempt %s)", folder, marker.get("attempt"))
        else:
            try:
                marker = _adopt_sbcast(req, kind, folder) or _do_copy(req, kind, folder)
            except BaseException as e:
                failed = {"attempt": attempt, "error": getattr(e, "problem", str(e)), "hint": getattr(e, "hint", "")}
                atomic_write_json(os.path.join(folder, FAILED), failed, indent=None)
                raise
            method = marker["method"]
            log.info("stage: copied %s -> %s (%d bytes, %.1f s)", req.src, folder, marker["bytes"], marker["seconds"])
        users = register_user(folder, req.user, attempt) if req.user else read_users(folder)
        return marker, method, users


def _wait_for_copy(req: StageRequest, folder: str) -> dict:
    """Another local rank: poll for the copier's marker (or its failure) of this attempt; with
    ``req.user``, until that node leader has registered on the copy in this attempt."""
    attempt, user = req.attempt, req.user
    deadline = time.monotonic() + req.wait_timeout
    while True:
        marker = _read_marker(folder)
        if marker is not None and (user is None or read_users(folder).get(user) == attempt):
            return marker
        try:
            with open(os.path.join(folder, FAILED)) as f:
                failed = json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            failed = {}
        if failed.get("attempt") == attempt:
            raise StageError(f"stage: the copier on this node failed: {failed.get('error')}", failed.get("hint", ""))
        if time.monotonic() > deadline:
            raise StageError(f"stage: waited {req.wait_timeout:.0f} s for {os.path.join(folder, MARKER)} "
                             "(local rank 0 copies)", "check local rank 0's log, or raise the wait timeout")
        time.sleep(req.poll_s)


def cleanup_staged(path: str, user: str | None = None) -> tuple[str, list[str]]:
    """Remove a staged copy (the whole stage folder) under its lock, or only unregister ``user``
    while other node leaders sharing the folder still use it.

    -> ``(outcome, users left)``: ``removed``, ``kept`` or ``gone`` (another leader removed it).
    ``user=None`` removes the copy whoever uses it.  A removal that fails raises
    :class:`StageError` naming the folder and what is left in it."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.basename(folder).startswith("ddp_hpc-stage-"):
        raise StageError(f"cleanup_staged: {path!r} is not inside a ddp_hpc stage folder; refusing to delete",
                         "pass the path stage() returned")
    return unregister_and_remove(folder, user)
