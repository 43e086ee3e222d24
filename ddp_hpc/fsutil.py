"""Atomic file writes: what ddp_hpc leaves on disk is either the old file or the new one, whole.

A checkpoint, a job record or a staging marker half-written by a process killed mid-write (a
preemption, an OOM kill, a node crash) must never be read back as valid. So every write goes to a
temporary file in the same directory (rename is atomic only within one filesystem), is flushed and
fsynced, then renamed over the final name; the directory is fsynced so the rename itself survives
a crash. Temporary names start with ``tmp_prefix`` so callers can recognise and clean leftovers.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any


def fsync_dir(directory: str | os.PathLike) -> None:
    """Persist a directory entry change (a rename); a no-op where the OS does not allow it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[IO], Any], *, binary: bool = False,
                 tmp_prefix: str | None = None, mode: int | None = None) -> Path:
    """Call ``write(f)`` on a temporary file beside ``path``, then rename it over ``path``.

    On any error (or a KeyboardInterrupt) the temporary file is removed and ``path`` is untouched.
    ``mode`` sets the permission bits of the result (mkstemp creates 0600).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=tmp_prefix or f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644 if mode is None else mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str, **kwargs: Any) -> Path:
    return atomic_write(path, lambda f: f.write(text), **kwargs)


def atomic_write_json(path: str | os.PathLike, data: Any, *, indent: int | None = 2, **kwargs: Any) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=indent, sort_keys=True) + "\n", **kwargs)


def atomic_write_texts(items: list[tuple[str | os.PathLike, str]], *, mode: int = 0o644,
                       workers: int = 16) -> None:
    """`atomic_write_text` for many files at once, each still all old or all new: every text is
    written to a temporary file beside its file, the temporary files are fsynced concurrently (a
    journaling file system commits concurrent fsyncs together: thousands of files cost a few
    commits, not one each), then renamed over their files, and each directory is fsynced once.
    On an error the temporary files not yet renamed are removed and it is raised."""
    tmps: list[tuple[str, Path]] = []
    try:
        for path, text in items:
            path = Path(path)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            tmps.append((tmp, path))
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.chmod(tmp, mode)
        if tmps:
            with ThreadPoolExecutor(max_workers=min(workers, len(tmps))) as pool:
                list(pool.map(_fsync_file, [tmp for tmp, _ in tmps]))
        for tmp, path in tmps:
            os.replace(tmp, path)
    except BaseException:
        for tmp, _ in tmps:
            with contextlib.suppress(OSError):  # renamed already, or never made
                os.unlink(tmp)
        raise
    for directory in {path.parent for _, path in tmps}:
        fsync_dir(directory)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
