"""The LMDB format of packed datasets: verify a file, and read it safely from DataLoader workers.

Why: a parallel filesystem pays a metadata round trip per open; one LMDB file turns N opens
per rank into one, and memory-mapped random reads stay fast.

Layout of an environment written by :func:`ddp_hpc.data.pack.pack`:

* ``b"%010d" % i`` -> the i-th file's bytes, unchanged (a read is one ``get``, nothing to parse),
  appended in key order so leaf pages are full (a pack of 800-byte files is about 1.2x their
  bytes; LMDB's page is 4 KiB, so the rest of a page that holds no further record stays empty);
* ``b"__meta__"`` -> JSON: format version, count, classes, kind ("images" | "files"), source, bytes;
* ``b"__labels__"`` -> int64 array (class index per record; -1 for a flat folder),
  ``b"__crc32__"`` -> uint32 array (per-record checksum, checked by :func:`verify`),
  ``b"__names__"`` -> the records' relative paths, NUL-separated UTF-8.

Reading rules (:class:`LMDBDataset`): the environment is opened lazily in the process that reads
(never inherited across ``fork``: an LMDB handle must not cross a fork), read-only, ``lock=False``
(no lock file writes on a shared filesystem), ``readahead=False`` (random access), with one long
read transaction per process, opened again in a forked child or a spawned worker (persistent
workers included).
"""
from __future__ import annotations

import json
import os
import struct
import threading
import weakref
import zlib
from array import array

import lmdb
import torch
from tqdm import tqdm

from ddp_hpc.data import fsio
from ddp_hpc.data.errors import RecordIndexError, VerifyError
from ddp_hpc.data.images import decode_image

__all__ = ["verify", "LMDBDataset", "VerifyError", "read_meta", "record_key", "close_all", "FORMAT_VERSION"]

FORMAT_VERSION = 1
META_KEY = b"__meta__"
LABELS_KEY, CRC_KEY, NAMES_KEY = b"__labels__", b"__crc32__", b"__names__"
_FS = fsio.STATE  # is a shared root being counted? (read when a process opens its handle)
_LIVE: "weakref.WeakSet[LMDBDataset]" = weakref.WeakSet()  # datasets holding a handle in this process
_OPEN_LOCK = threading.Lock()  # reader threads may make a dataset's first read at the same time


def _forget_handles_in_child() -> None:
    """After ``fork`` every dataset opens lazily again: an LMDB handle must not cross a fork
    (this replaces a pid check per read)."""
    global _OPEN_LOCK
    _OPEN_LOCK = threading.Lock()  # another thread of the parent may have held it
    for ds in list(_LIVE):
        ds._forget()
    _LIVE.clear()


os.register_at_fork(after_in_child=_forget_handles_in_child)


def record_key(i: int) -> bytes:
    return b"%010d" % i


KEY_CACHE_MAX = 1 << 18  # records up to which a dataset keeps its keys formatted (~56 bytes each)


def _key_function(count: int):
    """``i -> record_key(i)`` for ``-count <= i < count`` (negative indices count from the end, as
    in a list); an index outside gives a key that is not stored or raises IndexError.  Up to
    :data:`KEY_CACHE_MAX` records it is a lookup in a list of the formatted keys, a C call:
    formatting costs about a tenth of a read, as much as the Python call around it."""
    if count <= KEY_CACHE_MAX:
        return [record_key(i) for i in range(count)].__getitem__

    def key(i: int) -> bytes:
        return b"%010d" % (i + count if i < 0 else i)
    return key


_ENVS: dict = {}
_MAGIC = 0xBEEFC0DE
_REPACK = "pack it again (python -m ddp_hpc.data pack SRC OUT.lmdb)"


def _check_length(data: str, size: int) -> None:
    """Refuse a truncated data.mdb *before* mapping it: reading a page past the end of a mapped
    file kills the process with SIGBUS instead of raising.  The newer of LMDB's two meta pages
    records the last used page; the file must reach it."""
    with open(data, "rb") as f:
        head = f.read(2 * 65536)
    metas = []
    for off in {0, *(struct.unpack_from("<I", head, 40) if len(head) >= 44 else ())}:
        if len(head) >= off + 152 and struct.unpack_from("<I", head, off + 16)[0] == _MAGIC:
            psize = struct.unpack_from("<I", head, off + 40)[0]
            last_pg, txnid = struct.unpack_from("<QQ", head, off + 136)
            metas.append((txnid, last_pg, psize))
    if not metas:
        raise VerifyError(f"{data!r} is not an LMDB data file (no meta page)", _REPACK)
    _, last_pg, psize = max(metas)
    if size < (last_pg + 1) * psize:
        raise VerifyError(f"{data!r} is truncated: {size} bytes, its meta page needs {(last_pg + 1) * psize}",
                          "an interrupted copy? copy or pack it again")


