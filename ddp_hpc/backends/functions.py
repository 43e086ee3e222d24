"""A Python function as a DDP job: what each rank runs, and the local driver.

Every rank calls ``fn(*args, **kwargs)`` with torchrun's variables set (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, ...: the same contract ``ddp_hpc.exec`` gives a script), so the function
initialises ``torch.distributed`` the way a torchrun script does (``init_process_group()`` or
``ddp_hpc.setup_ddp()``). The rank writes ``start``, ``error`` and ``end`` events into the job's
log directory, so ``ddp-hpc status`` shows a function job like any other.

Where it runs: in a submitit task on Slurm (``rank_entry`` is what submitit pickles), or on this
machine, where ``local_driver`` (in its own process, so the handle can cancel it) starts the
ranks with ``ddp_hpc.launch.launch_distributed`` as N pretend nodes and sends rank 0's return
value, or the first failing rank's error, back through a pipe.
"""

from __future__ import annotations

import os
import pickle
import time
import traceback
from typing import Any, Callable, Mapping, Sequence

from ddp_hpc.data.scriptstage import SPEC_VAR, call_staged, decode_items
from ddp_hpc.env import detect, host_gpus
from ddp_hpc.launch.tree import pretend_node_gpus
from ddp_hpc.runlogs.writer import RunLog

__all__ = ["rank_entry", "local_rank_entry", "local_driver", "describe"]


def describe(fn: Callable) -> str:
    """``module:qualname`` of a function (what the record and the start event show)."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def rank_entry(fn: Callable, args: Sequence[Any], kwargs: Mapping[str, Any], log_dir: str,
               stage: str = "") -> Any:
    """One rank: export the torchrun variables, run ``fn``, record how it ended; re-raises.
    ``stage``: ``stage=[...]`` of ``ddp_hpc.submit`` (``$DDP_HPC_STAGE``'s JSON): staged on this
    node first, each path in ``$DDP_HPC_STAGE_<NAME>``, given back after ``fn`` (not after a
    requeue, ``SystemExit(75)``)."""
    os.environ["DDP_HPC_LOG_DIR"] = log_dir
    os.environ.pop(SPEC_VAR, None)   # the batch script's copy of `stage`: staged here, not by fn
    env = detect()
    env.export()
    log = RunLog(log_dir, env.rank, job_id=env.job_id, restart=env.restart_count, console=False)
    log.event("start", world_size=env.world_size, num_nodes=env.num_nodes,
              local_rank=env.local_rank, pid=os.getpid(), launcher=f"function/{env.launcher}",
              command=[f"<function {describe(fn)}>"], device=None, total_steps=None, epochs=None)
    log.info(f"running {describe(fn)} as rank {env.rank} of {env.world_size}", console=False)
    started = time.time()
    try:
        if stage:
            result = call_staged(env, decode_items(stage), log, lambda: fn(*args, **dict(kwargs)))
        else:
            result = fn(*args, **dict(kwargs))
    except BaseException as exc:
        failed = not (isinstance(exc, SystemExit) and exc.code in (0, None))
        if failed:
            log.event("error", exc_type=type(exc).__qualname__, message=str(exc),
                      traceback=traceback.format_exc(), exit_code=1, signal=None)
        log.event("end", status="failed" if failed else "completed", exit_code=1 if failed else 0,
                  signal=None, step=None, duration_s=round(time.time() - started, 3))
        log.close()
        raise
    log.event("end", status="completed", exit_code=0, signal=None, step=None,
              duration_s=round(time.time() - started, 3))
    log.close()
    return result


def local_rank_entry(rank: int, world_size: int, fn: Callable, args: Sequence[Any],
                     kwargs: Mapping[str, Any], log_dir: str, stage: str = "") -> Any:
    """``launch_distributed``'s calling convention around ``rank_entry``."""
    return rank_entry(fn, args, kwargs, log_dir, stage)


def local_driver(fn: Callable, args: Sequence[Any], kwargs: Mapping[str, Any], log_dir: str,
                 nodes: int, gpus_per_node: int, conn, stage: str = "") -> None:
    """The body of a local function job's driver process: run every rank, send back
    ``("ok", pickled rank 0 result)`` or ``("err", RankFailedError)``."""
    from ddp_hpc.launch import RankFailedError, launch_distributed

    try:
        gpus = pretend_node_gpus([gpus_per_node] * nodes, host_gpus(os.environ))
        results = launch_distributed(local_rank_entry, nodes * gpus_per_node,
                                     (fn, tuple(args), dict(kwargs), log_dir, stage), nodes=nodes,
                                     gpus=gpus)
        msg: tuple = ("ok", pickle.dumps(results[0]))
    except RankFailedError as exc:
        msg = ("err", exc)
    except BaseException as exc:  # noqa: BLE001 - the handle must hear about every failure
        msg = ("err", RankFailedError(-1, type(exc).__qualname__, str(exc), traceback.format_exc()))
    try:
        conn.send(msg)
    finally:
        conn.close()
