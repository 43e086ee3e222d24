"""One cluster per machine: an exclusive ``flock`` on /tmp/ddp_hpc_testcluster.lock.

A pytest session holds it for its whole run (tests/conftest.py); the command line takes it only
while it changes the cluster, so a hand-run ``up``/``down`` cannot pull the cluster away from a
running test session.  The holder writes its pid and command into the file so the one that
waits can say who it waits for.
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from pathlib import Path
from typing import IO

LOCK_FILE = Path("/tmp/ddp_hpc_testcluster.lock")


def holder(path: Path = LOCK_FILE) -> str:
    try:
        return path.read_text().strip() or "an unknown process"
    except OSError:
        return "an unknown process"


def acquire(timeout: float, path: Path = LOCK_FILE, on_wait=None) -> IO | None:
    """The open, locked file (keep it open to hold the lock), or None after ``timeout`` seconds.
    ``on_wait(holder)`` is called once when the lock is busy."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    f = os.fdopen(fd, "r+")
    deadline, told = time.monotonic() + timeout, False
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                f.close()
                return None
            if on_wait and not told:
                on_wait(holder(path))
                told = True
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} ({' '.join(sys.argv)[:200]})\n")
    f.flush()
    return f


def release(f: IO | None) -> None:
    if f is not None:
        f.close()
