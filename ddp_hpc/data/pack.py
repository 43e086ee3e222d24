"""Pack many small files into one LMDB (``python -m ddp_hpc.data pack SRC OUT``).

Why: a parallel filesystem pays a metadata round trip per open; one LMDB file turns N opens
per rank into one.  The layout written here is described in :mod:`ddp_hpc.data.lmdb`, which
reads and verifies it.

Appended in key order, in large write transactions (committed every ``txn_bytes``); the map starts at ``map_size`` and
doubles whenever LMDB reports it full (the pending transaction is replayed).  Every image is
decoded first (unless ``check_images=False``), so a corrupt file is refused by name instead of
failing mid-training.  Atomic: written to a temporary sibling, renamed when complete.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from array import array

import lmdb
from tqdm import tqdm

from ddp_hpc.data import fsio
from ddp_hpc.data.errors import PackError
from ddp_hpc.data.images import IMAGE_SUFFIXES, decode_image
from ddp_hpc.data.lmdb import CRC_KEY, FORMAT_VERSION, LABELS_KEY, META_KEY, NAMES_KEY, record_key
from ddp_hpc.fsutil import umask

__all__ = ["pack", "PackError"]


def _list_source(src: str) -> tuple[str, list[str], list[tuple[str, int]]]:
    """(kind, classes, [(relative path, label)]) for a class-per-folder tree or a flat folder."""
    entries = sorted(os.scandir(src), key=lambda e: e.name)
    subdirs = [e.name for e in entries if e.is_dir() and not e.name.startswith(".")]
    files = [e.name for e in entries if e.is_file() and not e.name.startswith(".")]
    if subdirs:
        samples = []
        for label, cls in enumerate(subdirs):
            for dirpath, dirnames, names in os.walk(os.path.join(src, cls)):
                dirnames.sort()
                for n in sorted(names):
                    if not n.startswith("."):
                        samples.append((os.path.relpath(os.path.join(dirpath, n), src), label))
        classes = subdirs
    else:
        samples, classes = [(n, -1) for n in files], []
    if not samples:
        raise PackError(f"pack: source {src!r} holds no files",
                        "point SRC at a folder of files or a class-per-folder tree (ROOT/<class>/<file>)")
    images = all(rel.lower().endswith(IMAGE_SUFFIXES) for rel, _ in samples)
    return ("images" if images else "files"), classes, samples


def _read(path: str, check_image: bool) -> bytes:
    """A source file's bytes (counted), decoded once first when it must be a readable image."""
    try:
        payload = fsio.read_bytes(path)
    except OSError as e:
        raise PackError(f"pack: cannot read {path!r}: {e}", "fix permissions or remove the file") from e
    if check_image:
        try:
            decode_image(payload)
        except Exception as e:  # pillow raises several types for broken files
            raise PackError(f"pack: {path!r} is not a readable image ({type(e).__name__}: {e})",
                            "remove or replace the file, or pack with --no-check") from e
    return payload


class _Writer:
    """Puts in ascending key order into a new environment, appended (``MDB_APPEND``): LMDB then
    fills each leaf page before starting the next instead of splitting full pages in half, which
    leaves them about 70% full (a pack of 800-byte records is then 1.5x its payload; appended it
    is about 1.2x).  One write transaction per ``txn_bytes`` of values, so a pack that fits is one
    transaction and leaves no freed pages behind; a full map doubles and the pending
    transaction is replayed."""

    def __init__(self, path: str, map_size: int, txn_bytes: int):
        self.env = lmdb.open(path, map_size=int(map_size), subdir=True, lock=True, sync=False,
                             metasync=False, writemap=False, meminit=False, map_async=False)
        self.txn_bytes, self.growths = txn_bytes, 0
        self.pending: list[tuple[bytes, bytes]] = []
        self.pending_bytes = 0

    def put(self, key: bytes, value: bytes) -> None:
        self.pending.append((key, value))
        self.pending_bytes += len(value)
        if self.pending_bytes >= self.txn_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    _, added = txn.cursor().putmulti(self.pending, overwrite=False, append=True)
                    if added != len(self.pending):  # append skips, silently, a key not above the last
                        raise PackError(f"pack: {len(self.pending) - added} keys were not written in "
                                        "ascending order", "this is a bug in ddp_hpc.data.pack: report it")
                break
            except lmdb.MapFullError:
                self.growths += 1
                self.env.set_mapsize(self.env.info()["map_size"] * 2)
        self.pending, self.pending_bytes = [], 0

    def close(self) -> None:
        self.flush()
        self.env.sync(True)
        self.env.close()


def _publish(tmp: str, out: str, overwrite: bool) -> None:
    """Rename the finished environment ``tmp`` to ``out`` (replacing ``out`` with ``overwrite``)."""
    lock = os.path.join(tmp, "lock.mdb")
    if os.path.exists(lock):
        os.remove(lock)  # readers open with lock=False; a stale lock file only confuses copies
    os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes 0700; the result is a normal folder
    if overwrite and os.path.exists(out):
        shutil.rmtree(out)
    os.rename(tmp, out)


def pack(src: str | os.PathLike, out: str | os.PathLike, *, map_size: int = 64 << 20,
         txn_bytes: int = 64 << 20, check_images: bool = True, progress: bool | None = None,
         overwrite: bool = False) -> dict:
    """Pack the files under ``src`` into a new LMDB environment at ``out``; returns the metadata."""
    src, out = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(out))
    if not os.path.isdir(src):
        raise PackError(f"pack: source {src!r} is not a directory", "pass the dataset folder as SRC")
    if os.path.exists(out) and not overwrite:
        raise PackError(f"pack: output {out!r} already exists", "choose a new OUT path or pass --overwrite")
    kind, classes, samples = _list_source(src)
    parent = os.path.dirname(out) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-pack-", dir=parent)
    try:
        writer = _Writer(tmp, map_size, txn_bytes)
        labels, crcs, total_bytes = array("q"), array("I"), 0
        show = progress if progress is not None else os.isatty(2)
        for i, (rel, label) in enumerate(tqdm(samples, desc="pack", unit="file", disable=not show)):
            payload = _read(os.path.join(src, rel), check_images and kind == "images")
            writer.put(record_key(i), payload)
            labels.append(label)
            crcs.append(zlib.crc32(payload))
            total_bytes += len(payload)
        meta = {"format": FORMAT_VERSION, "count": len(samples), "classes": classes, "kind": kind,
                "source": src, "bytes": total_bytes}
        index = {LABELS_KEY: labels.tobytes(), CRC_KEY: crcs.tobytes(), META_KEY: json.dumps(meta).encode(),
                 NAMES_KEY: "\0".join(rel for rel, _ in samples).encode("utf-8")}
        for key in sorted(index):  # "__" sorts after the digits of the record keys: still ascending
            writer.put(key, index[key])
        writer.close()
        _publish(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dict(meta, map_growths=writer.growths, path=out)
