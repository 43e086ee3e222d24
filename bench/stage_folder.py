"""Stage a folder of small files for 1, 2 and 3 nodes of the test cluster: shared opens and time.

Run it where the test cluster is up (``SLURM_CONF`` set; the test cluster's nodes run on this
machine, so one inotify watch on the shared folder sees every open of every node)::

    .venv/bin/ddp-hpc testcluster run -- bash -c 'PATH=$PWD/.venv/bin:$PATH python bench/stage_folder.py \
        --shared /path/to/cluster/shared/stagebench --local /path/to/cluster/local --files 20000'

For each node count a batch job stages the folder the way ``submit --stage DIR`` does: on several
nodes ``ddp-hpc data sbcast`` first (one archive, read once, Slurm's sbcast to every node), then
every node's ``stage`` (adopts and unpacks it; on one node it copies), checks its copy against
the source (a hash of every file), gives it back (the last one out removes it) and checks it is
gone.  The shared folder's opens are counted by inotify (``IN_OPEN`` on every file below it, from
any process: tar, sbcast, the nodes) for the whole job.  In the same run a job times ``cp -r`` of
the folder to one node's local disk (best of 2), and, on several nodes, the other way to fan the
archive out: rank 0 writes it and a gloo broadcast over the job's network gives it to every node,
which writes it to its local disk (``archive + gloo broadcast``, against ``archive + sbcast``).
Staging time = the sbcast step + the slowest
node's ``stage`` (on one node: its ``stage``), without srun's start-up.  Prints a table and
writes ``--json``.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import shlex
import shutil
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IN_OPEN, IN_ISDIR, IN_Q_OVERFLOW = 0x20, 0x40000000, 0x4000


class OpenCounter:
    """Count opens of files below ``root`` (every process on this machine) with inotify."""

    def __init__(self, root: str):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        for d, _, _ in os.walk(root):
            if self.libc.inotify_add_watch(self.fd, d.encode(), IN_OPEN) < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {d}")
        self.opens, self.overflow, self._stop = 0, False, False
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while True:
            if not select.select([self.fd], [], [], 0.2)[0]:
                if self._stop:
                    return
                continue
            buf = os.read(self.fd, 1 << 20)
            off = 0
            while off < len(buf):
                _, mask, _, n = struct.unpack_from("iIII", buf, off)
                off += 16 + n
                if mask & IN_Q_OVERFLOW:
                    self.overflow = True
                elif mask & IN_OPEN and not mask & IN_ISDIR:
                    self.opens += 1

    def stop(self) -> int:
        time.sleep(0.5)   # let the last events arrive
        self._stop = True
        self.thread.join()
        os.close(self.fd)
        return self.opens


def tree_digest(root: str) -> tuple[int, int, str]:
    """(files, bytes, xxh3 of every file's relative name and bytes, in sorted order)."""
    import xxhash

    h, files, total = xxhash.xxh3_64(), 0, 0
    for d, dirs, names in os.walk(root):
        dirs.sort()
        for n in sorted(names):
            p = os.path.join(d, n)
            if os.path.isfile(p) and not os.path.islink(p):
                data = Path(p).read_bytes()
                h.update(os.path.relpath(p, root).encode() + b"\0" + data)
                files, total = files + 1, total + len(data)
    return files, total, h.hexdigest()


def node(src: str, local: str) -> None:
    """One node: stage ``src`` below ``local``, check, give it back; print one JSON line."""
    import socket

    from ddp_hpc.data.stage import StageRequest, cleanup_staged, stage_result
    from ddp_hpc.env import job_facts

    facts = job_facts()
    user = f"node@{socket.gethostname()}:{os.environ.get('SLURMD_NODENAME')}"
    res = stage_result(StageRequest(src, local, job_id=facts.key, user=user, progress=False))
    digest = tree_digest(res.path)
    outcome = cleanup_staged(res.path, user)[0]
    print(json.dumps({"node": os.environ.get("SLURMD_NODENAME"), "method": res.method, "seconds": res.seconds,
                      "files": res.files, "digest": digest, "cleanup": outcome,
                      "gone": not os.path.exists(os.path.dirname(res.path))}), flush=True)


def cp(src: str, local: str) -> None:
    """``cp -r`` of ``src`` to this node's local disk, best of 2; print one JSON line."""
    best = None
    for i in range(2):
        dst = os.path.join(local, f"cp-bench-{os.getpid()}-{i}")
        subprocess.run(["sync"], check=True)
        t0 = time.monotonic()
        subprocess.run(["cp", "-r", src, dst], check=True)
        t = time.monotonic() - t0
        shutil.rmtree(dst)
        best = t if best is None else min(best, t)
    print(json.dumps({"node": os.environ.get("SLURMD_NODENAME"), "seconds": best}), flush=True)


def bcast(src: str, local: str) -> None:
    """The other way to fan the archive out: global rank 0 writes it (as sbcast's step does) and
    a gloo broadcast over the job's network gives it to every rank, which writes it to its local
    disk; -> one JSON line per rank (archive, broadcast and write seconds)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from ddp_hpc.data.stagearchive import make_archive
    from ddp_hpc.dist import cleanup_ddp, setup_ddp

    ctx = setup_ddp(timeout=timedelta(seconds=120))
    rank = ctx.env.rank
    path = os.path.join(local, f"bcast-bench-{os.environ.get('SLURM_JOB_ID')}.tar")
    dist.barrier()
    t0 = time.monotonic()
    if rank == 0:
        make_archive(src, path)
        data = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8)
        size = torch.tensor([data.numel()])
    else:
        size = torch.tensor([0])
    t_archive = time.monotonic() - t0
    dist.broadcast(size, 0)
    if rank != 0:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, 0)
    t_bcast = time.monotonic() - t0 - t_archive
    if rank != 0:
        Path(path).write_bytes(data.numpy().tobytes())
    dist.barrier()
    total = time.monotonic() - t0
    os.remove(path)
    print(json.dumps({"rank": rank, "archive_s": t_archive, "bcast_s": t_bcast, "total_s": total,
                      "bytes": int(size.item())}), flush=True)
    cleanup_ddp()


def _sbatch(script: str, nodes: int, out: Path) -> None:
    path = out / f"job-{nodes}.sh"
    path.write_text(script)
    done = subprocess.run(["sbatch", "--parsable", "--wait", f"-N{nodes}", "--time=10",
                           f"--output={out / f'job-{nodes}.out'}", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"job on {nodes} node(s) failed: {done.stderr}\n{(out / f'job-{nodes}.out').read_text()[-3000:]}")


def _one(src: str, local: str, nodes: int, out: Path) -> dict:
    py, me = shlex.quote(sys.executable), shlex.quote(str(Path(__file__).resolve()))
    q = {k: shlex.quote(v) for k, v in {"src": src, "local": local, "out": str(out)}.items()}
    lines = ["#!/bin/bash", "set -euo pipefail", f"cd {shlex.quote(str(REPO))}"]
    if nodes > 1:
        lines.append(f"{py} -m ddp_hpc.data sbcast {q['src']} --to {q['local']} --json "
                     f"> {q['out']}/sbcast-{nodes}.json")
    lines.append(f"srun -N{nodes} --ntasks-per-node=1 --output={q['out']}/node-{nodes}-%t.json "
                 f"{py} {me} node {q['src']} {q['local']}")
    counter = OpenCounter(src)
    _sbatch("\n".join(lines) + "\n", nodes, out)
    opens = counter.stop()
    _sbatch(f"#!/bin/bash\nsrun -N1 --output={q['out']}/cp-{nodes}.json {py} {me} cp {q['src']} {q['local']}\n",
            1, out)
    fan = None
    if nodes > 1:   # the group broadcast instead of sbcast, timed the same way (not counted)
        _sbatch(f"#!/bin/bash\ncd {shlex.quote(str(REPO))}\nsrun -N{nodes} --ntasks-per-node=1 "
                f"--output={q['out']}/bcast-{nodes}-%t.json {py} {me} bcast {q['src']} {q['local']}\n", nodes, out)
        fan = max(json.loads((out / f"bcast-{nodes}-{t}.json").read_text().strip().splitlines()[-1])["total_s"]
                  for t in range(nodes))
    nodes_out = [json.loads((out / f"node-{nodes}-{t}.json").read_text().strip().splitlines()[-1])
                 for t in range(nodes)]
    sb = json.loads((out / f"sbcast-{nodes}.json").read_text()) if nodes > 1 else {"seconds": 0.0}
    stage_s = sb["seconds"] + max(n["seconds"] for n in nodes_out)
    cp_s = json.loads((out / f"cp-{nodes}.json").read_text().strip().splitlines()[-1])["seconds"]
    return {"nodes": nodes, "shared_opens": opens, "overflow": counter.overflow, "sbcast_s": sb["seconds"],
            "node_stage_s": [n["seconds"] for n in nodes_out], "stage_s": stage_s, "cp_s": cp_s,
            "stage_over_cp": stage_s / cp_s, "archive_bcast_s": fan, "methods": [n["method"] for n in nodes_out],
            "digests": [n["digest"] for n in nodes_out], "gone": [n["gone"] for n in nodes_out]}


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] in ("node", "cp", "bcast"):
        {"node": node, "cp": cp, "bcast": bcast}[sys.argv[1]](sys.argv[2], sys.argv[3])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shared", required=True, help="a folder on the cluster's shared filesystem")
    p.add_argument("--local", required=True, help="the nodes' local folder (the same path on every node)")
    p.add_argument("--files", type=int, default=20000)
    p.add_argument("--nodes", default="1,2,3")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from ddp_hpc.examples.images import make_images

    shared = Path(args.shared)
    src = shared / f"imgs-{args.files}"
    if not src.is_dir():
        make_images(src, count=args.files, classes=10, size=16, progress=False)
    want = tree_digest(str(src))
    out = shared / f"run-{time.time_ns()}"
    out.mkdir(parents=True)
    rows = [_one(str(src), args.local, int(n), out) for n in args.nodes.split(",")]
    result = {"files": want[0], "bytes": want[1], "source_digest": list(want), "rows": rows}
    print(f"{want[0]} files ({want[1] / 1e6:.1f} MB); shared opens counted by inotify for the whole staging job")
    print("| nodes | methods | shared opens | archive + sbcast s | archive + gloo broadcast s | slowest node s "
          "| staging s | cp -r s | staging / cp |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        fan = "-" if r["archive_bcast_s"] is None else f"{r['archive_bcast_s']:.2f}"
        print(f"| {r['nodes']} | {','.join(r['methods'])} | {r['shared_opens']} | {r['sbcast_s']:.2f} | {fan} | "
              f"{max(r['node_stage_s']):.2f} | {r['stage_s']:.2f} | {r['cp_s']:.2f} | {r['stage_over_cp']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
