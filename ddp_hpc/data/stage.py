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
* free space is checked first; too little is a :class:`StageError` naming both sizes and the fix.

With ``python -m ddp_hpc.data sbcast`` run first in the batch script, Slurm's ``sbcast`` has
already put a copy and its manifest on every node; the copier verifies and adopts it instead of
reading the shared filesystem (see :mod:`ddp_hpc.data.sbcast`).

What is copied: a file (in-kernel, hashed); an LMDB folder (its ``data.mdb`` only: readers open
with ``lock=False``); any other folder as one ``tar`` stream (one sequential reader on the
shared side) unpacked here with a hash manifest re-checked from disk.

The checksum is xxHash's XXH3-64 (the ``xxhash`` package): about 25 GB/s on one core, against
about 6 GB/s for zlib's crc32, so hashing both the source and the copy costs a few percent of
the copy instead of half of it (``bench/io.py`` measures staging against ``cp``).

"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import queue
import shutil
import subprocess
import tarfile
import tempfile
import threading
import time

import xxhash

from ddp_hpc.data import fsio
from ddp_hpc.fsutil import atomic_write_json

__all__ = ["stage", "resolve_stage_dir", "cleanup_staged", "StageError", "stage_key"]

log = logging.getLogger("ddp_hpc.data.stage")
CHUNK = 8 << 20
KERNEL_CHUNK = 16 << 20  # in-kernel copy calls; the copy's hash trails the copy by one chunk
HASH_BUF = 4 << 20
MARKER = "COMPLETE.json"
FAILED = "FAILED.json"
SPACE_MARGIN = 16 << 20


class StageError(RuntimeError):
    """Staging failed or was refused; the message names the values and ends with a HINT."""


def resolve_stage_dir(stage_to: str = "auto", environ=None) -> str:
    """Map ``data.stage_to`` to a folder: auto | slurm_tmpdir | tmpdir | shm | an absolute path."""
    environ = os.environ if environ is None else environ
    if stage_to == "auto":
        return environ.get("SLURM_TMPDIR") or environ.get("TMPDIR") or tempfile.gettempdir()
    if stage_to == "slurm_tmpdir":
        if not environ.get("SLURM_TMPDIR"):
            raise StageError("data.stage_to=slurm_tmpdir but SLURM_TMPDIR is not set in this task; "
                             "HINT: use data.stage_to=tmpdir or an absolute node-local path "
                             "(your site's job-local scratch)")
        return environ["SLURM_TMPDIR"]
    if stage_to == "tmpdir":
        return environ.get("TMPDIR") or tempfile.gettempdir()
    if stage_to == "shm":
        if not os.path.isdir("/dev/shm"):
            raise StageError("data.stage_to=shm but /dev/shm does not exist here; HINT: use data.stage_to=tmpdir")
        return "/dev/shm"
    if os.path.isabs(stage_to):
        return stage_to
    raise StageError(f"data.stage_to={stage_to!r} is not auto, slurm_tmpdir, tmpdir, shm or an absolute path; "
                     "HINT: set data.stage_to=auto (SLURM_TMPDIR, then TMPDIR, then /tmp)")


def _kind(src: str) -> str:
    if os.path.isfile(src):
        return "file"
    if os.path.isdir(src):
        return "lmdb" if os.path.isfile(os.path.join(src, "data.mdb")) else "dir"
    raise StageError(f"stage: source {src!r} does not exist; HINT: check data.lmdb_path / data.kwargs.root")


def _source_size(src: str, kind: str) -> tuple[int, int]:
    """(bytes, files) of what will be copied (a walk of stats for folders, on the copier only)."""
    if kind == "file":
        return os.path.getsize(src), 1
    if kind == "lmdb":
        return os.path.getsize(os.path.join(src, "data.mdb")), 1
    total = files = 0
    for dirpath, _, names in os.walk(src):
        for n in names:
            p = os.path.join(dirpath, n)
            if os.path.isfile(p) and not os.path.islink(p):
                total += os.path.getsize(p)
                files += 1
    return total, files


