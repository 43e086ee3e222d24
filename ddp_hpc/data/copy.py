"""The copy kernels of staging: a file in the kernel with its hash following, a folder as one tar.

What is copied (:func:`source_kind`): a file (in-kernel, hashed: :func:`copy_file`); an LMDB
folder (its ``data.mdb`` only: readers open with ``lock=False``); any other folder as one ``tar``
stream read and unpacked by GNU ``tar`` (one open per file on the shared side), the files and
bytes that came out counted against the source (:func:`copy_dir_tar`). Each copy returns
``{"bytes", "xxh3_64", "files"}`` and raises :class:`StageError` when the copy does not match its
source. A copy is written private (0600, folders 0700) and given its source's permissions once
complete (:func:`kept_mode`: never wider than the source, nor than the umask allows).

The protocol around a copy (markers, locks, reuse) is :mod:`ddp_hpc.data.stage`'s.
"""
from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time

import xxhash
from tqdm import tqdm

from ddp_hpc.data import fsio
from ddp_hpc.data.errors import StageError
from ddp_hpc.data.hashing import file_hash
from ddp_hpc.data.stagearchive import copy_folder
from ddp_hpc.fsutil import umask

__all__ = ["source_kind", "source_size", "copy_file", "copy_dir_tar", "kept_mode", "CopyProgress", "CHUNK",
           "KERNEL_CHUNK"]

log = logging.getLogger("ddp_hpc.data.stage")
CHUNK = 8 << 20
KERNEL_CHUNK = 16 << 20  # in-kernel copy calls; the copy's hash trails the copy by one chunk
HASH_BUF = 4 << 20
_UNSTABLE = "stage again once the source is stable"
_FAULTY_DISK = "the node-local disk may be faulty, try data.stage_to=shm"


def kept_mode(src: str | int) -> int:
    """The permission bits of a copy of ``src`` (a path, or its ``st_mode``): the source's, less
    what the umask takes away (no set-id bits)."""
    mode = os.stat(src).st_mode if isinstance(src, str) else src
    return mode & 0o777 & ~umask()


def _private(path: str, flags: int) -> int:
    """``open``'s opener for a new copy: readable by this user alone until it is complete."""
    return os.open(path, flags, 0o600)


def source_kind(src: str) -> str:
    """``file``, ``lmdb`` (a folder holding ``data.mdb``) or ``dir``: how ``src`` is copied."""
    if os.path.isfile(src):
        return "file"
    if os.path.isdir(src):
        return "lmdb" if os.path.isfile(os.path.join(src, "data.mdb")) else "dir"
    raise StageError(f"stage: source {src!r} does not exist", "check data.lmdb_path / data.kwargs.root")


def source_size(src: str, kind: str) -> tuple[int, int]:
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


def _copy_stream(src, dst_path: str, total: int, progress) -> tuple[int, int]:
    """Copy a stream (a tar member) to a new file; -> (bytes, xxh3-64)."""
    h, n = xxhash.xxh3_64(), 0
    with open(dst_path, "wb", buffering=0, opener=_private) as out:
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
    with open(src, "rb") as fs, open(dst, "wb+", opener=_private) as fd:
        size = os.fstat(fs.fileno()).st_size
        if size != total:
            raise StageError(f"stage: {src!r} is {size} bytes, expected {total} (file changed?)", _UNSTABLE)
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


def copy_file(src: str, dst: str, total: int, progress) -> dict:
    """Copy one file of ``total`` bytes, verified by the xxh3-64 of source and copy."""
    fsio.note_open(src)
    try:
        n, sh, dh = _copy_file_kernel(src, dst, total, progress)
    except _NoKernelCopy:  # e.g. a filesystem without sendfile support: stream through Python
        with open(src, "rb") as f:
            n, sh = _copy_stream(f, dst, total, progress)
        dh = file_hash(dst)[1]
    fsio.note_bytes(src, n)
    if n != total:
        raise StageError(f"stage: read {n} bytes from {src!r}, expected {total} (file changed while copying?)",
                         _UNSTABLE)
    dn = os.path.getsize(dst)
    if (dn, dh) != (n, sh):
        raise StageError(f"stage: copy {dst!r} has {dn} bytes hash {dh & (2**64 - 1):016x}, source {n} bytes "
                         f"hash {sh & (2**64 - 1):016x}", _FAULTY_DISK)
    os.chmod(dst, kept_mode(src))
    return {"bytes": n, "xxh3_64": sh, "files": 1}


def copy_dir_tar(src: str, dst: str, total: int, files: int, progress) -> dict:
    """One ``tar -c`` stream from the shared side, unpacked here by ``tar -x``, the files and
    bytes counted (:func:`ddp_hpc.data.stagearchive.copy_folder`)."""
    info = copy_folder(src, dst, progress, CHUNK)
    if (info["bytes"], info["files"]) != (total, files):
        raise StageError(f"stage: copied {info['files']} files / {info['bytes']} bytes from {src!r}, expected "
                         f"{files} / {total} (source changed while copying?)", "stage again once it is stable")
    return info


class CopyProgress:
    """tqdm on a tty, else a log line every 10 s."""

    def __init__(self, total: int, desc: str, show: bool | None):
        self.total, self.desc, self.done, self.last = total, desc, 0, time.monotonic()
        self.bar = None
        if show if show is not None else os.isatty(2):
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