def _open_readonly(path: str) -> lmdb.Environment:
    """This process's read-only handle on ``path`` (py-lmdb allows one per process, so datasets,
    ``read_meta`` and ``verify`` share it; a forked child or a replaced file gets a new one)."""
    data = os.path.join(path, "data.mdb")
    try:
        st = os.stat(data)
    except FileNotFoundError:
        raise VerifyError(f"{path!r} is not an LMDB made by ddp_hpc (no data.mdb)",
                          "create it with python -m ddp_hpc.data pack SRC OUT.lmdb") from None
    key = (os.path.realpath(path), os.getpid(), st.st_ino, st.st_mtime_ns, st.st_size)
    env = _ENVS.get(key)
    if env is not None:
        return env
    for old in [k for k in _ENVS if k[0] == key[0] and (k[1] != key[1] or k != key)]:
        # Inherited through fork (py-lmdb then refuses a second open of the same file) or the file
        # was replaced: close it here.  With lock=False this touches no lock the parent holds;
        # munmap and close only affect this process.
        _ENVS.pop(old).close()
    fsio.note_open(data)
    _check_length(data, st.st_size)
    try:
        env = lmdb.open(path, readonly=True, lock=False, readahead=False, meminit=False,
                        subdir=True, max_readers=2048)
    except lmdb.Error as e:
        raise VerifyError(f"cannot open LMDB {path!r}: {e}", "the file is damaged or truncated: " + _REPACK) from e
    _ENVS[key] = env
    return env


def read_meta(path: str | os.PathLike) -> dict:
    path = os.path.abspath(os.fspath(path))
    env = _open_readonly(path)
    try:
        with env.begin() as txn:
            raw = txn.get(META_KEY)
    except lmdb.Error as e:
        raise VerifyError(f"cannot read LMDB {path!r}: {e}", _REPACK) from e
    if raw is None:
        raise VerifyError(f"LMDB {path!r} has no {META_KEY.decode()} record (incomplete or not made "
                          "by ddp_hpc)", _REPACK)
    meta = json.loads(raw)
    if meta.get("format") != FORMAT_VERSION:
        raise VerifyError(f"LMDB {path!r} has format {meta.get('format')}, this ddp_hpc reads "
                          f"{FORMAT_VERSION}", "pack it again with this version")
    return meta


def _index_arrays(txn, path: str, count: int) -> tuple[array, array, list[str]]:
    """(labels, crc32s, names) stored beside the records, each checked for length ``count``."""
    raw = {k: txn.get(k) for k in (LABELS_KEY, CRC_KEY, NAMES_KEY)}
    if any(v is None for v in raw.values()):
        raise VerifyError(f"LMDB {path!r} lacks its label/checksum/name index", _REPACK)
    labels, crcs = array("q"), array("I")
    try:
        labels.frombytes(bytes(raw[LABELS_KEY]))
        crcs.frombytes(bytes(raw[CRC_KEY]))
        names = bytes(raw[NAMES_KEY]).decode("utf-8").split("\0")
    except (ValueError, UnicodeDecodeError) as e:
        raise VerifyError(f"LMDB {path!r}: damaged index ({e})", _REPACK) from e
    if not len(labels) == len(crcs) == len(names) == count:
        raise VerifyError(f"LMDB {path!r}: index lengths {len(labels)}/{len(crcs)}/{len(names)} != "
                          f"count {count}", _REPACK)
    return labels, crcs, names


def verify(path: str | os.PathLike, *, progress: bool | None = None) -> dict:
    """Check every record's presence and crc32; raise :class:`VerifyError` naming the first bad one."""
    path = os.path.abspath(os.fspath(path))
    meta = read_meta(path)
    env = _open_readonly(path)
    show = progress if progress is not None else os.isatty(2)
    total = 0
    try:
        with env.begin(buffers=True) as txn:
            labels, crcs, names = _index_arrays(txn, path, meta["count"])
            for i in tqdm(range(meta["count"]), desc="verify", unit="rec", disable=not show):
                value = txn.get(record_key(i))
                if value is None:
                    raise VerifyError(f"LMDB {path!r}: record {i} of {meta['count']} is missing", _REPACK)
                if zlib.crc32(value) != crcs[i]:
                    raise VerifyError(f"LMDB {path!r}: record {i} ({names[i]}) fails its checksum",
                                      "the file is corrupt: " + _REPACK)
                total += len(value)
    except lmdb.Error as e:
        raise VerifyError(f"LMDB {path!r} is damaged: {e}", _REPACK) from e
    if total != meta.get("bytes", total):
        raise VerifyError(f"LMDB {path!r}: payload bytes {total} != recorded {meta['bytes']}", _REPACK)
    return dict(meta, path=path, verified_bytes=total)


def close_all() -> None:
    """Close this process's LMDB handles (datasets reopen on next use): a fresh start, e.g. after
    the file was replaced, or per benchmark scenario so opens are counted as a new job's."""
    for ds in list(_LIVE):
        ds.close()
    for env in _ENVS.values():
        env.close()
    _ENVS.clear()


def _counted(get, data_path: str):
    def counted_get(key: bytes):  # ``get`` that adds the bytes read to fsio's shared-root counts
        value = get(key)
        if value is not None:
            fsio.note_bytes(data_path, len(value))
        return value
    return counted_get


