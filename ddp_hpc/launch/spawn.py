"""`launch_distributed(fn, world_size)`: a Python function in spawned processes, one per rank.

Each rank's return value comes back to the caller. The first rank to fail raises
`RankFailedError` in the caller and every other rank is killed at once: a rank blocked in a
collective waiting for a dead peer would otherwise hang until the 30-minute collective timeout.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import sys
import threading
import time
import traceback
from multiprocessing.connection import wait as mp_wait
from typing import Any, Callable, Sequence

from ddp_hpc.env import free_port
from ddp_hpc.errors import HintError
from ddp_hpc.exits import signal_name
from ddp_hpc.launch.tree import (
    KILL_GRACE_S,
    limit_threads,
    live_processes,
    local_rank_env,
    new_job_id,
    node_layout,
    stop_processes,
    thread_env,
)

EXIT_GRACE_S = 30.0  # a rank that sent its result gets this long to exit before it is killed


class RankFailedError(RuntimeError):
    """A rank of a local launch failed; the first failure (by time) is the one reported."""

    def __init__(self, rank: int, exc_type: str, message: str, traceback_text: str = "",
                 exitcode: int | None = None):
        self.rank, self.exc_type, self.message = rank, exc_type, message
        self.traceback_text, self.exitcode = traceback_text, exitcode
        text = f"rank {rank} failed: {exc_type}: {message}"
        if traceback_text:
            text += f"\n--- traceback of rank {rank} ---\n{traceback_text.rstrip()}"
        super().__init__(text)

    def __reduce__(self):  # keep the attributes when pickled (e.g. across another launch)
        return (type(self), (self.rank, self.exc_type, self.message, self.traceback_text,
                             self.exitcode))


class NotPicklableError(HintError, TypeError):
    """``fn`` or its arguments cannot be sent to a spawned process."""


def launch_distributed(fn: Callable, world_size: int, args: tuple = (), *,
                       nodes: int | Sequence[int] = 1, timeout: float | None = None,
                       start_method: str = "spawn", gpus: Sequence[str] | None = None) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` local processes; return the results.

    ``fn`` and ``args`` must be picklable (a module-level function). ``nodes`` pretends the ranks
    are spread over nodes, contiguously (a count, or per-node counts such as ``(3, 1)``).
    Raises ``RankFailedError`` for the first rank that fails (a Python exception, or dying
    without one) after killing every other rank; ``TimeoutError`` naming the unfinished ranks
    when ``timeout`` seconds pass. ``gpus``: each pretend node's CUDA_VISIBLE_DEVICES
    (``pretend_node_gpus``); without it every rank sees this process's GPUs.
    """
    counts = node_layout(world_size, nodes)
    threads = thread_env(sum(counts))  # all pretend nodes share this machine
    envs = [{**e, **threads} for e in local_rank_env(counts, free_port(), new_job_id(), gpus=gpus)]
    ctx = mp.get_context(start_method)
    procs, conns = [], []
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, name=f"ddp_hpc-rank{rank}",
                            args=(fn, rank, world_size, tuple(args), envs[rank], send))
            try:
                p.start()
            except (pickle.PicklingError, AttributeError, TypeError) as exc:
                raise NotPicklableError(
                    f"launch_distributed: cannot send fn={fn!r} or args to a {start_method!r} "
                    f"process: {exc}", "use a function defined at module level (not a lambda or "
                    "nested function) and picklable args") from exc
            send.close()
            procs.append(p)
            conns.append(recv)
        results = _collect(procs, conns, timeout)
        _join_until(procs, time.monotonic() + EXIT_GRACE_S)  # let them finish exiting
        return results
    finally:
        live = [p.pid for p in procs if p.is_alive()]
        if live:
            stop_processes(live_processes(live))   # and their descendants; SIGKILL after a grace
        for p in procs:
            p.join(timeout=KILL_GRACE_S)
        for c in conns:
            c.close()


