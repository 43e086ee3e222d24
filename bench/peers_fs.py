"""Counting (and slowing) the shared-directory IO of data loaders that are not ours.

ddp_hpc's own readers count their opens and bytes with ``ddp_hpc.data.fsio``.  The peers
(WebDataset, LitData, MosaicML Streaming) open files their own way, so a rank process of
``bench/peers.py`` counts them from the outside, with no LD_PRELOAD and no strace:

* **opens**: a PEP 578 audit hook (``sys.addaudithook``) receives the ``open`` event of every
  open made from Python in the process -- ``builtins.open``, ``io.open``, ``os.open``, a module's
  saved reference to ``open`` (tarfile keeps one), ``shutil.copy`` -- whatever name the caller
  imported it under, in every thread.  An open below the watched root is counted.  Opens made
  in C (py-lmdb's own ``open(2)``) are not seen; fsio counts those for ddp_hpc's LMDB reader.
* **simulated metadata cost**: the hook sleeps ``delay_s`` before each counted open, the same
  "+N ms per open of a shared file" that ``fsio.watch(root, delay)`` adds to ddp_hpc's readers.
* **bytes**: ``builtins.open`` is wrapped: a file below the root opened for reading comes back
  in a thin proxy that counts what ``read``/``readinto``/``readline`` return, and ``os.sendfile``
  (``shutil.copy``'s fast path on Linux, which the peers use to fill their local caches) counts
  what it moves out of such a file's descriptor.

Counts are per process (each rank reports its own :func:`snapshot`); DataLoader worker
processes would need their own report, so the benchmark runs every loader with 0 workers.
"""
from __future__ import annotations

import builtins
import os
import sys
import threading
import time

__all__ = ["install", "watch", "unwatch", "snapshot"]

_lock = threading.Lock()
_state = {"root": None, "delay_s": 0.0, "opens": 0, "bytes": 0}
_shared_fds: set[int] = set()   # descriptors of shared files opened through builtins.open
_real_open = builtins.open
_real_sendfile = os.sendfile
_installed = False


def _below_root(path) -> bool:
    root = _state["root"]
    if root is None or not isinstance(path, (str, bytes, os.PathLike)):
        return False
    path = os.fsdecode(os.fspath(path))
    return os.path.abspath(path).startswith(root)


def _add_bytes(n) -> None:
    if n:
        with _lock:
            _state["bytes"] += int(n)


def _audit(event: str, args) -> None:
    """The audit hook: count (and delay) every open below the watched root."""
    if event != "open" or _state["root"] is None or not _below_root(args[0]):
        return
    with _lock:
        _state["opens"] += 1
    if _state["delay_s"]:
        time.sleep(_state["delay_s"])


class _CountedFile:
    """A file object below the root: every read is counted, everything else is passed on."""

    def __init__(self, f):
        object.__setattr__(self, "_f", f)
        _shared_fds.add(f.fileno())

    def __getattr__(self, name):
        return getattr(self._f, name)

    def read(self, *args):
        data = self._f.read(*args)
        _add_bytes(len(data) if data else 0)
        return data

    def read1(self, *args):
        data = self._f.read1(*args)
        _add_bytes(len(data) if data else 0)
        return data

    def readline(self, *args):
        data = self._f.readline(*args)
        _add_bytes(len(data))
        return data

    def readinto(self, buf):
        n = self._f.readinto(buf)
        _add_bytes(n)
        return n

    def readinto1(self, buf):
        n = self._f.readinto1(buf)
        _add_bytes(n)
        return n

    def __iter__(self):
        for line in self._f:
            _add_bytes(len(line))
            yield line

    def close(self):
        if not self._f.closed:
            _shared_fds.discard(self._f.fileno())
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _open(file, mode="r", *args, **kwargs):
    f = _real_open(file, mode, *args, **kwargs)
    if "r" in mode and "+" not in mode and _below_root(file):
        return _CountedFile(f)
    return f


def _sendfile(out_fd, in_fd, offset, count, *args, **kwargs):
    n = _real_sendfile(out_fd, in_fd, offset, count, *args, **kwargs)
    if in_fd in _shared_fds:
        _add_bytes(n)
    return n


def install() -> None:
    """Install the hook and the wrappers in this process (once; they are idle until watch)."""
    global _installed
    if not _installed:
        sys.addaudithook(_audit)
        builtins.open = _open
        os.sendfile = _sendfile
        _installed = True


def watch(root: str, delay_s: float = 0.0) -> None:
    """Count from zero the opens and bytes below ``root``; sleep ``delay_s`` per open."""
    with _lock:
        _state.update(root=os.path.abspath(root).rstrip("/") + "/", delay_s=float(delay_s), opens=0, bytes=0)


def unwatch() -> None:
    _state.update(root=None, delay_s=0.0)


def snapshot() -> dict:
    return {"opens": _state["opens"], "bytes": _state["bytes"]}
