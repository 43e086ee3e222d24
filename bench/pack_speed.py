"""Pack speed: ``ddp-hpc data pack`` with 1 and N workers against LitData's ``optimize`` with N.

    PYTHONPATH=<litdata installed there> .venv/bin/python bench/pack_speed.py --files 20000 --rounds 3

The same PNG folder (``ddp-hpc data make-images``, bench/sharedfs.py's size) is packed, in interleaved
rounds, by: ``pack --workers 1``, ``pack --workers N`` (N: the CPUs of the allocation by default,
as ``pack`` picks them), the same with ``--no-check`` (no image decode; LitData's ``optimize``
decodes nothing either), and ``litdata.optimize`` with ``num_workers=N`` and bench/peers_pack.py's
item function (the PNG's bytes + its label, ``chunk_bytes="64MB"``).  Samples/s is files over
wall time, best of the rounds (the output is removed after each round, and ``sync`` runs before
each timing).  Each ddp_hpc output is checked by ``ddp-hpc data verify``'s ``verify`` and the N
worker LMDB is compared byte for byte with the 1 worker one.  Writes ``--json``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _ddp(src: str, out: str, workers: int, check: bool) -> None:
    from ddp_hpc.data.pack import pack

    pack(src, out, progress=False, workers=workers, check_images=check)


def _litdata(src: str, out: str, workers: int) -> None:
    import litdata
    from peers_pack import _samples, litdata_item

    litdata.optimize(fn=litdata_item, inputs=_samples(src), output_dir=out, chunk_bytes="64MB",
                     num_workers=workers, mode="overwrite", start_method="fork", verbose=False)


def main(argv=None) -> int:
    from ddp_hpc.data.lmdb import verify
    from ddp_hpc.data.packsources import allocation_cpus
    from ddp_hpc.examples.images import make_images

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--files", type=int, default=20000)
    p.add_argument("--workers", type=int, default=None, help="N (default: the CPUs of the allocation)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--data", default=None, help="folder for the images and outputs (default: a temp folder)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    n = args.workers or allocation_cpus()
    base = Path(args.data or tempfile.mkdtemp(prefix="pack-bench-"))
    src = base / f"imgs-{args.files}"
    if not src.is_dir():
        make_images(src, count=args.files, classes=10, size=16, progress=False)
    cells = {"ddp_hpc pack, 1 worker": lambda o: _ddp(str(src), o, 1, True),
             f"ddp_hpc pack, {n} workers": lambda o: _ddp(str(src), o, n, True),
             f"ddp_hpc pack --no-check, {n} workers": lambda o: _ddp(str(src), o, n, False),
             f"litdata optimize, {n} workers": lambda o: _litdata(str(src), o, n)}
    times: dict[str, list[float]] = {k: [] for k in cells}
    same = verified = first = None
    for r in range(args.rounds):
        for name, run in cells.items():
            out = base / "out"
            subprocess.run(["sync"], check=True)
            t0 = time.perf_counter()
            run(str(out))
            times[name].append(time.perf_counter() - t0)
            if name.startswith("ddp_hpc") and r == 0:   # the outputs: checked once
                verified = verify(out)["count"] == args.files and verified is not False
                if "1 worker" in name:
                    first = (out / "data.mdb").read_bytes()
                elif "--no-check" not in name:
                    same = (out / "data.mdb").read_bytes() == first
            shutil.rmtree(out)
    best = {k: min(v) for k, v in times.items()}
    lit = best[f"litdata optimize, {n} workers"]
    rows = [{"technique": k, "best_s": best[k], "samples_per_s": args.files / best[k],
             "vs_litdata": lit / best[k], "rounds_s": times[k]} for k in cells]
    print(f"{args.files} PNG files, N = {n} workers, best of {args.rounds} interleaved rounds; "
          f"load average before: {os.getloadavg()[0]:.1f}")
    print("| technique | best s | samples/s | vs litdata optimize |")
    print("|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['technique']} | {row['best_s']:.2f} | {row['samples_per_s']:.0f} | {row['vs_litdata']:.2f} |")
    one = best["ddp_hpc pack, 1 worker"]
    print(f"{n} workers / 1 worker: {one / best[f'ddp_hpc pack, {n} workers']:.2f}x; outputs verified: "
          f"{verified}; {n}-worker LMDB byte-identical to the 1-worker one: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps({"files": args.files, "workers": n, "rows": rows,
                                               "verified": verified, "byte_identical": same}, indent=1))
    if not args.data:
        shutil.rmtree(base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
