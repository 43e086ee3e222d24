"""ddp_hpc's IO cures against the loaders users pick instead: WebDataset, LitData, MosaicML Streaming.

    bash bench/setup.sh                                  # .venv-bench: the project + the peers
    .venv-bench/bin/python bench/peers.py                # 20,000 PNGs, 2 pretend nodes x 2 ranks
    .venv-bench/bin/python bench/peers.py --quick        # 400 PNGs, a smoke run (< 1 minute)

The data is bench/sharedfs.py's: the class-per-folder PNGs of ``ddp-hpc data make-images``, read and
decoded with ``decode_image`` in the rank processes of ``launch_distributed(nodes=N)``.  Each peer
packs them with its own packer (peers_pack.py) and reads them with its own loader, set up as its
documentation recommends for a shared POSIX directory (peers_loaders.py); ddp_hpc's ``lmdb`` and
``stage+lmdb`` run in the same run through the same calls as in bench/sharedfs.py.  Per technique:

* shared-directory opens and bytes of one epoch, all ranks, *counted*: by ``ddp_hpc.data.fsio``
  for ddp_hpc's readers (as bench/sharedfs.py), by an audit hook and a counting ``open`` wrapper in the
  rank process for the peers (peers_fs.py explains the method); the hook also counts ddp_hpc's
  Python-level opens, as a cross-check;
* samples/s per rank for the first epoch of a fresh job (open/stage + epoch, caches empty),
  warm, cold and on the SIMULATED metadata-bound filesystem, best of ``--rounds`` interleaved
  rounds, and the ratio to ddp_hpc's best cure of the same scenario in the same run;
* exact coverage, checked: the samples of all ranks together (known by the hash of the decoded
  tensor and label) are every sample once, duplicates only as DistributedSampler pads, and every
  rank gets the same count;
* mid-epoch resume, checked: stop after k batches, checkpoint the loader's state, resume with a
  fresh loader; the resumed part must be exactly the samples the first part had not yet given.

Writes ``bench/peers.json`` (``--out``).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

from peers_check import coverage, resume_check  # noqa: E402
from peers_loaders import OURS, TECHNIQUES, io_bench  # noqa: E402
from peers_report import markdown, summarise  # noqa: E402

PACKAGES = ("torch", "lmdb", "webdataset", "litdata", "mosaicml-streaming", "pillow", "numpy")


def prepare(work: str, files: int, world: int) -> tuple[str, str]:
    """The PNG folder and every technique's packed copy of it (each made once, then reused)."""
    import peers_pack

    from ddp_hpc.data.pack import pack
    from ddp_hpc.examples.images import make_images

    shared = os.path.join(work, f"shared-{files}")
    os.makedirs(shared, exist_ok=True)
    t = time.perf_counter()
    imgs = make_images(os.path.join(shared, "imgs"), count=files, classes=10, size=16, progress=False)
    print(f"dataset: {files} files in {imgs} ({time.perf_counter() - t:.1f} s)", flush=True)
    steps = [("ddp_hpc lmdb", lambda: os.path.exists(os.path.join(shared, "imgs.lmdb"))
              or pack(imgs, os.path.join(shared, "imgs.lmdb"), progress=False)),
             ("webdataset tar shards", lambda: peers_pack.pack_wds(imgs, os.path.join(shared, "wds"), world)),
             ("litdata optimize", lambda: peers_pack.pack_litdata(imgs, os.path.join(shared, "litdata"))),
             ("streaming MDSWriter", lambda: peers_pack.pack_mds(imgs, os.path.join(shared, "mds")))]
    for name, step in steps:
        t = time.perf_counter()
        step()
        print(f"packed: {name} ({time.perf_counter() - t:.1f} s)", flush=True)
    return shared, imgs


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=20000, help="images in the dataset (default: 20000)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 400 files, batch 16 (unless --files / --batch are given)")
    p.add_argument("--nodes", type=int, default=2, help="pretend nodes (default: 2)")
    p.add_argument("--procs-per-node", type=int, default=2, help="ranks per pretend node (default: 2)")
    p.add_argument("--batch", type=int, default=io_bench().BATCH, help="batch size (default: bench/sharedfs.py's)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every cell, best kept (default: 3)")
    p.add_argument("--delay-ms", type=float, default=1.0, help="simulated metadata cost per shared open")
    p.add_argument("--no-drop-caches", action="store_true", help="skip the cold-cache cells")
    p.add_argument("--workdir", default="/tmp/ddp_hpc_peers_bench", help="where shared and node-local folders go")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "peers.json"), help="the JSON written")
    args = p.parse_args(argv)
    given = " ".join(sys.argv[1:] if argv is None else argv)
    if args.quick and "--files" not in given:
        args.files = 400
    if args.quick and "--rounds" not in given:
        args.rounds = 1
    if args.quick and "--batch" not in given:
        args.batch = 16  # several batches per rank, so the resume test stops mid-epoch
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    import peers_pack
    from peers_rank import SHM_ROOT, run_rank

    from ddp_hpc.launch import launch_distributed

    t_all = time.perf_counter()
    world = args.nodes * args.procs_per_node
    work = os.path.abspath(args.workdir)
    shared, imgs = prepare(work, args.files, world)
    expected = peers_pack.expected_hashes(imgs)
    if len(expected) != args.files:
        raise SystemExit(f"{args.files - len(expected)} images decode to the same tensor; use another --files")
    io = io_bench()
    cold = io.can_drop_caches() and not args.no_drop_caches
    a = {"work": work, "shared": shared, "delay_s": args.delay_ms / 1e3, "cold": cold, "files": args.files,
         "nodes": args.nodes, "ppn": args.procs_per_node, "batch": args.batch, "rounds": args.rounds,
         "techniques": list(TECHNIQUES)}
    t = time.perf_counter()
    shutil.rmtree(SHM_ROOT, ignore_errors=True)  # each pretend node's /dev/shm (peers_rank._node_shm)
    for node in range(args.nodes):
        os.makedirs(os.path.join(SHM_ROOT, f"node{node}"))
    try:
        per_rank = launch_distributed(run_rank, world, args=(a,), nodes=args.nodes, timeout=1800)
    finally:
        shutil.rmtree(SHM_ROOT, ignore_errors=True)
    print(f"distributed part: {time.perf_counter() - t:.1f} s", flush=True)
    rows = summarise(per_rank, a)
    checks = {label: {"coverage": coverage(per_rank, label, expected, world),
                      "resume": resume_check(per_rank, label)} for label in TECHNIQUES}
    vers = versions()
    table = markdown(rows, checks, a, vers, cold)
    print()
    print(table)
    for r in per_rank:  # the sample hashes stay out of the JSON (they are only for the checks)
        for cell in r["cells"]:
            cell.pop("hashes")
        for res in r["resume"].values():
            res["first"], res["rest"] = len(res.pop("first")), len(res.pop("rest"))
    result = {"command": " ".join([os.path.relpath(sys.executable, ROOT), "bench/peers.py"] + (argv or sys.argv[1:])),
              "config": a, "versions": vers, "ours": list(OURS), "rows": rows, "checks": checks,
              "per_rank": per_rank, "table_markdown": table}
    with open(args.out + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(args.out + ".tmp", args.out)
    print(f"\nwrote {args.out}; total {time.perf_counter() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
