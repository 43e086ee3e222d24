"""One node's staging of one source, for every rank on the node: the one mechanism behind both
``data.io=stage`` (:mod:`ddp_hpc.data.io`) and ``ddp-hpc submit --stage`` for scripts
(:mod:`ddp_hpc.data.scriptstage`).

Every rank of a node calls :func:`stage_on_node` with the same source and destination: local
rank 0 copies (or adopts an ``sbcast`` copy, or reuses a verified one: :mod:`ddp_hpc.data.stage`),
the others wait on its completion marker.  Every rank of the node is a *user* of the copy
(``node<N>@host`` for local rank 0, ``node<N>@host/local<K>`` for the others; registered by the
node's leader, so a rank never waits on a copy its leader has not vouched for in this attempt),
and every rank gives it back with :func:`release_on_node` when it is done.  The last user out
removes the copy, so no collective is needed at the end: a script's wrapper has none, and node
leaders that share one stage folder (pretend nodes on one machine) remove it once.

:func:`stage_log_entry` words one leader's staging for its run log (a line and a ``stage`` event),
the same for config jobs and scripts; ``ddp-hpc status`` shows those events per node.
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import replace

from ddp_hpc.data.stage import StageRequest, StageResult, cleanup_staged, stage_result
from ddp_hpc.data.stagefolder import folder_lock, register_user
from ddp_hpc.env import job_facts
from ddp_hpc.runlogs.writer import RunLog

__all__ = ["STAGE_WAIT_S", "node_user", "rank_user", "stage_on_node", "release_on_node", "stage_log_entry",
           "write_run_log"]

log = logging.getLogger("ddp_hpc.data.nodestage")
#: how long a rank waits for its node leader's copy (a first copy of a large dataset is slow)
STAGE_WAIT_S = 6 * 3600.0


def node_user(env) -> str:
    """This node leader's name on a shared stage folder (pretend nodes share the host name)."""
    return f"node{env.node_rank}@{socket.gethostname()}"


def rank_user(env) -> str:
    """This rank's name among the copy's users: its node leader's, plus ``/local<K>`` off rank 0."""
    return node_user(env) if env.local_rank == 0 else f"{node_user(env)}/local{env.local_rank}"


def stage_on_node(src: str | os.PathLike, dest: str, env, *, wait_timeout: float = STAGE_WAIT_S,
                  progress: bool | None = None) -> StageResult:
    """Stage ``src`` below ``dest`` for this rank (every rank of the node calls it); -> the copy.

    ``env`` is the rank's :class:`ddp_hpc.env.DistEnv` (job id, restart count, node and local
    rank, ranks on the node).  The leader registers all of its node's ranks as users in this
    attempt; each then holds the copy until :func:`release_on_node`."""
    request = StageRequest(src, dest, job_id=env.job_id, restart_count=env.restart_count,
                           copier=env.local_rank == 0, user=rank_user(env), wait_timeout=wait_timeout,
                           progress=progress)
    res = stage_result(request)
    if env.local_rank != 0 or env.local_world_size < 2:
        return res
    folder = os.path.dirname(res.path)
    with folder_lock(folder):
        for k in range(1, env.local_world_size):
            users = register_user(folder, f"{node_user(env)}/local{k}", request.attempt)
    return replace(res, users=tuple(sorted(users)))


def release_on_node(path: str, env) -> tuple[str, list[str]]:
    """This rank is done with the staged copy at ``path``: unregister it; the last user removes
    the copy.  -> ``(removed | kept | gone, users left)``; a removal that fails raises
    :class:`ddp_hpc.data.errors.StageError` naming what is left."""
    return cleanup_staged(path, rank_user(env))


def stage_log_entry(res: StageResult, user: str, variable: str | None = None) -> tuple[str, dict]:
    """The text line and the ``stage`` event fields that describe one node leader's staging
    (``variable``: the environment variable a script reads the path from, for ``--stage``)."""
    how = {"copy": "copied", "sbcast": "adopted the sbcast copy of", "reused": "reused the copy of"}
    if res.method == "reused":
        detail = f"made by attempt {res.made_by}"
    else:
        detail = f"copy {res.copy_seconds:.2f} s, {res.mb_per_s:.0f} MB/s"
    line = (f"stage: {how.get(res.method, res.method)} {res.src} -> {res.path} on {user}: "
            f"{res.bytes / 1e6:.1f} MB, {res.files} file(s) in {res.seconds:.2f} s ({detail})")
    if variable:
        line += f"; ${variable}"
    fields = {"method": res.method, "path": res.path, "src": res.src, "bytes": res.bytes, "files": res.files,
              "seconds": res.seconds, "mb_per_s": res.mb_per_s, "copy_seconds": res.copy_seconds,
              "made_by": res.made_by, "node": user, "users": list(res.users)}
    if variable:
        fields["variable"] = variable
    return line, fields


def write_run_log(env, line: str, event: dict | None = None, warning: bool = False) -> bool:
    """Add ``line`` (and a ``stage`` event) to this rank's run log when its directory is known
    now ($DDP_HPC_LOG_DIR); False when it is not, or cannot be written (logged; the run goes on)."""
    log_dir = job_facts().log_dir
    if not log_dir:
        return False
    try:
        run_log = RunLog(log_dir, env.rank, env.job_id, env.restart_count, console=False)
        try:
            run_log.warning(line) if warning else run_log.info(line)
            if event is not None:
                run_log.event("stage", **event)
        finally:
            run_log.close()
    except OSError as e:
        log.warning("cannot write rank %s's run log in %s: %s", env.rank, log_dir, e)
        return False
    return True
