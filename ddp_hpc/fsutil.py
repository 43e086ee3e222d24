"""Atomic file writes: what ddp_hpc leaves on disk is either the old file or the new one, whole.

A checkpoint, a job record or a staging marker half-written by a process killed mid-write (a
preemption, an OOM kill, a node crash) must never be read back as valid. So every write goes to a
temporary file in the same directory (rename is atomic only within one filesystem), is flushed and
fsynced, then renamed over the final name; the directory is fsynced so the rename itself survives
a crash. Temporary names start with ``tmp_prefix`` so callers can recognise and clean leftovers.
The result gets the permissions any new file of the process gets (``0o666`` less the umask, as
``open()`` gives): a private umask keeps records and checkpoints private.

``locked(lock_path)`` holds an exclusive lock (``flock``) on a lock file for a read-change-write
by several processes; a holder may delete the lock file (``remove=True``: when it lets go), and a
process that waited on a deleted one locks the file now at the path.

``file_size`` is the size of a file that may not exist (yet): where a reader of an appended log
starts, so that it reads only what this run adds.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any


def file_size(path: str | os.PathLike | None) -> int:
    """The size of ``path`` in bytes; 0 when there is no path, no such file, or it cannot be read."""
    try:
        return os.stat(path).st_size if path else 0
    except OSError:
        return 0


def umask() -> int:
    """The process's umask, read without changing it where Linux tells it (``/proc/self/status``);
    elsewhere set and put back at once (another thread creating a file in between would get 0)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def new_file_mode() -> int:
    """The permission bits ``open()`` gives a new file now: 0o666 less the umask."""
    return 0o666 & ~umask()


@contextlib.contextmanager
def locked(lock_path: str | os.PathLike, *, remove: bool = False) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created if missing) for the ``with`` block
    (the kernel lets go if the process dies).

    Only a holder deletes the lock file: with ``remove``, before it lets go (no lock file is left
    behind), or itself inside the block. A process that was waiting on a deleted file sees, once
    it has the lock, that its file is no longer the one at ``lock_path``, and locks the new one:
    without that check two processes could each hold "the" lock. Not reentrant: a process must not
    take a lock it holds.
    """
    while True:
        fd = os.open(lock_path, os.O_RDONLY | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            mine = os.fstat(fd)
            try:
                now = os.stat(lock_path)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_ino, now.st_dev) == (mine.st_ino, mine.st_dev):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)      # removed (and maybe made anew) while this process waited: again
    try:
        yield
    finally:
        if remove:
            with contextlib.suppress(OSError):
                os.unlink(lock_path)
        os.close(fd)


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
    ``mode`` sets the permission bits of the result; by default those of any new file
    (`new_file_mode`: the umask decides; mkstemp alone would leave 0600).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=tmp_prefix or f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, new_file_mode() if mode is None else mode)
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


def atomic_write_texts(items: list[tuple[str | os.PathLike, str]], *, mode: int | None = None,
                       workers: int = 16, chunk: int = 256) -> None:
    """`atomic_write_text` for many files at once, each still all old or all new: every text is
    written to a temporary file beside its file, the temporary files are fsynced concurrently (a
    journaling file system commits concurrent fsyncs together: thousands of files cost a few
    commits, not one each), by the descriptors that wrote them (``chunk`` open at a time: no
    second open, no chmod by path), then all renamed over their files, and each directory is
    fsynced once. On an error the temporary files are removed (none was renamed yet if the error
    came before the renames) and it is raised. ``mode``: as `atomic_write`'s."""
    mode = new_file_mode() if mode is None else mode
    tmps: list[tuple[str, str]] = []
    fds: list[int] = []
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for path, text in items:
                head, name = os.path.split(os.fspath(path))
                fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=head or ".")
                fds.append(fd)
                tmps.append((tmp, os.fspath(path)))
                data = memoryview(text.encode())
                while data:
                    data = data[os.write(fd, data):]
                os.fchmod(fd, mode)
                if len(fds) >= chunk:
                    _sync_close(pool, fds)
            _sync_close(pool, fds)
        for tmp, path in tmps:
            os.replace(tmp, path)
    except BaseException:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        for tmp, _ in tmps:
            with contextlib.suppress(OSError):  # renamed already, or never made
                os.unlink(tmp)
        raise
    for directory in {os.path.dirname(path) or "." for _, path in tmps}:
        fsync_dir(directory)


def _sync_close(pool: ThreadPoolExecutor, fds: list[int]) -> None:
    """fsync the open temporary files concurrently, then close them (``fds`` is emptied)."""
    try:
        list(pool.map(_fsync_file, fds))
    finally:
        while fds:
            os.close(fds.pop())


def _fsync_file(fd: int) -> None:
    os.fsync(fd)
