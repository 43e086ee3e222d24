"""The stage folder's lock, its list of users and its removal: what lets several node leaders
share one stage folder (pretend nodes on one machine, or a ``/tmp`` that is not node-local).

A stage folder ``DEST/KEY`` has a lock file ``DEST/KEY.lock`` beside it (beside, because the folder
itself is deleted on cleanup).  Every change to the folder happens under that lock.

* :func:`folder_lock` is safe against the lock file being deleted (`ddp_hpc.fsutil.locked`):
  whoever removes the folder deletes the lock file while holding it, so a process that was waiting
  on the old file finds, once it gets the lock, that the path names another file (or none) and
  locks again.
* ``USERS.json`` in the folder names the node leaders using the copy in this attempt of the job
  (``{user: attempt}``).  A node leader registers after it has verified (or made) the copy and
  unregisters at cleanup; the copy is removed by the last one out.  Entries of an older attempt
  are dropped when a new attempt registers: those processes are gone (the job was requeued).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil

from ddp_hpc.data.errors import StageError
from ddp_hpc.fsutil import atomic_write_json, locked

__all__ = ["USERS", "folder_lock", "read_users", "register_user", "unregister_and_remove"]

USERS = "USERS.json"
MARKER = "COMPLETE.json"


def folder_lock(folder: str) -> contextlib.AbstractContextManager:
    """Hold ``folder + '.lock'`` exclusively (``flock``: the kernel releases it if we die)."""
    return locked(folder + ".lock")


def read_users(folder: str) -> dict[str, str]:
    """``{user: attempt}`` of the node leaders registered in ``folder`` (empty when none)."""
    try:
        with open(os.path.join(folder, USERS)) as f:
            users = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return {str(u): str(a) for u, a in users.items()} if isinstance(users, dict) else {}


def register_user(folder: str, user: str, attempt: str) -> dict[str, str]:
    """Add ``user`` for ``attempt`` (the caller holds the lock); older attempts' entries go."""
    users = {u: a for u, a in read_users(folder).items() if a == attempt}
    users[user] = attempt
    atomic_write_json(os.path.join(folder, USERS), users, indent=None)
    return users


def unregister_and_remove(folder: str, user: str | None) -> tuple[str, list[str]]:
    """Unregister ``user`` and remove the folder if nobody of its attempt still uses it.

    Returns ``(outcome, users left)``: ``removed``, ``kept`` (others still registered) or
    ``gone`` (already removed, by another node leader sharing the folder).  ``user=None``
    removes the folder whoever uses it.  A removal that fails raises :class:`StageError`."""
    with folder_lock(folder):
        if not os.path.isdir(folder):
            os.remove(folder + ".lock")  # we hold it; nothing is left for it to guard
            return "gone", []
        users = read_users(folder)
        if user is not None:
            mine = users.pop(user, None)
            left = sorted(u for u, a in users.items() if mine is None or a == mine)
            if left:
                atomic_write_json(os.path.join(folder, USERS), users, indent=None)
                return "kept", left
        _remove(folder)
        os.remove(folder + ".lock")  # still held: a waiter on it will notice and lock afresh
        return "removed", []


def _remove(folder: str) -> None:
    """Delete the marker first (nobody adopts a half-deleted copy), then the rest."""
    try:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, MARKER))
        shutil.rmtree(folder)
    except OSError as e:
        left = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(folder) for n in ns
                   if os.path.isfile(os.path.join(d, n)))
        raise StageError(f"stage cleanup could not remove {folder} ({left} bytes left): {e}",
                         f"remove it by hand (rm -rf {folder} {folder}.lock) or leave it to the node's "
                         "tmp cleaner; the run itself completed") from e
