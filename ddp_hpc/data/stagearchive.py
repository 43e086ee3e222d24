"""A folder as one archive: read once from the shared filesystem, unpacked on every node.

``sbcast`` moves single files, so a folder goes as one ``tar`` archive (:mod:`ddp_hpc.data.sbcast`):
:func:`make_archive` has GNU ``tar`` read each regular file of the folder once (one open per file,
whatever the number of nodes) into an archive on this node's local disk, and returns its size,
xxh3-64, file count and payload bytes (the manifest).  Slurm's ``sbcast`` then puts that archive
on every node, where :func:`unpack_archive` checks the archive's hash against the manifest, has
``tar`` unpack it into a private folder and counts what came out (files and bytes) against the
manifest.  Nothing on the nodes touches the shared folder.

Only regular files and folders go into the archive (symbolic links and special files are left
out, as a per-node copy leaves them out); the folder's own permissions travel as its ``.``
member.  ``tar`` unpacks without the archive's owners and with the umask applied, like a copy.
"""
from __future__ import annotations

import os
import subprocess
import tempfile

import xxhash

from ddp_hpc.data import fsio
from ddp_hpc.data.errors import StageError
from ddp_hpc.data.hashing import file_hash

__all__ = ["make_archive", "unpack_archive", "folder_census", "copy_folder"]


def _members(src: str) -> tuple[list[str], list[str], int]:
    """``.``, every folder and every regular file below ``src`` (relative, sorted by walk); the
    files alone; their bytes: stats only, no file is opened."""
    names, files, total = ["."], [], 0
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames.sort()
        rel = os.path.relpath(dirpath, src)
        for d in dirnames:
            if not os.path.islink(os.path.join(dirpath, d)):
                names.append(os.path.normpath(os.path.join(rel, d)))
        for n in sorted(filenames):
            p = os.path.join(dirpath, n)
            if os.path.isfile(p) and not os.path.islink(p):
                names.append(os.path.normpath(os.path.join(rel, n)))
                files.append(names[-1])
                total += os.path.getsize(p)
    return names, files, total


def _tar(argv: list[str], stdin: bytes | None, what: str) -> None:
    done = subprocess.run(["tar", *argv], input=stdin, capture_output=True)
    if done.returncode != 0:
        raise StageError(f"stage: tar could not {what} (exit {done.returncode}): "
                         f"{done.stderr.decode(errors='replace').strip()[:500]}",
                         "check read permissions on the source and free space on the node-local disk")


def make_archive(src: str, archive: str) -> dict:
    """Write the folder ``src`` as one tar archive at ``archive`` (a new file, private to this
    user); -> ``{"bytes", "xxh3_64"}`` of the archive and ``"files"``, ``"payload"`` of the folder.
    Each file below ``src`` is opened once (counted by :mod:`ddp_hpc.data.fsio`)."""
    names, files, payload = _members(src)
    fd = os.open(archive, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    _tar(["-C", src, "--no-recursion", "--null", "-T", "-", "-cf", archive],
         b"\0".join(n.encode() for n in names) + b"\0", f"archive {src!r} into {archive!r}")
    for n in files:   # tar opened each once, outside this process: counted here
        fsio.note_open(os.path.join(src, n))
    fsio.note_bytes(src + "/", payload)
    nbytes, digest = file_hash(archive)
    return {"bytes": nbytes, "xxh3_64": digest, "files": len(files), "payload": payload}


def folder_census(folder: str) -> tuple[int, int]:
    """(regular files, their bytes) below ``folder``."""
    files = total = 0
    for dirpath, _, filenames in os.walk(folder):
        for n in filenames:
            p = os.path.join(dirpath, n)
            if os.path.isfile(p) and not os.path.islink(p):
                files += 1
                total += os.path.getsize(p)
    return files, total


def unpack_archive(archive: str, dst: str, manifest: dict) -> None:
    """Unpack ``archive`` (its hash already checked against ``manifest``) into the new folder
    ``dst`` and check the files and bytes that came out against the manifest."""
    os.mkdir(dst, 0o700)
    _tar(["-C", dst, "--no-same-owner", "--no-same-permissions", "-xf", archive], None,
         f"unpack {archive!r} into {dst!r}")
    got = folder_census(dst)
    want = (manifest.get("files"), manifest.get("payload"))
    if got != want:
        raise StageError(f"stage: unpacked {got[0]} files / {got[1]} bytes from {archive!r}, the manifest "
                         f"says {want[0]} / {want[1]}", "the node-local disk may be full or faulty; the node "
                         "copies from the source instead")


def copy_folder(src: str, dst: str, progress, chunk: int = 8 << 20) -> dict:
    """One node's copy of the folder ``src`` into the empty folder ``dst``: ``tar`` reads each
    regular file once and a second ``tar`` unpacks the stream here; this process only passes the
    stream on, ``chunk`` bytes at a time (hashing it, ``progress(bytes)``).  The files and bytes
    that came out are counted against the source's.  -> ``{"bytes", "files", "xxh3_64"}`` (of the stream)."""
    names, files, payload = _members(src)
    with tempfile.NamedTemporaryFile("wb", dir=os.path.dirname(dst), prefix=".names-") as listing:
        listing.write(b"\0".join(n.encode() for n in names) + b"\0")
        listing.flush()
        reader = subprocess.Popen(["tar", "-C", src, "--no-recursion", "--null", "-T", listing.name, "-cf", "-"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        writer = subprocess.Popen(["tar", "-C", dst, "--no-same-owner", "--no-same-permissions", "-xf", "-"],
                                  stdin=subprocess.PIPE, stderr=subprocess.PIPE)
        h = xxhash.xxh3_64()
        try:
            while data := reader.stdout.read(chunk):
                h.update(data)
                writer.stdin.write(data)
                progress(len(data))
        except BrokenPipeError:
            pass   # the unpacking tar died: its exit status says why
        finally:
            writer.stdin.close()
            problems = [(what, p.wait(), p.stderr.read().decode(errors="replace").strip()[:500])
                        for what, p in (("read", reader), ("unpack", writer))]
            reader.stdout.close()
    for what, rc, err in problems:
        if rc != 0:
            raise StageError(f"stage: tar could not {what} {src!r} -> {dst!r} (exit {rc}): {err}",
                             "check read permissions on the source and free space on the node-local disk")
    for n in files:   # tar opened each once, outside this process: counted here
        fsio.note_open(os.path.join(src, n))
    fsio.note_bytes(src + "/", payload)
    got = folder_census(dst)
    if got != (len(files), payload):
        raise StageError(f"stage: copied {got[0]} files / {got[1]} bytes from {src!r}, expected {len(files)} / "
                         f"{payload} (source changed while copying?)", "stage again once it is stable")
    return {"bytes": payload, "files": len(files), "xxh3_64": h.intdigest()}
