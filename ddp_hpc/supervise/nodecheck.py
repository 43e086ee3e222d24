"""A node's health, checked in a second before the supervisor trusts it with ranks:
``python -m ddp_hpc.supervise.nodecheck --dir CKPT_DIR --need-bytes N``, one task per node of the
next step (``ddp_hpc.supervise.health`` starts it as a short ``srun`` before the real step).

Each check names what is wrong in words status can show after ``<node> excluded:``:

- the GPUs the step sees answer NVML (``nvidia-ml-py``, imported only here and only if installed)
  and have no uncorrected ECC errors or retired pages waiting for a reset; no NVML (the package,
  the driver or a GPU missing): skipped, no problem. NVML keeps no history of XID errors: a GPU
  an XID took off the bus shows as NVML's error for that device ("GPU is lost");
- node-local scratch (``$SLURM_TMPDIR``, else ``$TMPDIR``, else the system's temporary folder) and
  the checkpoint folder (``--dir``) take a file, and have room for one checkpoint (``--need-bytes``:
  the newest checkpoint's size, or the supervisor's estimate);
- the rendezvous address (the step's MASTER_ADDR) resolves and this node has a route to it (a UDP
  socket's connect: the kernel's route lookup, no packet sent; nothing listens there yet).

It prints one JSON line: ``{"node", "ok", "problems": [...], "skipped": [...], "seconds"}`` and
exits 0 either way (the line tells; a failed check step would read as a failed job step in
sacct and status); 2 for bad options.
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
from collections.abc import Mapping

from ddp_hpc.env import DistEnv, EnvError, job_facts
from ddp_hpc.env.sources import derive

__all__ = ["gpu_problems", "space_problem", "reach_problem", "scratch_dir", "check", "main"]

GB = 1e9


def _gb(n: float) -> str:
    return f"{n / GB:.1f} GB"


def _visible(environ: Mapping[str, str]) -> list[str] | None:
    """The step's GPUs as CUDA_VISIBLE_DEVICES names them (None: unset, every GPU of the node)."""
    raw = environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    return [d.strip() for d in raw.split(",") if d.strip()]


def gpu_problems(visible: list[str] | None) -> tuple[list[str], list[str]]:
    """(problems, skipped) of the GPUs ``visible`` names (indices, or ``GPU-...`` UUIDs; None:
    every GPU NVML sees). No ``pynvml``, no driver or no GPU: skipped, not a problem."""
    if visible == []:
        return [], ["GPU: none visible to the step"]
    try:
        import pynvml
    except ImportError:
        return [], ["GPU: nvidia-ml-py not installed"]
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return [], [f"GPU: NVML not available ({exc})"]
    try:
        names = visible if visible is not None else [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
        return [p for name in names for p in _one_gpu(pynvml, name)], []
    except pynvml.NVMLError as exc:
        return [f"GPU: NVML failed to list the GPUs ({exc})"], []
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _one_gpu(nvml, name: str) -> list[str]:
    """What is wrong with one GPU (by index or UUID): it does not answer, uncorrected ECC errors,
    retired pages pending."""
    try:
        h = (nvml.nvmlDeviceGetHandleByUUID(name) if name.startswith(("GPU-", "MIG-"))
             else nvml.nvmlDeviceGetHandleByIndex(int(name)))
        nvml.nvmlDeviceGetMemoryInfo(h)
    except (nvml.NVMLError, ValueError) as exc:
        return [f"GPU {name} does not answer (NVML: {exc})"]
    out = []
    try:
        ecc = nvml.nvmlDeviceGetTotalEccErrors(h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
    except nvml.NVMLError:   # ECC off or not supported: nothing to count
        ecc = 0
    if ecc:
        out.append(f"GPU {name}: {ecc} uncorrected ECC error(s) since the driver loaded")
    try:
        pending = nvml.nvmlDeviceGetRetiredPagesPendingStatus(h)
    except nvml.NVMLError:
        pending = 0
    if pending:
        out.append(f"GPU {name}: retired memory pages pending (the GPU needs a reset)")
    return out


def space_problem(path: str, need_bytes: int) -> str | None:
    """Why ``path`` cannot take one checkpoint of ``need_bytes``: not writable, or too little free
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
        return f"{path} full ({_gb(free)} free, checkpoint needs {_gb(need_bytes)})"
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


def check(env: DistEnv, environ: Mapping[str, str], dirs: list[str], need_bytes: int) -> dict:
    """Every check on this node, as the JSON object `main` prints."""
    t0 = time.monotonic()
    problems, skipped = gpu_problems(_visible(environ))
    for path in dict.fromkeys([scratch_dir(environ), *dirs]):
        if why := space_problem(path, need_bytes):
            problems.append(why)
    if why := reach_problem(env.master_addr, env.master_port):
        problems.append(why)
    node = env.hostnames[env.node_rank] if env.node_rank < len(env.hostnames) else socket.gethostname()
    return {"node": node, "ok": not problems, "problems": problems, "skipped": skipped,
            "seconds": round(time.monotonic() - t0, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddp_hpc.supervise.nodecheck", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", action="append", default=[], help="a folder that must take a checkpoint")
    p.add_argument("--need-bytes", type=int, default=0, help="free space one checkpoint needs")
    args = p.parse_args(argv)
    try:   # the task's place, not `detect`'s checks: one check task per node sees all the node's GPUs
        env = derive(os.environ)
    except (EnvError, ValueError) as exc:
        print(json.dumps({"node": socket.gethostname(), "ok": False, "problems": [f"task environment: {exc}"],
                          "skipped": [], "seconds": 0.0}), flush=True)
        return 0
    print(json.dumps(check(env, os.environ, args.dir, args.need_bytes)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