class _FirstRead:
    """A dataset's ``_get`` until its process opens the handle (a weak reference: no cycle)."""

    __slots__ = ("dataset",)

    def __init__(self, dataset):
        self.dataset = weakref.ref(dataset)

    def __call__(self, key: bytes):
        ds = self.dataset()
        ds._open()
        return ds._get(key)


class LMDBDataset(torch.utils.data.Dataset):
    """Samples from an LMDB written by :func:`pack`; safe with fork/spawn and persistent workers.

    ``decode`` maps the stored bytes to the input tensor; the default is the image decode shared
    with :class:`ddp_hpc.data.images.ImageFolderDataset` for image packs and a uint8 tensor of
    the raw bytes otherwise.

    A read is one ``txn.get`` of this process's long read transaction.  Until the process opens
    it, ``self._get`` is a :class:`_FirstRead`, which opens it and stores ``txn.get`` in its place,
    so later reads call py-lmdb directly: no pid or counter check per read (and a plain instance
    attribute, not one that hides a method: that lookup alone cost 10% of a read).  A fork (see
    ``_forget_handles_in_child``), pickling for a spawned worker, :meth:`close` and
    :func:`close_all` put the :class:`_FirstRead` back.  Bytes are counted for :mod:`fsio` when
    the shared root was watched as the process opened its handle.
    """

    def __init__(self, path: str | os.PathLike, decode=None):
        self.path = os.path.abspath(os.fspath(path))
        self.root = self.path  # what staging copies
        meta = read_meta(self.path)
        with _open_readonly(self.path).begin() as txn:
            labels, _, _ = _index_arrays(txn, self.path, int(meta["count"]))
        self._labels = labels.tolist()  # a list: the fastest per-sample lookup
        self.classes = meta["classes"]
        self._len = int(meta["count"])
        self.kind = meta["kind"]
        self._decode = decode
        self._data_path = os.path.join(self.path, "data.mdb")
        self._env = self._txn = self._pid = None
        self._key = _key_function(self._len)
        self._get = _FirstRead(self)

    def __len__(self) -> int:
        return self._len

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_get", None)  # handles never cross a process boundary
        state.pop("_key", None)  # rebuilt by the receiver: cheaper than pickling the key list
        state.update(_env=None, _txn=None, _pid=None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._key = _key_function(self._len)
        self._get = _FirstRead(self)

    def _open(self) -> None:
        """Open this process's handle and store its ``get`` on the instance."""
        with _OPEN_LOCK:
            if not isinstance(self._get, _FirstRead):  # another thread was first
                return
            self._env = _open_readonly(self.path)
            self._txn = self._env.begin(buffers=False)  # one long read txn per process; values are bytes
            self._pid = os.getpid()
            watched = _FS.root is not None and self._data_path.startswith(_FS.root)
            self._get = _counted(self._txn.get, self._data_path) if watched else self._txn.get
            _LIVE.add(self)

    def _forget(self) -> None:
        """Drop this process's handle without touching it (after fork it is the parent's)."""
        self._get = _FirstRead(self)
        self._env = self._txn = self._pid = None

    def _missing(self, index) -> RecordIndexError:
        return RecordIndexError(f"LMDBDataset {self.path!r}: no record {index} (0..{self._len - 1})",
                                "if the index is in range run python -m ddp_hpc.data verify")

    def raw_item(self, index: int) -> tuple[bytes, int]:
        """(stored file bytes, label) of record ``index``: the hot path, kept to one ``get``."""
        get = self._get  # a local first: a specialised attribute load, not a method lookup
        try:
            value = get(self._key(index))
        except (IndexError, TypeError):  # out of the cached keys' range, or not an int
            raise self._missing(index) from None
        if value is None:
            raise self._missing(index)
        return value, self._labels[index]

    def raw_batch(self, indices) -> tuple[list[bytes], list[int]]:
        """(stored bytes, labels) of ``indices``, read in C-level loops: the bulk :meth:`raw_item`
        (DataLoader batches through ``__getitems__``, the broadcast reader per step)."""
        if isinstance(self._get, _FirstRead):
            self._open()
        try:
            values = list(map(self._get, map(self._key, indices)))
        except (IndexError, TypeError):
            values = [None]
        if None in values:
            for i in indices:  # raises, naming the first index that is not stored
                self.raw_item(i)
        return values, list(map(self._labels.__getitem__, indices))

    def decode_item(self, data: bytes, label: int):
        if self._decode is not None:
            return self._decode(data), label
        if self.kind == "images":
            return decode_image(data), label
        return torch.frombuffer(bytearray(data), dtype=torch.uint8), label

    def __getitem__(self, index: int):
        return self.decode_item(*self.raw_item(index))

    def __getitems__(self, indices) -> list:
        """A DataLoader batch (torch calls this instead of ``__getitem__`` per index): one bulk read."""
        return [self.decode_item(value, label) for value, label in zip(*self.raw_batch(indices))]

    def relocated(self, new_path: str) -> "LMDBDataset":
        return LMDBDataset(new_path, decode=self._decode)

    def close(self) -> None:
        """End this process's read transaction (the shared handle stays for other datasets)."""
        if self._txn is not None:
            self._txn.abort()
        _LIVE.discard(self)
        self._forget()
