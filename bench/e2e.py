"""End-to-end figure: the images job TRAINED under each ``data.io``, not just its reads.

    .venv/bin/python bench/e2e.py            # default size, a few minutes on 2 cores
    .venv/bin/python bench/e2e.py --quick    # smoke run, under a minute

What it runs: ``jobs/images.yaml`` (the tiny CNN, adam) through the training core's own entry,
``ddp_hpc.train.api.run_job`` (what ``ddp-hpc run`` calls), for a fixed number of epochs, on the
local backend with 2 pretend nodes x 2 ranks (``launch_distributed(nodes=2)``, gloo on CPU),
under each ``data.io``: direct (every rank opens its PNG files), lmdb (one packed file per rank),
stage (each node leader copies the LMDB to its node's TMPDIR; every pretend node has its own
TMPDIR, as a real node has its own disk) and broadcast (one reader per node reads the PNG files
and sends each rank its samples).  Evaluation is off (it would read the shared folder directly
whatever ``data.io`` is); the end-of-training checkpoint is kept.

Scenarios: ``warm`` (the shared files in the page cache) and ``simfs``, a SIMULATED
metadata-bound shared filesystem: ``ddp_hpc.data.fsio`` sleeps a fixed time (1 ms by default) on
every open below the shared folder, as bench/sharedfs.py does; a Lustre/GPFS open costs a metadata
round trip.  Opens below the shared folder are counted by the same instrumented open, in every
rank, staging and broadcast readers included.

Reported per technique and scenario: training samples/s per rank (the training core's own epoch
figure: the samples of all ranks over the mean rank's loop time, divided by the ranks; the
first epoch is left out when there are more than one), its ratio to direct in the same scenario
of the same run, the whole run_job wall time (open or stage + train + teardown), and the counted
shared opens.  Writes ``bench/e2e.json`` and a bar chart ``bench/e2e.png`` (pillow).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TECHNIQUES = ("direct", "lmdb", "stage", "broadcast")
FORMULAS = {"direct": "ranks x files/rank x epochs = files x epochs", "lmdb": "ranks x 1",
            "stage": "nodes x 1", "broadcast": "groups x files/group x epochs = files x epochs"}


def _overrides(a: dict, io: str, scen: str) -> list[str]:
    shared = a["shared"]
    lmdb = os.path.join(shared, "imgs.lmdb") if io in ("lmdb", "stage") else None
    return [f"data.io={io}", f"data.kwargs.root={os.path.join(shared, 'imgs')}", "data.eval_dataset=null",
            f"data.lmdb_path={lmdb if lmdb else 'null'}", "data.stage_to=tmpdir", "data.stage_cleanup=true",
            f"train.epochs={a['epochs']}", f"train.batch_size={a['batch']}", "train.eval_every_epochs=0",
            "checkpoint.resume=false", "checkpoint.every_epochs=0", "log.progress=off",
            f"log.dir={os.path.join(a['work'], 'runs', f'{scen}-{io}')}"]


def _epoch_rates(log_root: str, rank: int) -> list[float]:
    """The training core's epoch samples/s (all ranks) from this rank's events."""
    from ddp_hpc.judge.nodefiles import rank_events
    [run] = {os.path.dirname(p) for p in glob.glob(os.path.join(log_root, "*", "*.events.jsonl"))}
    return [e["samples_per_s"] for e in rank_events(run, rank).events if e.get("event") == "epoch"]


def _one_cell(a: dict, io: str, scen: str, delay: float, rank: int, world: int) -> dict:
    import torch.distributed as dist

    from ddp_hpc.config import load_config
    from ddp_hpc.data import fsio
    from ddp_hpc.data import lmdb as L
    from ddp_hpc.train.api import run_job

    cfg = load_config(os.path.join(ROOT, "jobs", "images.yaml"), _overrides(a, io, scen))
    L.close_all()
    dist.barrier()
    if scen == "warm" and rank == 0:  # one untimed read of everything fills the page cache
        for dirpath, _, names in os.walk(a["shared"]):
            for n in names:
                with open(os.path.join(dirpath, n), "rb") as f:
                    f.read()
    dist.barrier()
    fsio.watch(a["shared"], delay)
    t0 = time.perf_counter()
    result = run_job(cfg)
    run_s = time.perf_counter() - t0
    counts = fsio.snapshot()
    fsio.unwatch()
    rates = _epoch_rates(cfg.log.dir, rank)
    timed = rates[1:] if len(rates) > 1 else rates  # the first epoch carries one-time start-up
    return {"scenario": scen, "technique": io, "status": result.status, "steps": result.step,
            "samples_per_s_rank": sum(timed) / len(timed) / world, "epoch_rates_all_ranks": rates,
            "run_s": run_s, **counts}


def _rank(rank, world_size, a):
    import torch

    from ddp_hpc.dist import cleanup_ddp, setup_ddp

    torch.set_num_threads(1)
    ctx = setup_ddp()  # run_job finds the group and trains in it
    os.environ["TMPDIR"] = os.path.join(a["work"], "local", f"node{ctx.env.node_rank}")  # the node's disk
    os.makedirs(os.environ["TMPDIR"], exist_ok=True)
    warm_a = dict(a, epochs=1)
    _one_cell(warm_a, "direct", "warmup", 0.0, rank, world_size)  # imports, kernels: out of the cells
    out = {"rank": rank, "node": ctx.env.node_rank, "runs": []}
    for scen, delay in (("warm", 0.0), ("simfs", a["delay_s"])):
        for io in TECHNIQUES:
            out["runs"].append(_one_cell(a, io, scen, delay, rank, world_size))
    cleanup_ddp()
    return out


def summarise(per_rank: list, a: dict) -> list[dict]:
    rows = []
    for scen in ("warm", "simfs"):
        base = None
        for io in TECHNIQUES:
            runs = [next(x for x in r["runs"] if (x["scenario"], x["technique"]) == (scen, io)) for r in per_rank]
            sps = sum(x["samples_per_s_rank"] for x in runs) / len(runs)
            base = sps if io == "direct" else base
            rows.append({"scenario": scen, "technique": io, "samples_per_s_rank": sps, "vs_direct": sps / base,
                         "run_s": max(x["run_s"] for x in runs), "opens": sum(x["opens"] for x in runs),
                         "shared_mb": sum(x["bytes"] for x in runs) / 1e6,
                         "ranks_opening_shared": sum(1 for x in runs if x["opens"]), "formula": FORMULAS[io],
                         "statuses": sorted({x["status"] for x in runs})})
    return rows


def markdown(rows: list[dict], a: dict) -> str:
    out = [f"{a['files']} PNG files ({a['bytes'] / 1e6:.1f} MB), {a['nodes']} pretend nodes x {a['ppn']} ranks, "
           f"jobs/images.yaml (tiny CNN), batch {a['batch']} per rank, {a['epochs']} epoch(s) "
           f"({a['steps_per_epoch']} steps each); `simfs` = SIMULATED metadata-bound shared FS, "
           f"+{a['delay_s'] * 1e3:g} ms per open of a shared file", "",
           "| scenario | data.io | training samples/s per rank | vs direct (same run) | run_job s | "
           "shared opens (counted) | formula | shared MB read | ranks opening shared files |",
           "|---|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        out.append(f"| {r['scenario']} | {r['technique']} | {r['samples_per_s_rank']:.0f} | {r['vs_direct']:.2f} | "
                   f"{r['run_s']:.1f} | {r['opens']} | {r['formula']} | {r['shared_mb']:.1f} | "
                   f"{r['ranks_opening_shared']} |")
    return "\n".join(out)


def plot(rows: list[dict], path: str) -> None:
    """Bars: training samples/s per rank relative to direct, per data.io, warm and simfs."""
    from PIL import Image, ImageDraw

    colors = {"warm": (70, 130, 180), "simfs": (214, 96, 77)}
    W, H, left, top, ph = 900, 460, 70, 50, 320
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    d.text((left, 8), "training samples/s per rank relative to data.io=direct (1.0), same run; "
                      "label: counted shared opens", fill="black")
    vmax = max(1.0, max(r["vs_direct"] for r in rows)) * 1.15
    y0 = top + ph
    d.line((left, y0, W - 20, y0), fill="black")
    y1 = y0 - ph / vmax
    d.line((left, y1, W - 20, y1), fill=(0, 150, 0))
    d.text((8, y1 - 6), "1.0", fill=(0, 150, 0))
    gw = (W - left - 40) / len(TECHNIQUES)
    bw = gw * 0.8 / 2
    for ti, io in enumerate(TECHNIQUES):
        for si, scen in enumerate(("warm", "simfs")):
            r = next(r for r in rows if (r["technique"], r["scenario"]) == (io, scen))
            x = left + ti * gw + si * bw + gw * 0.1
            y = y0 - ph * r["vs_direct"] / vmax
            d.rectangle((x, y, x + bw - 2, y0), fill=colors[scen])
            d.text((x, y - 26), f"{r['vs_direct']:.2f}x", fill="black")
            d.text((x, y - 13), f"{r['opens']} op", fill=(90, 90, 90))
        d.text((left + ti * gw + gw * 0.35, y0 + 8), io, fill="black")
    for si, scen in enumerate(("warm", "simfs")):
        d.rectangle((left, H - 50 + 16 * si, left + 12, H - 38 + 16 * si), fill=colors[scen])
        d.text((left + 18, H - 50 + 16 * si), scen + (" (SIMULATED metadata-bound shared FS)" if scen == "simfs"
                                                        else " (page cache warm)"), fill="black")
    img.save(path)


def _prepare(work: str, files: int) -> tuple[str, int]:
    from ddp_hpc.data.pack import pack
    from ddp_hpc.examples.images import make_images

    shared = os.path.join(work, f"shared-{files}")  # one per size: a dataset is never remade in place
    os.makedirs(shared, exist_ok=True)
    t = time.perf_counter()
    imgs = make_images(os.path.join(shared, "imgs"), count=files, classes=10, size=16, progress=False)
    lmdb_path = os.path.join(shared, "imgs.lmdb")
    if not os.path.exists(os.path.join(lmdb_path, "data.mdb")):
        pack(imgs, lmdb_path, progress=False)
    print(f"dataset: {files} files in {imgs}, packed in {lmdb_path} ({time.perf_counter() - t:.1f} s)", flush=True)
    nbytes = sum(e.stat().st_size for d in os.scandir(imgs) if d.is_dir() for e in os.scandir(d.path))
    return shared, nbytes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=4096, help="PNG files in the dataset (default: 4096)")
    p.add_argument("--epochs", type=int, default=3, help="training epochs per cell (default: 3)")
    p.add_argument("--batch", type=int, default=32, help="batch size per rank (default: 32, as the job)")
    p.add_argument("--delay-ms", type=float, default=1.0, help="simulated cost per shared open (default: 1)")
    p.add_argument("--quick", action="store_true", help="smoke run: 512 files, 1 epoch")
    p.add_argument("--workdir", default="/tmp/ddp_hpc_e2e_bench", help="shared and node-local folders")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "e2e"), help="writes OUT.json and OUT.png")
    args = p.parse_args(argv)
    if args.quick:
        args.files, args.epochs = 512, 1
    from ddp_hpc.launch import launch_distributed

    t_all = time.perf_counter()
    work = os.path.abspath(args.workdir)
    shutil.rmtree(os.path.join(work, "runs"), ignore_errors=True)
    shutil.rmtree(os.path.join(work, "local"), ignore_errors=True)
    shared, nbytes = _prepare(work, args.files)
    nodes, ppn = 2, 2
    a = {"work": work, "shared": shared, "delay_s": args.delay_ms / 1e3, "files": args.files, "bytes": nbytes,
         "epochs": args.epochs, "batch": args.batch, "nodes": nodes, "ppn": ppn,
         "steps_per_epoch": -(-args.files // (args.batch * nodes * ppn))}
    per_rank = launch_distributed(_rank, nodes * ppn, args=(a,), nodes=nodes, timeout=1800)
    rows = summarise(per_rank, a)
    table = markdown(rows, a)
    print()
    print(table)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    plot(rows, args.out + ".png")
    cmd = "python bench/e2e.py " + " ".join(argv if argv is not None else sys.argv[1:])
    with open(args.out + ".json.tmp", "w") as f:
        json.dump({"command": cmd.strip(), "config": a, "rows": rows, "per_rank": per_rank,
                   "table_markdown": table}, f, indent=1)
    os.replace(args.out + ".json.tmp", args.out + ".json")
    print(f"\nwrote {args.out}.json and {args.out}.png; total {time.perf_counter() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