def stage_key(src: str, job_id: str | None) -> str:
    """Folder name: job id + hash of the source path, size and mtime (a changed source restages)."""
    st = os.stat(src)
    inner = os.path.join(src, "data.mdb")
    if os.path.isfile(inner):
        st = os.stat(inner)
    fp = hashlib.sha1(f"{src}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:12]
    job = "".join(c if c.isalnum() or c in "-_." else "_" for c in (job_id or "nojob"))
    return f"ddp_hpc-stage-{job}-{os.path.basename(src.rstrip('/'))}-{fp}"


def _copy_stream(src, dst_path: str, total: int, progress) -> tuple[int, int]:
    """Copy a stream (a tar member) to a new file; -> (bytes, xxh3-64)."""
    h, n = xxhash.xxh3_64(), 0
    with open(dst_path, "wb", buffering=0) as out:
        while True:
            chunk = src.read(CHUNK)
            if not chunk:
                break
            h.update(chunk)
            out.write(chunk)
            n += len(chunk)
            progress(len(chunk))
    return n, h.intdigest()


class _NoKernelCopy(Exception):
    """Neither copy_file_range nor sendfile works between these two files."""


def _kernel_copy_chunk(sfd: int, dfd: int, off: int, count: int, mode: list) -> int:
    """Copy [off, off+count) in the kernel like ``cp`` (copy_file_range, else sendfile)."""
    if mode[0] == "cfr":
        try:
            return os.copy_file_range(sfd, dfd, count, off, off)
        except OSError as e:
            if off or e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                raise
            mode[0] = "sendfile"
    try:
        os.lseek(dfd, off, os.SEEK_SET)
        return os.sendfile(dfd, sfd, off, count)
    except OSError as e:
        if off == 0 and e.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise _NoKernelCopy from e
        raise


def _copy_file_kernel(src: str, dst: str, total: int, progress) -> tuple[int, int, int]:
    """In-kernel copy with both hashes computed beside it; -> (bytes, src xxh3-64, dst xxh3-64).

    The data is copied in the kernel (like ``cp``) chunk by chunk; one thread follows the copy,
    hashing each finished chunk of the source (now in the page cache: no second read of the
    shared filesystem) and then the same chunk of the copy.  It ``pread``s into a small reused
    buffer (cheaper than faulting in a memory map) and xxhash releases the GIL, so on a second
    core the verification hides behind the copy."""
    with open(src, "rb") as fs, open(dst, "wb+") as fd:
        size = os.fstat(fs.fileno()).st_size
        if size != total:
            raise StageError(f"stage: {src!r} is {size} bytes, expected {total} (file changed?); "
                             "HINT: stage again once the source is stable")
        if size == 0:
            return 0, 0, 0
        written: queue.Queue = queue.Queue()
        out: dict = {}

        def follow(ends):
            view = memoryview(bytearray(HASH_BUF))
            state = {fs.fileno(): [xxhash.xxh3_64(), 0], fd.fileno(): [xxhash.xxh3_64(), 0]}
            for end in ends:
                for fileno, hp in state.items():
                    while hp[1] < end:
                        k = os.preadv(fileno, [view[:min(HASH_BUF, end - hp[1])]], hp[1])
                        if k <= 0:
                            break  # shorter than expected: the count stays short and verification fails
                        hp[0].update(view[:k])
                        hp[1] += k
            out["src"], out["dst"] = [(n, h.intdigest()) for h, n in state.values()]

        threads = [threading.Thread(target=follow, args=(iter(written.get, None),), daemon=True)]
        for t in threads:
            t.start()
        off, mode = 0, ["cfr"]
        try:
            while off < size:
                k = _kernel_copy_chunk(fs.fileno(), fd.fileno(), off, min(KERNEL_CHUNK, size - off), mode)
                if k <= 0:
                    raise StageError(f"stage: {src!r} ended at {off} of {size} bytes (truncated while copying?)")
                off += k
                written.put(off)
                progress(k)
        finally:
            written.put(None)
            for t in threads:
                t.join()
        if "src" not in out or "dst" not in out:
            raise StageError(f"stage: hashing {src!r} -> {dst!r} failed (see the thread error above)")
        (sn, sh), (dn, dh) = out["src"], out["dst"]
        # a hash that did not cover all `off` bytes can never match: verification then fails
        return off, (sh if sn == off else -2), (dh if dn == off else -1)


def _copy_file(src: str, dst: str, total: int, progress) -> dict:
    fsio.note_open(src)
    try:
        n, sh, dh = _copy_file_kernel(src, dst, total, progress)
    except _NoKernelCopy:  # e.g. a filesystem without sendfile support: stream through Python
        with open(src, "rb") as f:
            n, sh = _copy_stream(f, dst, total, progress)
        dh = _file_hash(dst)[1]
    fsio.note_bytes(src, n)
    if n != total:
        raise StageError(f"stage: read {n} bytes from {src!r}, expected {total} (file changed while copying?); "
                         "HINT: stage again once the source is stable")
    dn = os.path.getsize(dst)
    if (dn, dh) != (n, sh):
        raise StageError(f"stage: copy {dst!r} has {dn} bytes hash {dh & (2**64 - 1):016x}, source {n} bytes "
                         f"hash {sh & (2**64 - 1):016x}; HINT: the node-local disk may be faulty, try data.stage_to=shm")
    return {"bytes": n, "xxh3_64": sh, "files": 1}


def _file_hash(path: str) -> tuple[int, int]:
    """(bytes, xxh3-64) of a file, read through a fixed buffer."""
    h, n = xxhash.xxh3_64(), 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            k = f.readinto(buf)
            if not k:
                return n, h.intdigest()
            h.update(view[:k])
            n += k


def _manifest_line(name: str, size: int, content_hash: int) -> bytes:
    return f"{name}\0{size}\0{content_hash:016x}\n".encode()


def _copy_dir_tar(src: str, dst: str, total: int, files: int, progress) -> dict:
    """One ``tar -c`` stream from the shared side, unpacked here with a hash manifest."""
    fsio.note_open(src)  # counted as one stream open; tar's own opens happen outside this process
    proc = subprocess.Popen(["tar", "-C", src, "-cf", "-", "--", "."], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    manifest, nbytes, nfiles = xxhash.xxh3_64(), 0, 0
    names = []
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tf:
            for m in tf:
                name = os.path.normpath(m.name)
                if name.startswith("..") or os.path.isabs(name):
                    raise StageError(f"stage: unsafe member {m.name!r} in the tar stream of {src!r}")
                target = os.path.join(dst, name)
                if m.isdir():
                    os.makedirs(target, exist_ok=True)
                elif m.isfile():
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    n, h = _copy_stream(tf.extractfile(m), target, m.size, progress)
                    manifest.update(_manifest_line(name, n, h))
                    names.append(name)
                    nbytes += n
                    nfiles += 1
    finally:
        rc = proc.wait()
        err = proc.stderr.read().decode(errors="replace").strip()
        proc.stderr.close()
    fsio.note_bytes(src + "/", nbytes)
    if rc != 0:
        raise StageError(f"stage: tar of {src!r} failed (exit {rc}): {err}; HINT: check read permissions on the source")
    if (nbytes, nfiles) != (total, files):
        raise StageError(f"stage: unpacked {nfiles} files / {nbytes} bytes from {src!r}, expected {files} / "
                         f"{total} (source changed while copying?); HINT: stage again once it is stable")
    check = xxhash.xxh3_64()
    for name in names:  # re-read from disk: what we use is what was sent
        check.update(_manifest_line(name, *_file_hash(os.path.join(dst, name))))
    if check.intdigest() != manifest.intdigest():
        raise StageError(f"stage: manifest checksum of {dst!r} differs from the stream's; "
                         "HINT: the node-local disk may be faulty, try data.stage_to=shm")
    return {"bytes": nbytes, "xxh3_64": manifest.intdigest(), "files": nfiles}


class _Progress:
    """tqdm on a tty, else a log line every 10 s."""

    def __init__(self, total: int, desc: str, show: bool | None):
        self.total, self.desc, self.done, self.last = total, desc, 0, time.monotonic()
        self.bar = None
        if show if show is not None else os.isatty(2):
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True)

    def __call__(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif time.monotonic() - self.last > 10:
            self.last = time.monotonic()
            log.info("%s: %d / %d MiB", self.desc, self.done >> 20, self.total >> 20)

    def close(self):
        if self.bar is not None:
            self.bar.close()


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
        return not recheck or _file_hash(target) == (marker["bytes"], marker.get("xxh3_64"))
    except OSError:
        return False


def sbcast_paths(dest: str, key: str) -> tuple[str, str]:
    """(data, manifest) that ``ddp_hpc.data.sbcast`` leaves in ``dest`` on each node for ``key``."""
    data = os.path.join(dest, f".{key}.sbcast")
    return data, data + ".json"


def _adopt_sbcast(src: str, kind: str, dest: str, folder: str, attempt: str) -> dict | None:
    """Install a copy ``sbcast`` left on this node (verified against its manifest); None if none."""
    data, manifest = sbcast_paths(dest, os.path.basename(folder))
    try:
        with open(manifest) as f:
            m = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    t0 = time.monotonic()
    try:
        got = _file_hash(data)
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
    if kind == "lmdb":
        tmp = os.path.join(folder, f".tmp-{os.getpid()}-{name}")
        os.mkdir(tmp)
        os.rename(data, os.path.join(tmp, "data.mdb"))
        os.rename(tmp, os.path.join(folder, name))
    else:
        os.rename(data, os.path.join(folder, name))
    os.remove(manifest)
    marker = {"bytes": got[0], "xxh3_64": got[1], "files": 1, "name": name, "kind": kind, "src": src,
              "attempt": attempt, "method": "sbcast", "seconds": time.monotonic() - t0,
              "host": os.uname().nodename, "created": time.time()}
    atomic_write_json(os.path.join(folder, MARKER), marker, indent=None)
    log.info("stage: adopted the sbcast copy of %s in %s", src, folder)
    return marker


def _clear_leftovers(folder: str) -> None:
    """Delete what a dead copier left in ``folder`` (the caller holds the lock)."""
    for leftover in os.listdir(folder):
        if leftover != MARKER:
            p = os.path.join(folder, leftover)
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)


def _do_copy(src: str, kind: str, folder: str, attempt: str, progress_show) -> dict:
    name = os.path.basename(src.rstrip("/"))
    _clear_leftovers(folder)
    total, files = _source_size(src, kind)
    free = shutil.disk_usage(folder).free
    if free < total + SPACE_MARGIN:
        raise StageError(f"stage: {src!r} needs {total} bytes (+{SPACE_MARGIN >> 20} MiB margin) but "
                         f"{folder!r} has {free} bytes free; HINT: set data.stage_to to a larger node-local "
                         "filesystem (slurm_tmpdir, tmpdir, shm or an absolute path) or use data.io=lmdb "
                         "without staging")
    tmp = os.path.join(folder, f".tmp-{os.getpid()}-{name}")
    bar = _Progress(total, f"stage {name}", progress_show)
    t0 = time.monotonic()
    try:
        if kind == "file":
            info = _copy_file(src, tmp, total, bar)
        elif kind == "lmdb":
            os.mkdir(tmp)
            info = _copy_file(os.path.join(src, "data.mdb"), os.path.join(tmp, "data.mdb"), total, bar)
        else:
            os.mkdir(tmp)
            info = _copy_dir_tar(src, tmp, total, files, bar)
    finally:
        bar.close()
    os.rename(tmp, os.path.join(folder, name))
    marker = dict(info, name=name, kind=kind, src=src, attempt=attempt, method="copy",
                  seconds=time.monotonic() - t0, host=os.uname().nodename, created=time.time())
    atomic_write_json(os.path.join(folder, MARKER), marker, indent=None)
    return marker


def stage(src: str | os.PathLike, dest: str | None = None, *, job_id: str | None = None,
          restart_count: int = 0, copier: bool = True, wait_timeout: float = 6 * 3600,
          poll_s: float = 0.2, recheck: bool = True, progress: bool | None = None) -> str:
    """Copy ``src`` below ``dest`` (default: ``resolve_stage_dir('auto')``) once; return the local path.

    ``copier`` is True on local rank 0 of each node; others pass False and wait for the marker
    (up to ``wait_timeout`` seconds).  Reuse of a verified copy is free (``recheck`` re-reads a
    staged file/LMDB's hash once, locally).
    """
    src = os.path.abspath(os.fspath(src))
    dest = os.path.abspath(dest or resolve_stage_dir("auto"))
    kind = _kind(src)
    if not os.path.isdir(dest):
        raise StageError(f"stage: destination {dest!r} is not a directory; HINT: set data.stage_to to an "
                         "existing node-local folder")
    folder = os.path.join(dest, stage_key(src, job_id))
    attempt = f"{job_id}:{restart_count}"
    if copier:
        os.makedirs(folder, exist_ok=True)
        with open(folder + ".lock", "a+") as lockf:
            fcntl.flock(lockf, fcntl.LOCK_EX)  # released by the kernel if we die
            try:
                marker = _read_marker(folder)
                if marker is not None and _staged_ok(folder, marker, recheck):
                    log.info("stage: reusing %s (made by attempt %s)", folder, marker.get("attempt"))
                    for p in sbcast_paths(dest, os.path.basename(folder)):  # a requeue's repeated sbcast
                        if os.path.exists(p):
                            os.remove(p)
                else:
                    if marker is not None:
                        os.remove(os.path.join(folder, MARKER))
                    try:
                        marker = (_adopt_sbcast(src, kind, dest, folder, attempt)
                                  or _do_copy(src, kind, folder, attempt, progress))
                    except BaseException as e:
                        atomic_write_json(os.path.join(folder, FAILED), {"attempt": attempt, "error": str(e)}, indent=None)
                        raise
                    log.info("stage: copied %s -> %s (%d bytes, %.1f s)", src, folder, marker["bytes"], marker["seconds"])
            finally:
                fcntl.flock(lockf, fcntl.LOCK_UN)
        return os.path.join(folder, marker["name"])
    deadline = time.monotonic() + wait_timeout
    while True:
        marker = _read_marker(folder)
        if marker is not None:
            return os.path.join(folder, marker["name"])
        try:
            with open(os.path.join(folder, FAILED)) as f:
                failed = json.load(f)
            if failed.get("attempt") == attempt:
                raise StageError(f"stage: the copier on this node failed: {failed.get('error')}")
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        if time.monotonic() > deadline:
            raise StageError(f"stage: waited {wait_timeout:.0f} s for {os.path.join(folder, MARKER)} "
                             "(local rank 0 copies); HINT: check local rank 0's log, or raise the wait timeout")
        time.sleep(poll_s)


def cleanup_staged(path: str) -> None:
    """Remove a staged copy (the whole stage folder) under the copier lock."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.basename(folder).startswith("ddp_hpc-stage-"):
        raise StageError(f"cleanup_staged: {path!r} is not inside a ddp_hpc stage folder; refusing to delete")
    with open(folder + ".lock", "a+") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        shutil.rmtree(folder, ignore_errors=True)
        os.remove(folder + ".lock")