# ----------------------------------------------------------------------------- in the rank
def _worker(fn: Callable, rank: int, world_size: int, args: tuple, env: dict, conn) -> None:
    """Child body: set the rank's variables, run ``fn``, send ("ok"|"err", ...) back."""
    os.environ.update(env)
    _exit_with_launcher()
    limit_threads()
    try:
        msg = ("ok", rank, fn(rank, world_size, *args))
    except SystemExit as exc:  # sys.exit(0) in a rank is a normal end, anything else a failure
        if exc.code in (0, None):
            msg = ("ok", rank, None)
        else:
            msg = ("err", rank, time.time(), "SystemExit", f"exit code {exc.code}",
                   traceback.format_exc())
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        msg = ("err", rank, time.time(), type(exc).__qualname__, str(exc), traceback.format_exc())
    _close_run_logs()
    try:
        if msg[0] == "ok":  # pickled here, by value: multiprocessing would pass tensors as shared
            msg = ("ok", rank, pickle.dumps(msg[2]))  # memory of a process about to exit
        conn.send(msg)
    except Exception as exc:  # e.g. an unpicklable return value
        conn.send(("err", rank, time.time(), type(exc).__qualname__,
                   f"could not send rank {rank}'s result back: {exc}", traceback.format_exc()))
    conn.close()
    if msg[0] == "err":
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(1)  # skip interpreter teardown: a wedged process group must not hang the exit


def _close_run_logs() -> None:
    """The run-log lines this rank's node writer still holds, appended before the caller hears of
    the result (it may read the logs at once) and before an ``os._exit``."""
    nodelog = sys.modules.get("ddp_hpc.runlogs.nodelog")
    if nodelog is not None:
        try:
            nodelog.close_all()
        except Exception:  # noqa: BLE001 - the result must reach the parent
            pass


def _exit_with_launcher() -> None:
    """End this rank when the launching process dies (SIGKILL, OOM): otherwise it would stay
    behind, possibly blocked in a collective for the full 30-minute timeout."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()  # returns when the launcher's end of the sentinel pipe closes
        os._exit(1)

    threading.Thread(target=watch, name="ddp_hpc-launcher-watch", daemon=True).start()


# ----------------------------------------------------------------------------- in the caller
def _death_error(rank: int, exitcode: int | None) -> RankFailedError:
    if exitcode is not None and exitcode < 0:
        return RankFailedError(rank, "ProcessKilled", f"killed by {signal_name(-exitcode)} without a Python "
                               "exception", exitcode=exitcode)
    return RankFailedError(rank, "ProcessExited", f"exited with code {exitcode} without a Python "
                           "exception (os._exit, a crash in native code, or the OOM killer?)",
                           exitcode=exitcode)


def _join_until(procs: list, deadline: float) -> None:
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))


def _collect(procs: list, conns: list, timeout: float | None) -> list:
    """Wait for every rank's message or death; raise at the first failure round."""
    deadline = None if timeout is None else time.monotonic() + timeout
    results: dict[int, Any] = {}
    pending_conn = {c: r for r, c in enumerate(conns)}
    pending_proc = {p.sentinel: r for r, p in enumerate(procs)}

    def read(conn, rank: int, errors: list) -> None:
        del pending_conn[conn]
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # died without a message: its sentinel reports it
        if msg[0] == "ok":
            results[rank] = pickle.loads(msg[2])
        else:
            _, rank, t, exc_type, message, tb = msg
            errors.append((t, RankFailedError(rank, exc_type, message, tb)))

    while len(results) < len(procs):
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = mp_wait(list(pending_conn) + list(pending_proc), timeout=left)
        if not ready:
            missing = sorted(set(range(len(procs))) - set(results))
            raise TimeoutError(f"launch_distributed: ranks {missing} still running after "
                               f"timeout={timeout} s; all ranks were killed")
        errors: list[tuple[float, RankFailedError]] = []
        for obj in ready:
            if obj in pending_conn:
                read(obj, pending_conn[obj], errors)
        for obj in ready:
            if obj not in pending_proc:
                continue
            rank = pending_proc.pop(obj)
            procs[rank].join()
            if conns[rank] in pending_conn:  # exited; its last message may still be unread
                read(conns[rank], rank, errors)
            if rank not in results and not any(e.rank == rank for _, e in errors):
                # A death seen in the same round as peers' errors most likely caused them
                # (their sockets closed): it sorts first.
                errors.append((float("-inf"), _death_error(rank, procs[rank].exitcode)))
        if errors:
            raise min(errors, key=lambda e: e[0])[1]
    return [results[r] for r in range(len(procs))]
