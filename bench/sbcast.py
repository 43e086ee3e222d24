"""Node-local staging: every node reading the shared file (``stage``) vs Slurm's ``sbcast``.

Run it INSIDE an allocation of N nodes (it uses srun and sbcast)::

    sbatch -N2 --wrap '.venv/bin/python bench/sbcast.py --to /local/scratch --mib 512'
    python -m ddp_hpc.testcluster run --nodes 2 -- sbatch -W -N2 --wrap '...'  # the local test cluster

Per repetition, into fresh folders below ``--to`` (which must be the same node-local path on
every node):

* ``copy``:   ``srun --ntasks-per-node=1 python -m ddp_hpc.data stage SRC`` (each node reads the
  shared file once: nodes x 1 reads);
* ``sbcast``: ``python -m ddp_hpc.data sbcast SRC`` on the batch node (one shared read, hashed,
  then Slurm fans it out), then the same srun ``stage``, which verifies and adopts the copies.

Both include the srun and interpreter start-up they need; the page cache is dropped before each
run when root (``--cold``, the default when possible) so the shared read is a real read.
Prints seconds per method, the ratio copy/sbcast (> 1: sbcast is faster), and checks that every
node's marker names the expected method.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ddp_hpc.env import job_facts  # noqa: E402  (this checkout, also when not installed)


def _srun_each(argv: list[str], nodes: int) -> list[str]:
    out = subprocess.run(["srun", f"-N{nodes}", "--ntasks-per-node=1", *argv], check=True,
                         capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.strip()]


def _drop_caches(nodes: int) -> None:
    # one machine or many: drop on every node of the allocation (root only)
    _srun_each(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], nodes)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--to", required=True, help="node-local folder, the same path on every node")
    p.add_argument("--src", help="file to stage (default: make --mib of random bytes in --shared)")
    p.add_argument("--shared", default=os.getcwd(), help="shared folder for the generated file")
    p.add_argument("--mib", type=int, default=256, help="size of the generated file in MiB (default: 256)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of each method; the best counts (default: 3)")
    p.add_argument("--warm", action="store_true", help="do not drop the page cache between runs")
    p.add_argument("--json", help="also write the result here")
    a = p.parse_args(argv)
    facts = job_facts()
    if not facts.job_id:
        print("error: run inside an allocation (sbatch/salloc); SLURM_JOB_ID is not set", file=sys.stderr)
        return 2
    nodes = facts.num_nodes
    src = a.src or os.path.join(os.path.abspath(a.shared), f"sbcast-bench-{a.mib}m.bin")
    if not a.src and (not os.path.exists(src) or os.path.getsize(src) != a.mib << 20):
        with open(src + ".tmp", "wb") as f:
            for _ in range(a.mib):
                f.write(os.urandom(1 << 20))
        os.replace(src + ".tmp", src)
    cold = not a.warm and os.geteuid() == 0
    py = [sys.executable, "-m", "ddp_hpc.data"]
    os.chdir(ROOT)  # so `-m ddp_hpc.data` imports this checkout on every node
    times: dict[str, list[float]] = {"copy": [], "sbcast": []}
    for rep in range(a.reps):
        for method in ("copy", "sbcast"):
            dest = os.path.join(a.to, f"bench-{facts.job_id}-{method}{rep}")
            _srun_each(["mkdir", "-p", dest], nodes)
            if cold:
                _drop_caches(nodes)
            t = time.perf_counter()
            if method == "sbcast":
                subprocess.run([*py, "sbcast", src, "--to", dest, "--json"], check=True, capture_output=True)
            lines = _srun_each([*py, "stage", src, "--to", dest, "--json"], nodes)
            times[method].append(time.perf_counter() - t)
            staged = [json.loads(x)["path"] for x in lines]
            markers = _srun_each(["sh", "-c", f"cat {os.path.dirname(staged[0])}/COMPLETE.json"], nodes)
            got = sorted(json.loads(m)["method"] for m in markers)
            if got != [method] * nodes:
                print(f"error: {method} run {rep}: node markers say {got}", file=sys.stderr)
                return 1
            _srun_each(["rm", "-rf", dest], nodes)
    best = {k: min(v) for k, v in times.items()}
    res = {"nodes": nodes, "bytes": a.mib << 20 if not a.src else os.path.getsize(src), "cold": cold,
           "seconds": times, "best": best, "copy_over_sbcast": best["copy"] / best["sbcast"]}
    print(f"{nodes} nodes, {res['bytes'] >> 20} MiB, {'cold' if cold else 'warm'} cache, best of {a.reps}: "
          f"copy (every node reads the shared file) {best['copy']:.2f} s, sbcast + adopt {best['sbcast']:.2f} s; "
          f"copy/sbcast = {res['copy_over_sbcast']:.2f} ({'sbcast' if res['copy_over_sbcast'] > 1 else 'copy'} "
          "is faster here)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
