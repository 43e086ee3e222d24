"""The run-log contract in one place: file names in a run's log directory, event names and the keys
every event carries. The writer (training core, script wrapper), the submit backends (srun and
batch output paths) and the reader (status) all spell names through here.

Files in a run's log directory, per rank R:
- ``rank{R}.log``:          the training core's text log (one line per epoch / interval). Read this first.
- ``node{K}.events.jsonl``: per node K of the job (its index, 0-based), one JSON object per line
                            (the events below, each with its rank) from every rank on that node:
                            what status reads. Run directories of earlier versions hold one
                            ``rank{R}.events.jsonl`` per rank instead; both are read.
- ``rank{R}.out``:          the process's raw stdout/stderr, captured by srun or the local launcher:
                            Python tracebacks, library warnings, anything printed outside the logger.
- ``slurm-<id>.out``:       the batch script's own output (srun's exit reports), Slurm jobs only.
- ``config.yaml``:          the resolved job config the run trained with.
- ``rank{R}.fault``:        a script's native-crash stacks (faulthandler, from ``ddp_hpc.exec``'s
                            instrumentation): SIGSEGV / SIGABRT / SIGBUS in a C extension.
- ``rank{R}.error.json``:   torch.distributed.elastic's error file (``TORCHELASTIC_ERROR_FILE``).
- ``flight_recorder_rank{R}``: PyTorch's flight recorder dump (NCCL, on a collective timeout).
- ``local-driver.out``:     the local backend's driver output (its "FAILED: rank R exited with RC"
                            lines), local jobs only.
- ``standby.out``:          the warm standby's ranks' output until they are handed a step, and
                            a line from each that stepped back (no room for it in memory).
- ``restarts.jsonl``:       the in-allocation restarts (``ddp_hpc.supervise``): one JSON object per
                            restart (`ALLOC_RESTART_KEYS`), and one for a step the supervisor
                            stopped without restarting it (`ALLOC_STOP_KEYS`), and one for a
                            health check that excluded nodes (`ALLOC_HEALTH_KEYS`), and one for a
                            hang limit that stood back (`ALLOC_HOLD_KEYS`), written by the
                            batch step.
"""

from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path

#: keys present in every event
EVENT_KEYS = ("time", "event", "rank", "job_id", "restart", "host")

#: event name -> its extra keys (docs/architecture.md, "Run logs")
EVENTS: dict[str, tuple[str, ...]] = {
    "start": ("world_size", "num_nodes", "local_rank", "pid", "total_steps", "epochs", "launcher",
              "device", "command"),
    "step": ("epoch", "step", "total_steps", "loss", "lr", "samples_per_s", "data_s", "rss_mb",
             "cpu_percent", "metrics", "steps_per_s", "compute_s", "snapshot_s"),
    "epoch": ("epoch", "step", "loss", "samples_per_s"),
    "eval": ("epoch", "step", "metrics"),
    # written when the file is complete; blocking_s: seconds the training thread was blocked by
    # this save (a copy of the state, or all of a blocking save), write_s: the write's own seconds
    "checkpoint": ("step", "path", "blocking_s", "write_s"),
    # every rank, once it loaded its state at a (re)start (train/restore.py): the step, where it
    # came from (source "memory" | "peer" | "file" | "none"), the node that held it, seconds, file,
    # and the nodes of the snapshot's run that no longer held it (lost); fallback: why a restore
    # from memory failed and the files were taken instead (only then)
    "restored": ("step", "source", "node", "seconds", "path", "lost", "fallback"),
    # a node's memory snapshots stepped back (train/memsnap.py, train/memroom.py): status "off",
    # why (the state does not fit /dev/shm or the job's memory, a write failed), the step; or its
    # sweep freed what ended jobs left there (train/memsweep.py): status "swept", why (what, where)
    "memsnap": ("status", "why", "step"),
    "preempt": ("signal", "reason", "step"),
    "requeue": ("job_id",),
    "error": ("exc_type", "message", "traceback", "exit_code", "signal"),
    "end": ("status", "step", "exit_code", "signal", "duration_s", "teardown"),
    # work: what the process did over the last seconds (runlogs/vitals.py: over_s, cpu_s,
    # io_bytes, places): a rank busy outside a collective is no hang
    "stack": ("reason", "stack", "step", "work"),
    # once per rank when its process group is up (runlogs/startup.py): when its process started,
    # when it called init_process_group, when that returned; a restart's phases come from these
    "rendezvous": ("proc_start", "called_at", "up_at", "step_id", "warm"),
    # the training core while it evaluates or saves a checkpoint (no step events then), and a
    # script's rank 0 in ddp_hpc.checkpoint.save: phase ("eval" | "checkpoint"), the step: signs
    # of life for the supervisor (at most one per 5 s);
    # phase "exit": an instrumented script's interpreter ends (no hang is called while it does)
    "progress": ("phase", "step"),
    # data.io=stage and submit --stage, on each node leader: how (copy | sbcast | reused), where,
    # bytes, time; for --stage also the script's variable (DDP_HPC_STAGE_<NAME>)
    # each rank's GPU through NVML, at most every 10 s, from a thread of its own (runlogs/gpu.py):
    # the GPU's NVML UUID and what NVML answers of (a field it does not answer is absent)
    "gpu": ("gpu", "util_percent", "mem_used_mb", "mem_total_mb", "temp_c", "power_w", "ecc_errors",
            "xid_errors"),
    "stage": ("method", "path", "src", "bytes", "files", "seconds", "mb_per_s", "copy_seconds", "made_by",
              "node", "users", "variable"),
}

