"""Shared-filesystem IO benchmark: direct reads vs LMDB vs node-local staging vs group broadcast.

    .venv/bin/python bench/sharedfs.py                      # ~2-4 minutes on 2 cores
    .venv/bin/python bench/sharedfs.py --files 20000 --nodes 2 --procs-per-node 2 --delay-ms 1

One run, everything measured in it, ratios printed against baselines measured in the same run:

1. opens and bytes on the shared directory per epoch, *counted* by the readers' instrumented open
   (``ddp_hpc.data.fsio``), beside the formula of each technique;
2. samples/s per rank relative to direct reads: warm cache, cold cache (``/proc/sys/vm/drop_caches``
   when root; otherwise reported as skipped) and a SIMULATED metadata-bound shared filesystem (a
   fixed sleep per open of a shared file, what Lustre/GPFS metadata round trips cost);
3. staging throughput relative to ``cp`` of the same bytes (target >= 0.9);
4. broadcast delivery relative to a bare gloo broadcast of the same bytes, one per step (target
   >= 0.8), and in the same buckets (the framing overhead alone, target >= 0.6), and the least
   any loader does (``floor``); ``bench/framing.py`` makes this measurement alone and profiles it;
5. LMDB random reads relative to a bare py-lmdb ``txn.get`` loop (target >= 0.9), and the packed
   file's size relative to its payload (target <= 1.3).

"Nodes" are simulated with processes (``launch_distributed(nodes=N)``); each pretend node stages
to its own folder (its ``TMPDIR``), as it would to its own local disk.  Writes ``bench/sharedfs.json``
and a bar chart ``bench/sharedfs.png`` (pillow).

``--peers`` then runs ``bench/peers.py`` on the same data: WebDataset, LitData and MosaicML
Streaming with their own packers and loaders, against ddp_hpc's lmdb and stage measured again in
that run (their pinned versions live in ``.venv-bench``: ``bash bench/setup.sh``).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BATCH = 64
TECHNIQUES = [  # (label, DataConfig overrides, formula)
    ("direct", {"io": "direct"}, "ranks x files/rank = files"),
    ("lmdb", {"io": "lmdb"}, "ranks x 1"),
    ("stage+lmdb", {"io": "stage", "stage_to": "tmpdir"}, "nodes x 1"),
    ("broadcast node", {"io": "broadcast", "broadcast_groups": "node"}, "groups x files/group = files"),
    ("broadcast node 4thr", {"io": "broadcast", "broadcast_groups": "node", "num_workers": 4},
     "groups x files/group = files"),
    ("broadcast 2-level 4thr", {"io": "broadcast", "broadcast_groups": "two_level", "num_workers": 4},
     "1 group x files = files"),
]


def can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


# ----------------------------------------------------------------------------- per rank
def _rank(rank, world_size, a):
    import torch
    import torch.distributed as dist
    from framing import delivery  # bench/framing.py: the same measurement, alone and profiled there

    from ddp_hpc.config import DataConfig
    from ddp_hpc.data import fsio
    from ddp_hpc.data import lmdb as L
    from ddp_hpc.data.images import ImageFolderDataset
    from ddp_hpc.data.io import close_train_data, make_train_batches, open_train_data
    from ddp_hpc.dist import cleanup_ddp, setup_ddp

    torch.set_num_threads(1)
    ctx = setup_ddp()
    os.environ["TMPDIR"] = os.path.join(a["work"], "local", f"node{ctx.env.node_rank}")
    os.makedirs(os.environ["TMPDIR"], exist_ok=True)
    shared, imgs = a["shared"], os.path.join(a["shared"], "imgs")
    factory = lambda: ImageFolderDataset(imgs)  # noqa: E731
    out = {"rank": rank, "node": ctx.env.node_rank, "runs": []}
    warm = factory()  # one-time costs (PIL plugin import, DataLoader) stay out of the first cell
    list(make_train_batches(warm, DataConfig(), ctx, batch_size=4, seed=0, epoch=0))
    scenarios = [("warm", 0.0)] + ([("cold", 0.0)] if a["cold"] else []) + [("simfs", a["delay_s"])]
    for scen, delay in scenarios:
        for label, over, _ in TECHNIQUES:
            lmdb_path = os.path.join(shared, "imgs.lmdb") if over["io"] in ("lmdb", "stage") else None
            cfg = DataConfig(lmdb_path=lmdb_path, stage_cleanup=True, **over)
            L.close_all()
            dist.barrier()
            if scen == "cold" and rank == 0:
                drop_caches()
            if scen == "warm" and rank == 0:  # warm: one untimed pass fills the page cache
                for rel, _ in factory().samples:
                    open(os.path.join(imgs, rel), "rb").read()
                open(os.path.join(shared, "imgs.lmdb", "data.mdb"), "rb").read()
            dist.barrier()
            fsio.watch(shared, delay)
            fsio.reset()
            t0 = time.perf_counter()
            ds = open_train_data(cfg, ctx, factory)
            t1 = time.perf_counter()
            n = 0
            for x, _ in make_train_batches(ds, cfg, ctx, batch_size=BATCH, seed=0, epoch=0,
                                           num_workers=cfg.num_workers):
                n += len(x)
            t2 = time.perf_counter()
            counts = fsio.snapshot()
            fsio.unwatch()
            close_train_data(ds, cfg, ctx, completed=True)
            out["runs"].append({"scenario": scen, "technique": label, "samples": n, "open_s": t1 - t0,
                                "epoch_s": t2 - t1, **counts})
    out["delivery"] = delivery(ctx, imgs, a["steps"])[0]
    cleanup_ddp()
    return out


# ----------------------------------------------------------------------------- single process
def bench_stage_vs_cp(work: str, mib: int, cold: bool) -> dict:
    from ddp_hpc.data.stage import stage

    src_dir = os.path.join(work, "shared")
    src = os.path.join(src_dir, f"stage-{mib}m.bin")
    if not os.path.exists(src) or os.path.getsize(src) != mib << 20:
        with open(src + ".tmp", "wb") as f:
            for _ in range(mib):
                f.write(os.urandom(1 << 20))
        os.replace(src + ".tmp", src)
    dst = os.path.join(work, "local", "stagebench")
    shutil.rmtree(dst, ignore_errors=True)
    os.makedirs(dst)
    res = {}
    for mode in (["warm", "cold"] if cold else ["warm"]):
        cps, sts = [], []
        for rep in range(9 if mode == "warm" else 3):  # interleaved, so drift hits both alike
            for which in ("cp", "stage"):
                if mode == "cold":
                    drop_caches()
                else:
                    open(src, "rb").read()
                os.sync()  # no dirty pages left from the previous copy to throttle this one
                t = time.perf_counter()
                if which == "cp":
                    subprocess.run(["cp", src, os.path.join(dst, "cp.bin")], check=True)
                    cps.append(time.perf_counter() - t)
                    os.remove(os.path.join(dst, "cp.bin"))
                else:
                    path = stage(src, dst, job_id=f"bench{mode}{rep}")
                    sts.append(time.perf_counter() - t)
                    shutil.rmtree(os.path.dirname(path))
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        res[mode] = {"bytes": mib << 20, "cp_s": min(cps), "stage_s": min(sts), "ratio": min(cps) / min(sts),
                     "cp_median_s": med(cps), "stage_median_s": med(sts), "median_ratio": med(cps) / med(sts)}
    return res


def bench_lmdb_reads(lmdb_path: str, n: int = 200_000, reps: int = 9) -> dict:
    """``LMDBDataset.raw_item`` against a bare py-lmdb loop (``txn.get`` of the formatted key) over
    the same random indices, and ``raw_batch`` of 64 at a time; interleaved repetitions in a
    rotating order (so neither always runs first, on a warmer cache), best and median kept."""
    from ddp_hpc.data.lmdb import LMDBDataset, close_all, read_meta

    close_all()
    ds = LMDBDataset(lmdb_path)
    ds.raw_item(0)
    env = ds._env
    rng = random.Random(0)
    idx = [rng.randrange(len(ds)) for _ in range(n)]
    batches = [idx[k:k + BATCH] for k in range(0, n, BATCH)]

    def bare():
        with env.begin() as txn:
            get = txn.get
            for i in idx:
                get(b"%010d" % i)

    def ours():
        f = ds.raw_item
        for i in idx:
            f(i)

    def bulk():
        f = ds.raw_batch
        for b in batches:
            f(b)

    cases = {"bare": bare, "ours": ours, "bulk": bulk}
    times = {k: [] for k in cases}
    for rep in range(reps):
        names = list(cases)[rep % 3:] + list(cases)[:rep % 3]
        for k in names:
            t = time.perf_counter()
            cases[k]()
            times[k].append(time.perf_counter() - t)
    best = {k: min(v) for k, v in times.items()}
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    file_bytes = os.path.getsize(os.path.join(lmdb_path, "data.mdb"))
    payload = read_meta(lmdb_path)["bytes"]
    return {"reads": n, "bare_per_s": n / best["bare"], "ours_per_s": n / best["ours"],
            "ratio": best["bare"] / best["ours"], "median_ratio": med["bare"] / med["ours"],
            "batch_ratio": best["bare"] / best["bulk"], "file_bytes": file_bytes, "payload_bytes": payload,
            "size_ratio": file_bytes / payload}


def sbcast_note() -> str:
    return ("sbcast: measured by bench/sbcast.py inside an allocation (every node copying vs one sbcast); "
            "on the local test cluster: python -m ddp_hpc.testcluster run --nodes 2 -- sbatch -W -N2 --wrap "
            "'.venv/bin/python bench/sbcast.py --to $STATE/nodelocal --shared $STATE/shared'")


# ----------------------------------------------------------------------------- report
def summarise(per_rank: list, a: dict) -> list[dict]:
    rows = []
    ranks, nodes, files = len(per_rank), a["nodes"], a["files"]
    for scen in dict.fromkeys(r["scenario"] for r in per_rank[0]["runs"]):
        base = None
        for label, _, formula in TECHNIQUES:
            runs = [next(x for x in r["runs"] if x["scenario"] == scen and x["technique"] == label) for r in per_rank]
            sps = sum(x["samples"] / x["epoch_s"] for x in runs) / ranks
            base = sps if label == "direct" else base
            rows.append({"scenario": scen, "technique": label, "samples_per_s_rank": sps,
                         "vs_direct": sps / base, "opens": sum(x["opens"] for x in runs),
                         "bytes": sum(x["bytes"] for x in runs),
                         "processes_reading_shared": sum(1 for x in runs if x["opens"]),
                         "open_s_max": max(x["open_s"] for x in runs), "formula": formula,
                         "formula_value": {"direct": files, "lmdb": ranks, "stage+lmdb": nodes}.get(label, files)})
    return rows


def markdown(rows, stage_res, deliv, lmdb_res, a, cold_note) -> str:
    out = [f"{a['files']} PNG files ({a['bytes'] / 1e6:.1f} MB), {a['nodes']} simulated nodes x "
           f"{a['ppn']} ranks, batch {BATCH}, one epoch per cell; `simfs` = SIMULATED metadata-bound "
           f"shared FS: +{a['delay_s'] * 1e3:g} ms sleep per open of a shared file. {cold_note}", "",
           "| scenario | technique | samples/s per rank | vs direct | shared opens (counted) | formula | "
           "shared MB read | ranks touching shared dir | open/stage s |",
           "|---|---|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['scenario']} | {r['technique']} | {r['samples_per_s_rank']:.0f} | {r['vs_direct']:.2f} | "
                   f"{r['opens']} | {r['formula']} = {r['formula_value']} | {r['bytes'] / 1e6:.1f} | "
                   f"{r['processes_reading_shared']} | {r['open_s_max']:.2f} |")
    out += ["", "| ratio (same run) | measured | target |", "|---|---:|---:|"]
    for mode, s in stage_res.items():
        out.append(f"| staging / cp, {s['bytes'] >> 20} MiB, {mode} cache, best of runs (in-kernel copy + xxh3 of "
                   f"source and copy) | {s['ratio']:.2f} ({s['cp_s']:.3f} s vs {s['stage_s']:.3f} s; medians "
                   f"{s['median_ratio']:.2f}) | >= 0.9 |")
    d = deliv
    out.append(f"| broadcast delivery / bare gloo broadcast of the same bytes, one per step ({d['steps']} steps, "
               f"{d['group_bytes'] / 1e6:.1f} MB per group; ours ships {d['buckets']} buckets of <= "
               f"{d['coalesce_bytes'] >> 20} MiB) | {d['bare_broadcast_s'] / d['ours_s']:.2f} (medians "
               f"{d['bare_broadcast_median_s'] / d['ours_median_s']:.2f}) | >= 0.8 |")
    out.append(f"| broadcast delivery / bare gloo broadcast of the same bytes in the same {d['buckets']} buckets "
               f"(framing, copies, slicing only) | {d['bare_bucketed_s'] / d['ours_s']:.2f} (medians "
               f"{d['bare_bucketed_median_s'] / d['ours_median_s']:.2f}) | >= 0.6 |")
    out.append(f"| floor: the least a loader does (gather each step's samples, one copy into the bucket, bare "
               f"broadcast; bench/framing.py) / bare gloo broadcast in the same buckets | "
               f"{d['bare_bucketed_s'] / d['floor_s']:.2f} (medians "
               f"{d['bare_bucketed_median_s'] / d['floor_median_s']:.2f}) | (info) |")
    out.append(f"| broadcast delivery / floor | {d['floor_s'] / d['ours_s']:.2f} (medians "
               f"{d['floor_median_s'] / d['ours_median_s']:.2f}) | (info) |")
    out.append(f"| broadcast delivery with bucketing off / bare gloo broadcast per step | "
               f"{d['bare_broadcast_s'] / d['ours_unbucketed_s']:.2f} | (info) |")
    out.append(f"| broadcast delivery / bare gloo scatter of the same padded buffers per step (what strided "
               f"groups use) | {d['bare_scatter_s'] / d['ours_s']:.2f} | (info) |")
    out.append(f"| LMDBDataset.raw_item / bare py-lmdb txn.get, {lmdb_res['reads']} random reads | "
               f"{lmdb_res['ratio']:.2f} ({lmdb_res['ours_per_s'] / 1e6:.2f} vs "
               f"{lmdb_res['bare_per_s'] / 1e6:.2f} M/s; "
               f"medians {lmdb_res['median_ratio']:.2f}) | >= 0.9 |")
    out.append(f"| LMDBDataset.raw_batch (64 indices a call, as DataLoader batches read) / bare py-lmdb txn.get | "
               f"{lmdb_res['batch_ratio']:.2f} | (info) |")
    out.append(f"| packed LMDB file / its payload ({lmdb_res['file_bytes'] / 1e6:.1f} MB for "
               f"{lmdb_res['payload_bytes'] / 1e6:.1f} MB) | {lmdb_res['size_ratio']:.2f} | <= 1.3 |")
    return "\n".join(out)


def plot(rows, ratios: list[tuple[str, float, float]], path: str) -> None:
    """A plain bar chart with pillow: samples/s vs direct per technique and scenario; the ratios."""
    from PIL import Image, ImageDraw

    scens = list(dict.fromkeys(r["scenario"] for r in rows))
    techs = [t for t, _, _ in TECHNIQUES]
    colors = {"warm": (70, 130, 180), "cold": (120, 120, 120), "simfs": (214, 96, 77)}
    W, H, left, top, ph = 1100, 640, 70, 40, 300
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    d.text((left, 8), "samples/s per rank relative to direct reads (1.0 = direct)", fill="black")
    vmax = max(1.0, max(r["vs_direct"] for r in rows)) * 1.1
    y0 = top + ph
    d.line((left, y0, W - 20, y0), fill="black")
    y1 = y0 - ph / vmax
    d.line((left, y1, W - 20, y1), fill=(0, 150, 0))
    d.text((8, y1 - 6), "1.0", fill=(0, 150, 0))
    gw = (W - left - 40) / len(techs)
    bw = gw * 0.8 / len(scens)
    for ti, t in enumerate(techs):
        for si, s in enumerate(scens):
            r = next((r for r in rows if r["technique"] == t and r["scenario"] == s), None)
            if r is None:
                continue
            x = left + ti * gw + si * bw + gw * 0.1
            y = y0 - ph * r["vs_direct"] / vmax
            d.rectangle((x, y, x + bw - 2, y0), fill=colors.get(s, (0, 0, 0)))
            d.text((x, y - 12), f"{r['vs_direct']:.1f}", fill="black")
        d.text((left + ti * gw + 4, y0 + 6), t, fill="black")
    for si, s in enumerate(scens):
        d.rectangle((W - 250, 30 + 16 * si, W - 238, 42 + 16 * si), fill=colors.get(s, (0, 0, 0)))
        d.text((W - 232, 30 + 16 * si), s + (" (simulated metadata-bound FS)" if s == "simfs" else ""), fill="black")
    # ratios against targets
    base = y0 + 60
    d.text((left, base - 24), "ratios against same-run baselines (bar) and targets (line)", fill="black")
    for i, (name, value, target) in enumerate(ratios):
        y = base + i * 34
        d.text((8, y + 4), name, fill="black")
        x0, scale = 420, 400
        d.rectangle((x0, y, x0 + scale * min(value, 1.5) / 1.5, y + 20),
                    fill=(70, 160, 90) if value >= target else (214, 96, 77))
        xt = x0 + scale * target / 1.5
        d.line((xt, y - 3, xt, y + 23), fill="black", width=2)
        d.text((x0 + scale + 10, y + 4), f"{value:.2f} (target {target})", fill="black")
    img.save(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=20000, help="images in the dataset (default: 20000)")
    p.add_argument("--nodes", type=int, default=2, help="pretend nodes (default: 2)")
    p.add_argument("--procs-per-node", type=int, default=2, help="ranks per pretend node (default: 2)")
    p.add_argument("--delay-ms", type=float, default=1.0, help="simulated metadata cost per shared open")
    p.add_argument("--stage-mib", type=int, default=256, help="file size for staging vs cp (default: 256)")
    p.add_argument("--delivery-steps", type=int, default=10**6, help="cap on steps timed (default: the epoch)")
    p.add_argument("--no-drop-caches", action="store_true", help="skip the cold-cache runs")
    p.add_argument("--workdir", default="/tmp/ddp_hpc_io_bench", help="where the shared and local folders go")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "sharedfs"), help="writes OUT.json and OUT.png")
    p.add_argument("--peers", action="store_true",
                   help="then WebDataset, LitData and MosaicML Streaming on the same data (bench/peers.py, "
                        "in .venv-bench: `bash bench/setup.sh` first)")
    args = p.parse_args(argv)
    from ddp_hpc.data.pack import pack
    from ddp_hpc.examples.images import make_images
    from ddp_hpc.launch import launch_distributed

    t_all = time.perf_counter()
    work = os.path.abspath(args.workdir)
    shared = os.path.join(work, "shared")
    os.makedirs(shared, exist_ok=True)
    t = time.perf_counter()
    imgs = make_images(os.path.join(shared, "imgs"), count=args.files, classes=10, size=16, progress=False)
    print(f"dataset: {args.files} files in {imgs} ({time.perf_counter() - t:.1f} s)", flush=True)
    lmdb_path = os.path.join(shared, "imgs.lmdb")
    if not os.path.exists(lmdb_path):
        t = time.perf_counter()
        pack(imgs, lmdb_path, progress=False)
        print(f"packed {lmdb_path} ({time.perf_counter() - t:.1f} s)", flush=True)
    nbytes = sum(e.stat().st_size for d in os.scandir(imgs) if d.is_dir() for e in os.scandir(d.path))
    cold = can_drop_caches() and not args.no_drop_caches
    cold_note = ("Cold cache: page cache dropped (/proc/sys/vm/drop_caches) before each technique." if cold else
                 "Cold cache: SKIPPED (" + ("--no-drop-caches" if args.no_drop_caches else
                                            "not root / /proc/sys/vm/drop_caches not writable") + ").")
    a = {"work": work, "shared": shared, "delay_s": args.delay_ms / 1e3, "cold": cold, "files": args.files,
         "nodes": args.nodes, "ppn": args.procs_per_node, "bytes": nbytes, "steps": args.delivery_steps}
    world = args.nodes * args.procs_per_node
    t = time.perf_counter()
    per_rank = launch_distributed(_rank, world, args=(a,), nodes=args.nodes, timeout=900)
    print(f"distributed part: {time.perf_counter() - t:.1f} s", flush=True)
    rows = summarise(per_rank, a)
    deliv = per_rank[0]["delivery"]
    stage_res = bench_stage_vs_cp(work, args.stage_mib, cold)
    lmdb_res = bench_lmdb_reads(lmdb_path)
    table = markdown(rows, stage_res, deliv, lmdb_res, a, cold_note)
    print()
    print(table)
    print()
    print(sbcast_note())
    ratios = [(f"staging / cp ({m} cache)", s["ratio"], 0.9) for m, s in stage_res.items()]
    ratios += [("broadcast / bare gloo broadcast", deliv["bare_broadcast_s"] / deliv["ours_s"], 0.8),
               ("broadcast / bare, same buckets", deliv["bare_bucketed_s"] / deliv["ours_s"], 0.6),
               ("LMDBDataset / bare py-lmdb", lmdb_res["ratio"], 0.9)]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    plot(rows, ratios, args.out + ".png")
    with open(args.out + ".json.tmp", "w") as f:
        json.dump({"config": a, "rows": rows, "stage_vs_cp": stage_res, "delivery": deliv, "lmdb_reads": lmdb_res,
                   "per_rank": per_rank, "sbcast": sbcast_note(), "table_markdown": table}, f, indent=1)
    os.replace(args.out + ".json.tmp", args.out + ".json")
    print(f"\nwrote {args.out}.json and {args.out}.png; total {time.perf_counter() - t_all:.0f} s")
    return run_peers(args) if args.peers else 0


def run_peers(args) -> int:
    """The peers' half of the comparison: bench/peers.py under .venv-bench (the peers' pinned
    versions stay out of the project's environment), same file count and node layout."""
    py = os.path.join(ROOT, ".venv-bench", "bin", "python")
    if not os.path.exists(py):
        print(f"peers skipped: {py} does not exist; run `bash bench/setup.sh` (bench/requirements.txt)")
        return 2
    argv = [py, os.path.join(ROOT, "bench", "peers.py"), "--files", str(args.files), "--nodes",
            str(args.nodes), "--procs-per-node", str(args.procs_per_node), "--delay-ms", str(args.delay_ms)]
    print("\n" + " ".join(argv), flush=True)
    return subprocess.run(argv, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
