"""A node's health, checked in a second before the supervisor trusts it with ranks:
``python -m ddp_hpc.supervise.nodecheck [--dir CKPT_DIR --need-bytes N] [--snapshot-bytes N]
[--stage BYTES:PATH ...]``, one task per node of the next step (``ddp_hpc.supervise.health`` starts
it as a short ``srun`` before the real step, with what this job writes where).

Each check names what is wrong in words status can show after ``<node> excluded:``:

- the GPUs the step sees answer NVML (``nvidia-ml-py``, imported only here and only if installed)
  and have no retired pages waiting for a reset; no NVML (the package, the driver or a GPU
  missing): skipped, no problem. NVML keeps no history of XID errors: a GPU an XID took off the bus
  shows as NVML's error for that device ("GPU is lost"). Each GPU's volatile count of uncorrected
  ECC errors is reported (``ecc``), not judged: it counts since the driver loaded, an earlier job's
  error included, so only the supervisor, which keeps the previous check's count, can tell growth;
- only the folders this job will write on (`path_checks`), each for what it will hold: the staged
  data not yet on this node (its folder: node-local, a node that cannot hold it fails); the
  memory snapshots' store (``/dev/shm``; one that does not fit steps back, so a note, never a
  failure); the checkpoint folder (on the shared filesystem: its problem is every node's alike,
  reported under ``shared``, never a node's failure). Scratch a job does not use is not checked:
  a diskless node or a 1 MB tmpfs ``/tmp`` is no reason to exclude it;
- the rendezvous address (the step's MASTER_ADDR) resolves and this node has a route to it (a UDP
  socket's connect: the kernel's route lookup, no packet sent; nothing listens there yet).

It prints one JSON line: ``{"node", "ok", "problems": [...], "shared": [...], "notes": [...],
"skipped": [...], "ecc": {gpu: count}, "seconds"}`` (``ok``: no problem; shared problems and notes
do not count) and exits 0 either way (the line tells; a failed check step would read as a failed
job step in sacct and status); 2 for bad options.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ddp_hpc.env import DistEnv, EnvError, job_facts
from ddp_hpc.env.sources import derive

__all__ = ["PathCheck", "gpu_problems", "space_problem", "reach_problem", "scratch_dir", "snapshot_base",
           "path_checks", "check", "main"]

GB = 1e9


def _gb(n: float) -> str:
    return f"{n / GB:.1f} GB"


def _visible(environ: Mapping[str, str]) -> list[str] | None:
    """The step's GPUs as CUDA_VISIBLE_DEVICES names them (None: unset, every GPU of the node)."""
    raw = environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    return [d.strip() for d in raw.split(",") if d.strip()]


def gpu_problems(visible: list[str] | None) -> tuple[list[str], list[str], dict[str, int]]:
    """(problems, skipped, ECC counts) of the GPUs ``visible`` names (indices, or ``GPU-...``
    UUIDs; None: every GPU NVML sees); the counts: GPU -> uncorrected volatile ECC errors, for the
    GPUs that count them. No ``pynvml``, no driver or no GPU: skipped, not a problem."""
    if visible == []:
        return [], ["GPU: none visible to the step"], {}
    try:
        import pynvml
    except ImportError:
        return [], ["GPU: nvidia-ml-py not installed"], {}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return [], [f"GPU: NVML not available ({exc})"], {}
    try:
        names = visible if visible is not None else [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
        problems, counts = [], {}
        for name in names:
            wrong, ecc = _one_gpu(pynvml, name)
            problems += wrong
            if ecc is not None:
                counts[name] = ecc
        return problems, [], counts
    except pynvml.NVMLError as exc:
        return [f"GPU: NVML failed to list the GPUs ({exc})"], [], {}
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _one_gpu(nvml, name: str) -> tuple[list[str], int | None]:
    """What is wrong with one GPU (by index or UUID): it does not answer, retired pages pending;
    and its uncorrected volatile ECC count (None: ECC off or not counted). The count is no problem
    here: it is since the driver loaded, and only its growth between two checks tells
    (`health.ecc_problems`)."""
    try:
        h = (nvml.nvmlDeviceGetHandleByUUID(name) if name.startswith(("GPU-", "MIG-"))
             else nvml.nvmlDeviceGetHandleByIndex(int(name)))
        nvml.nvmlDeviceGetMemoryInfo(h)
    except (nvml.NVMLError, ValueError) as exc:
        return [f"GPU {name} does not answer (NVML: {exc})"], None
    out = []
    try:
        ecc = int(nvml.nvmlDeviceGetTotalEccErrors(h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                   nvml.NVML_VOLATILE_ECC))
    except nvml.NVMLError:   # ECC off or not supported: nothing to count
        ecc = None
    try:
        pending = nvml.nvmlDeviceGetRetiredPagesPendingStatus(h)
    except nvml.NVMLError:
        pending = 0
    if pending:
        out.append(f"GPU {name}: retired memory pages pending (the GPU needs a reset)")
    return out, ecc


def space_problem(path: str, need_bytes: int, holds: str = "a checkpoint") -> str | None:
    """Why ``path`` cannot take ``holds`` of ``need_bytes``: not writable, or too little free
    space (None: fine). A probe file is made and removed."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".ddp_hpc-health-", dir=path)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        return f"{path} not writable ({exc.strerror or exc})"
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        return f"{path} full ({_gb(free)} free, {holds} needs {_gb(need_bytes)})"
    return None


def reach_problem(host: str, port: int) -> str | None:
    """Why this node cannot reach the rendezvous address (None: it resolves and has a route)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError) as exc:
        return f"rendezvous host {host} does not resolve ({exc})"
    errors = []
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            try:
                s.connect(addr)
                return None
            except OSError as exc:
                errors.append(f"{addr[0]}: {exc.strerror or exc}")
    return f"no route to the rendezvous address {host}:{port} ({'; '.join(errors)})"