CONFIG_FILE = "config.yaml"
BATCH_OUT_GLOB = "slurm-*.out"
LOCAL_DRIVER_OUT = "local-driver.out"
ALLOC_RESTARTS_FILE = "restarts.jsonl"
#: the warm standby's output until its ranks are handed a step (``supervise.warm``), and how a
#: standby rank's line there begins when it stepped back (``supervise.standroom``: no room for it)
STANDBY_OUT = "standby.out"
STANDBY_BACK = "ddp_hpc standby: stepped back"
#: the line the supervisor writes there before it starts a standby (what a reader takes as the newest one's)
STANDBY_MARK = "ddp_hpc supervise: --- a warm standby starts ---"
#: TensorBoard's event files, rank 0 writes them into the run directory (`runlogs.tboard`)
TBOARD_GLOB = "events.out.tfevents.*"
#: the keys of one in-allocation restart (docs/restarts.md): the new run's restart number, the
#: job, when the fault happened and when the supervisor saw it, why (trigger, kind, rank, node,
#: basis, the failure's summary), the nodes excluded, the nodes and world size before and after,
#: when the old step's ranks were gone (``stopped_at``: the restart phases' stop, docs/restarts.md)
ALLOC_RESTART_KEYS = ("restart", "job_id", "fault_at", "detected_at", "trigger", "stop", "why", "kind",
                      "rank", "node", "basis", "excluded", "nodes_before", "nodes_after", "world_before",
                      "world_after", "stopped_at")
#: the keys of a step the supervisor stopped and did not restart (a line of restarts.jsonl with no
#: ``restart``): the run stopped, the job, when, the trigger, why it stopped the step (``stop``),
#: what failed (as a restart's), and why it did not restart
ALLOC_STOP_KEYS = ("stopped_run", "job_id", "fault_at", "detected_at", "trigger", "stop", "why", "kind",
                   "rank", "node", "basis", "not_restarted")
#: the keys of a health check that excluded nodes before a start (``ddp_hpc.supervise.health``; a
#: line of restarts.jsonl with neither ``restart`` nor ``stopped_run``): the run about to start,
#: the job, when, how long the check took, node -> why it was excluded, the nodes the run starts
#: on, and why it did not start (too few healthy nodes; None: it started)
ALLOC_HEALTH_KEYS = ("health_check", "job_id", "time", "seconds", "excluded", "nodes_after", "not_started",
                     "notes")
#: the keys of a hang limit that stood back (``ddp_hpc.supervise``: the stacks showed ranks working
#: outside a collective, so no hang): the run, the job, when, the seconds without a step it had
#: waited, the ranks that worked and their work in words, when it asks again (seconds)
ALLOC_HOLD_KEYS = ("held_run", "job_id", "time", "after_s", "ranks", "work", "again_s")

EVENTS_RE = re.compile(r"^rank(\d+)\.events\.jsonl$")
#: the event file of node K of a job (``runlogs.nodelog``): every rank of that node writes there
NODE_EVENTS_RE = re.compile(r"^node(\d+)\.events\.jsonl$")
#: an event file of either layout
ANY_EVENTS_RE = re.compile(f"{EVENTS_RE.pattern}|{NODE_EVENTS_RE.pattern}")
OUT_RE = re.compile(r"^rank(\d+)\.out$")
LOG_RE = re.compile(r"^rank(\d+)\.log$")


#: what each per-rank file holds, in the words status shows, so a reader knows which to open first
RANK_FILE_ROLES = {
    "log": "the training log: read it first",
    "out": "raw stdout/stderr: tracebacks and anything printed outside the logger",
}


def text_log(rank: int | str) -> str:
    return f"rank{rank}.log"


def events_file(rank: int) -> str:
    """A rank's own event file: the layout before events went per node (still read)."""
    return f"rank{rank}.events.jsonl"


def node_events_file(node: int) -> str:
    """The event file of node ``node`` (its index in the job, 0-based): its ranks' events."""
    return f"node{node}.events.jsonl"


def rank_out(rank: int | str) -> str:
    """``rank{R}.out``; pass ``"%t"`` for srun's ``--output`` pattern."""
    return f"rank{rank}.out"


#: the line the supervisor appends to every ``rank{R}.out`` of a step before it starts it (srun
#: appends each run's output to the same file): a reader looks for a rank's traceback only after
#: the newest one, so a traceback of an earlier run is not read as this run's
RUN_MARK = "ddp_hpc supervise: --- run {restart} starts ---"
RUN_MARK_RE = re.compile(r"^ddp_hpc supervise: --- run \d+ starts ---$")


def fault_file(rank: int | str) -> str:
    return f"rank{rank}.fault"


def error_file(rank: int | str) -> str:
    return f"rank{rank}.error.json"


def flight_prefix() -> str:
    """The flight recorder's dump file prefix; PyTorch appends the rank."""
    return "flight_recorder_rank"


def batch_out(job_pattern: str = "%j") -> str:
    """The batch script's output file name; ``"%A_%a"`` inside an array."""
    return f"slurm-{job_pattern}.out"


def batch_outputs(log_dir: Path) -> list[Path]:
    """The batch output files (`BATCH_OUT_GLOB`) in ``log_dir`` now, in name order (os.listdir:
    Path.glob was slower); none when it cannot be listed."""
    try:
        names = os.listdir(log_dir)
    except OSError:
        return []
    return [log_dir / n for n in sorted(names) if fnmatch.fnmatchcase(n, BATCH_OUT_GLOB)]
