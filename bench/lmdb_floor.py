"""The floor under ``LMDBDataset.raw_item``'s ratio to a bare py-lmdb loop: one Python call per read.

    .venv/bin/python bench/lmdb_floor.py PACKED.lmdb

Times, over the same 200,000 random indices, in interleaved rounds (best and median of 9):
``bare`` (bench/sharedfs.py's baseline: ``txn.get(b"%010d" % i)`` inline in the loop), ``floor`` (the
least a dataset method can be: a plain function ``return get(b"%010d" % i), labels[i]``, no
checks) and ``raw_item`` (ours).  ``floor`` / ``bare`` is what any per-read Python call costs on
this interpreter; ``raw_item`` / ``floor`` is what ours adds to it.
"""
from __future__ import annotations

import random
import sys
import time


def main(path: str, n: int = 200_000, reps: int = 9) -> None:
    from ddp_hpc.data.lmdb import LMDBDataset

    ds = LMDBDataset(path)
    ds.raw_item(0)
    rng = random.Random(0)
    idx = [rng.randrange(len(ds)) for _ in range(n)]
    txn = ds._env.begin()
    get, labels = txn.get, ds._labels

    def bare():
        for i in idx:
            get(b"%010d" % i)

    def floor_item(i):
        return get(b"%010d" % i), labels[i]

    def floor():
        f = floor_item
        for i in idx:
            f(i)

    def ours():
        f = ds.raw_item
        for i in idx:
            f(i)

    cases = {"bare": bare, "floor": floor, "raw_item": ours}
    times = {k: [] for k in cases}
    for rep in range(reps):
        for k in list(cases)[rep % 3:] + list(cases)[:rep % 3]:
            t = time.perf_counter()
            cases[k]()
            times[k].append(time.perf_counter() - t)
    best = {k: min(v) for k, v in times.items()}
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    for k in cases:
        print(f"{k}: {n / best[k] / 1e6:.2f} M reads/s; bare / {k}: best {best['bare'] / best[k]:.2f}, "
              f"median {med['bare'] / med[k]:.2f}")
    print(f"raw_item / floor: best {best['floor'] / best['raw_item']:.2f}, median {med['floor'] / med['raw_item']:.2f}")


if __name__ == "__main__":
    main(sys.argv[1])
