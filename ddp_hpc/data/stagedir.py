"""Where node-local copies go, and which of them this user may trust.

``resolve_stage_dir`` maps ``data.stage_to`` (auto | slurm_tmpdir | tmpdir | shm | an absolute
path) to a folder. In a folder that other users can write to (``/tmp`` and ``/dev/shm`` without
SLURM_TMPDIR or a private TMPDIR, a group's scratch folder) the stage folders go one level down,
into ``ddp_hpc-<uid>``: this user's own subfolder, made 0700, and refused when it is anything else
(another owner, a symbolic link, a mode that lets others in), since another user could have made it
to plant data (``private_root``). A folder that only this user can write to is used as it is.
``owned`` tells whether a file or folder is this user's own (not a link): what the stage reuses or
adopts must be. ``shared`` tells a folder others may write to (where ``ddp_hpc.data.sbcast`` never
overwrites a file that is already there).
"""
from __future__ import annotations

import os
import stat
import tempfile

from ddp_hpc.data.errors import StageError
from ddp_hpc.env import job_facts

__all__ = ["resolve_stage_dir", "private_root", "shared", "owned"]


def resolve_stage_dir(stage_to: str = "auto", environ=None) -> str:
    """Map ``data.stage_to`` to a folder: auto | slurm_tmpdir | tmpdir | shm | an absolute path
    (``environ``: the job's variables, this process's by default)."""
    facts = job_facts(environ)
    if stage_to == "auto":
        return facts.node_tmpdir or facts.tmpdir or tempfile.gettempdir()
    if stage_to == "slurm_tmpdir":
        if not facts.node_tmpdir:
            raise StageError("data.stage_to=slurm_tmpdir but SLURM_TMPDIR is not set in this task",
                             "use data.stage_to=tmpdir or an absolute node-local path (your site's job-local scratch)")
        return facts.node_tmpdir
    if stage_to == "tmpdir":
        return facts.tmpdir or tempfile.gettempdir()
    if stage_to == "shm":
        if not os.path.isdir("/dev/shm"):
            raise StageError("data.stage_to=shm but /dev/shm does not exist here", "use data.stage_to=tmpdir")
        return "/dev/shm"
    if os.path.isabs(stage_to):
        return stage_to
    raise StageError(f"data.stage_to={stage_to!r} is not auto, slurm_tmpdir, tmpdir, shm or an absolute path",
                     "set data.stage_to=auto (SLURM_TMPDIR, then TMPDIR, then /tmp)")


def private_root(dest: str) -> str:
    """The folder the stage folders go into below ``dest``: ``dest`` itself when it is this user's
    and nobody else may write there, else ``dest/ddp_hpc-<uid>`` (made 0700; an existing one must
    be this user's, a real folder, closed to others)."""
    uid = os.getuid()
    if not shared(dest):
        return dest
    root = os.path.join(dest, f"ddp_hpc-{uid}")
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise StageError(f"stage: cannot make this user's folder {root!r} in {dest!r}: {exc.strerror}",
                         "set data.stage_to to a node-local folder you can write to") from exc
    wrong = _not_private(os.lstat(root), uid)
    if wrong:
        raise StageError(f"stage: {root!r}, this user's folder for staged copies in the shared {dest!r}, is "
                         f"{wrong}: another user could put data there",
                         f"remove {root} (or have an admin remove it), or set data.stage_to to a node-local "
                         "folder of your own")
    return root


def shared(dest: str) -> bool:
    """``dest`` is a folder another user may write to: not this user's, or open to its group or
    to others (``/tmp``, ``/dev/shm``, a group's scratch folder)."""
    st = os.stat(dest)
    return st.st_uid != os.getuid() or bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _not_private(st: os.stat_result, uid: int) -> str | None:
    """What makes a folder untrustworthy as this user's private one; None when nothing does."""
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "not a folder"
    if st.st_uid != uid:
        return f"owned by uid {st.st_uid}"
    if st.st_mode & 0o077:
        return f"open to others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def owned(path: str) -> bool:
    """``path`` is this user's own file or folder (not a symbolic link); False when missing."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return st.st_uid == os.getuid() and not stat.S_ISLNK(st.st_mode)