def scratch_dir(environ: Mapping[str, str] | None = None) -> str:
    """The node-local scratch: ``$SLURM_TMPDIR``, else ``$TMPDIR``, else the system's temp folder."""
    facts = job_facts(environ)
    return facts.node_tmpdir or facts.tmpdir or tempfile.gettempdir()


def snapshot_base(environ: Mapping[str, str] | None = None) -> str:
    """Where the memory snapshots go on this node: ``memsnap.job_folder``'s base (``/dev/shm``,
    else scratch), spelled here so that the check does not import torch."""
    facts = job_facts(environ)
    return "/dev/shm" if os.path.isdir("/dev/shm") else (facts.node_tmpdir or tempfile.gettempdir())


@dataclass(frozen=True)
class PathCheck:
    """A folder this job will write on, for ``holds`` of ``need_bytes``; ``fault``: whose fault
    a failure is: ``node`` (this node cannot run the job: it fails), ``shared`` (a folder on the
    shared filesystem: every node's alike, nobody's node), ``note`` (the job goes on without it)."""

    path: str
    need_bytes: int
    holds: str
    fault: str


def _existing(path: str) -> str:
    """``path``, or its nearest folder above that exists (where a copy not made yet will go)."""
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def path_checks(environ: Mapping[str, str], *, ckpt_dirs: Iterable[str] = (), ckpt_bytes: int = 0,
                snapshot_bytes: int | None = None, stage: Iterable[tuple[int, str]] = ()) -> list[PathCheck]:
    """The folders this job will really write on this node, each for what it will hold: the
    staged data not on this node yet (``stage``: bytes and path of each staged copy, room in the
    nearest folder that exists), the memory snapshots (``snapshot_bytes`` None: this job keeps
    none), the checkpoint folders. A folder the job does not write on (scratch of a job that
    stages nothing) is never checked: its failure would exclude a node that can run the job."""
    out, staged = [], {}
    for size, path in stage:
        if not os.path.exists(path):     # already staged here: it holds itself
            folder = _existing(os.path.dirname(path))
            staged[folder] = staged.get(folder, 0) + size
    out += [PathCheck(folder, size, "the staged data", "node") for folder, size in staged.items()]
    if snapshot_bytes is not None:
        out.append(PathCheck(snapshot_base(environ), snapshot_bytes, "a memory snapshot", "note"))
    out += [PathCheck(d, ckpt_bytes, "a checkpoint", "shared") for d in dict.fromkeys(ckpt_dirs)]
    return out


_SAID = {"shared": "checkpoint folder {why}: not a node's fault, no node excluded",
         "note": "{why}: memory snapshots step back on this node, the job goes on"}


def check(env: DistEnv, environ: Mapping[str, str], dirs: list[str], need_bytes: int, *,
          snapshot_bytes: int | None = None, stage: Iterable[tuple[int, str]] = ()) -> dict:
    """Every check on this node, as the JSON object `main` prints (``dirs``, ``need_bytes``: the
    checkpoint folders and one checkpoint's size; the rest: `path_checks`)."""
    t0 = time.monotonic()
    problems, skipped, ecc = gpu_problems(_visible(environ))
    found: dict[str, list[str]] = {"node": problems, "shared": [], "note": []}
    for c in path_checks(environ, ckpt_dirs=dirs, ckpt_bytes=need_bytes, snapshot_bytes=snapshot_bytes,
                         stage=stage):
        if why := space_problem(c.path, c.need_bytes, c.holds):
            found[c.fault].append(_SAID[c.fault].format(why=why) if c.fault in _SAID else why)
    if why := reach_problem(env.master_addr, env.master_port):
        problems.append(why)
    node = env.hostnames[env.node_rank] if env.node_rank < len(env.hostnames) else socket.gethostname()
    return {"node": node, "ok": not problems, "problems": problems, "shared": found["shared"],
            "notes": found["note"], "skipped": skipped, "ecc": ecc, "seconds": round(time.monotonic() - t0, 3)}


def _stage_arg(text: str) -> tuple[int, str]:
    size, sep, path = text.partition(":")
    if not sep or not size.isdigit() or not os.path.isabs(path):
        raise argparse.ArgumentTypeError(f"--stage {text!r}: expected BYTES:/absolute/path")
    return int(size), path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddp_hpc.supervise.nodecheck", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", action="append", default=[], help="the checkpoint folder (shared: never a node's fault)")
    p.add_argument("--need-bytes", type=int, default=0, help="free space one checkpoint needs")
    p.add_argument("--snapshot-bytes", type=int, default=None,
                   help="this job keeps memory snapshots of about this size (absent: it keeps none)")
    p.add_argument("--stage", type=_stage_arg, action="append", default=[], metavar="BYTES:PATH",
                   help="a staged copy this job reads on every node: its size and path")
    args = p.parse_args(argv)
    try:   # the task's place, not `detect`'s checks: one check task per node sees all the node's GPUs
        env = derive(os.environ)
    except (EnvError, ValueError) as exc:
        print(json.dumps({"node": socket.gethostname(), "ok": False, "problems": [f"task environment: {exc}"],
                          "shared": [], "notes": [], "skipped": [], "ecc": {}, "seconds": 0.0}), flush=True)
        return 0
    print(json.dumps(check(env, os.environ, args.dir, args.need_bytes, snapshot_bytes=args.snapshot_bytes,
                           stage=args.stage)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
