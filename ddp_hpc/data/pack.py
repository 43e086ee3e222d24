"""Pack many small files into one LMDB (``python -m ddp_hpc.data pack SRC OUT``).

Why: a parallel filesystem pays a metadata round trip per open; one LMDB file turns N opens
per rank into one.  The layout written here is described in :mod:`ddp_hpc.data.lmdb`, which
reads and verifies it.

The files are read and checked by worker processes (``workers``, default the CPUs of the
allocation) and written here, in key order, so the LMDB does not depend on their number
(:mod:`ddp_hpc.data.packsources`, which also reads WebDataset shards and, with
:mod:`ddp_hpc.data.packhf`, Hugging Face ``save_to_disk`` folders).  Appended in key order,
in large write transactions (committed every ``txn_bytes``); the map starts at ``map_size`` and
doubles whenever LMDB reports it full (the pending transaction is replayed).  Every image is
checked first (unless ``check_images=False``: :mod:`ddp_hpc.data.imagecheck`, a PNG by its
chunks' CRCs and complete image data, other formats by decoding), so a corrupt file is refused
by name instead of failing mid-training.  Atomic: written to a temporary sibling, renamed when complete.
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

from ddp_hpc.data.errors import PackError
from ddp_hpc.data.lmdb import CRC_KEY, FORMAT_VERSION, LABELS_KEY, META_KEY, NAMES_KEY, record_key
from ddp_hpc.data.packsources import allocation_cpus, open_source, read_in_order
from ddp_hpc.fsutil import umask

__all__ = ["pack", "PackError"]


class _Writer:
    """Puts in ascending key order into a new environment, appended (``MDB_APPEND``): LMDB then
    fills each leaf page before starting the next instead of splitting full pages in half, which
    leaves them about 70% full (a pack of 800-byte records is then 1.5x its payload; appended it
    is about 1.2x).  One write transaction per ``txn_bytes`` of values, so a pack that fits is one
    transaction and leaves no freed pages behind; a full map doubles and the pending
    transaction is replayed.  ``meminit``: LMDB zeroes the unused part of each page, so the file
    holds only what was put (with it off, leftover heap bytes made two packs of the same source
    differ)."""

    def __init__(self, path: str, map_size: int, txn_bytes: int):
        self.env = lmdb.open(path, map_size=int(map_size), subdir=True, lock=True, sync=False,
                             metasync=False, writemap=False, meminit=True, map_async=False)
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
         overwrite: bool = False, workers: int | None = None) -> dict:
    """Pack the files under ``src`` (a folder, WebDataset ``.tar`` shards or a Hugging Face
    ``save_to_disk`` folder) into a new LMDB
    environment at ``out``, read and checked by ``workers`` processes (default: the CPUs of the
    allocation, :func:`ddp_hpc.data.packsources.allocation_cpus`); returns the metadata.  The
    LMDB is the same, byte for byte, whatever the number of workers."""
    src, out = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(out))
    if not os.path.exists(src):
        raise PackError(f"pack: source {src!r} does not exist",
                        "pass the dataset folder, .tar shards or a save_to_disk folder as SRC")
    if os.path.exists(out) and not overwrite:
        raise PackError(f"pack: output {out!r} already exists", "choose a new OUT path or pass --overwrite")
    workers = allocation_cpus() if workers is None else int(workers)
    if workers < 1:
        raise PackError(f"pack: --workers {workers} is below 1", "pass --workers 1 or more, or leave it out")
    kind, classes, samples = open_source(src)
    parent = os.path.dirname(out) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-pack-", dir=parent)
    try:
        writer = _Writer(tmp, map_size, txn_bytes)
        labels, crcs, total_bytes = array("q"), array("I"), 0
        show = progress if progress is not None else os.isatty(2)
        bar = tqdm(total=len(samples), desc="pack", unit="file", disable=not show)
        payloads = read_in_order(samples, check_images and kind == "images", min(workers, len(samples)))
        for i, ((_, label, _), payload) in enumerate(zip(samples, payloads)):
            writer.put(record_key(i), payload)
            labels.append(label)
            crcs.append(zlib.crc32(payload))
            total_bytes += len(payload)
            bar.update(1)
        bar.close()
        meta = {"format": FORMAT_VERSION, "count": len(samples), "classes": classes, "kind": kind,
                "source": src, "bytes": total_bytes}
        index = {LABELS_KEY: labels.tobytes(), CRC_KEY: crcs.tobytes(), META_KEY: json.dumps(meta).encode(),
                 NAMES_KEY: "\0".join(name for name, _, _ in samples).encode("utf-8")}
        for key in sorted(index):  # "__" sorts after the digits of the record keys: still ascending
            writer.put(key, index[key])
        writer.close()
        _publish(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dict(meta, map_growths=writer.growths, path=out, workers=workers)
