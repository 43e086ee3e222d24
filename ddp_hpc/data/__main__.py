"""``python -m ddp_hpc.data pack|verify|make-images|stage ...`` (console script ``ddp-hpc-data``).

    python -m ddp_hpc.data make-images /shared/imgs --count 20000
    python -m ddp_hpc.data pack /shared/imgs /shared/imgs.lmdb
    python -m ddp_hpc.data verify /shared/imgs.lmdb
    python -m ddp_hpc.data stage /shared/imgs.lmdb --to tmpdir     # copy once per node, print the path
    python -m ddp_hpc.data sbcast /shared/imgs.lmdb --to tmpdir    # in a batch script: Slurm's sbcast
                                                                   # to every node; stage adopts it

Errors print one message with a HINT and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().rstrip("ib").rstrip("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r} is not a number of bytes like 64M or 2G") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ddp_hpc.data", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack", help="pack a folder of files (or class-per-folder images) into one LMDB")
    a.add_argument("src")
    a.add_argument("out")
    a.add_argument("--map-size", type=_size, default=64 << 20, help="initial map size; grows on demand (default 64M)")
    a.add_argument("--txn-size", type=_size, default=64 << 20, help="bytes per write transaction (default 64M)")
    a.add_argument("--no-check", action="store_true", help="do not decode images before packing")
    a.add_argument("--overwrite", action="store_true", help="replace an existing OUT (only after a complete pack)")
    v = sub.add_parser("verify", help="check every record of an LMDB made by pack")
    v.add_argument("path")
    m = sub.add_parser("make-images", help="write a demo class-per-folder dataset of small PNG files")
    m.add_argument("root")
    m.add_argument("--count", type=int, default=2000)
    m.add_argument("--classes", type=int, default=10)
    m.add_argument("--size", type=int, default=16)
    m.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("stage", help="copy a file, LMDB or folder to node-local storage (single process; "
                       "in a Slurm job keyed by its job id, so training ranks reuse it)")
    s.add_argument("src")
    s.add_argument("--to", default="auto", help="auto | slurm_tmpdir | tmpdir | shm | an absolute path")
    b = sub.add_parser("sbcast", help="in a batch script: sbcast a file or LMDB to every node of the job")
    b.add_argument("src")
    b.add_argument("--to", default="auto", help="auto | slurm_tmpdir | tmpdir | shm | an absolute path "
                   "(the same path on every node)")
    for q in (a, v, m, s, b):
        q.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from ddp_hpc.data import lmdb as L
    from ddp_hpc.data import stage as S

    try:
        if args.cmd == "pack":
            out = L.pack(args.src, args.out, map_size=args.map_size, txn_bytes=args.txn_size,
                         check_images=not args.no_check, overwrite=args.overwrite)
            text = f"packed {out['count']} files ({out['bytes']} bytes, {out['kind']}) into {out['path']}"
        elif args.cmd == "verify":
            out = L.verify(args.path)
            text = f"ok: {out['count']} records, {out['verified_bytes']} bytes, checksums match in {out['path']}"
        elif args.cmd == "make-images":
            from ddp_hpc.examples.images import make_images

            out = {"root": make_images(args.root, args.count, args.classes, args.size, args.seed)}
            text = f"images in {out['root']}"
        elif args.cmd == "sbcast":
            from ddp_hpc.data.sbcast import sbcast_stage

            out = sbcast_stage(args.src, S.resolve_stage_dir(args.to))
            text = (f"sbcast {out['bytes']} bytes to {out['data']} on every node in {out['seconds']:.1f} s; "
                    "data.io=stage (or `python -m ddp_hpc.data stage`) adopts it")
        else:
            from ddp_hpc.env import _slurm_job_key

            restart = os.environ.get("SLURM_RESTART_COUNT", "0")
            path = S.stage(args.src, S.resolve_stage_dir(args.to), job_id=_slurm_job_key(os.environ),
                           restart_count=int(restart) if restart.isdigit() else 0)
            out = {"path": path}
            text = f"staged at {path}"
    except (L.PackError, L.VerifyError, S.StageError, FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out) if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
