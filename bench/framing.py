"""Broadcast framing: the broadcast loader's delivery against bare gloo collectives of the same
bytes, and where the loader's time goes.

    .venv/bin/python bench/framing.py                 # ~1 minute on 2 cores
    .venv/bin/python bench/framing.py --files 20000 --reps 11 --profile
    .venv/bin/python bench/framing.py --alone            # the reader's work alone: seconds, no ranks

The same measurement ``bench/sharedfs.py`` makes in its run (:func:`delivery`, imported there): 4 ranks
as 2 pretend nodes of 2 (``--ranks``, ``--nodes``), node groups, the samples in memory (no reads,
no decode), one epoch's steps of 64 samples.  Cases, interleaved over ``--reps`` repetitions, best and median kept:

* ``ours``: ``BroadcastDataset.messages`` (bulk read, headers, framing into the send buffer, the
  bucketed broadcast, the members' slicing), 1 MiB buckets;
* ``bare_bucketed``: a bare ``dist.broadcast`` of the same bytes in the same buckets, prebuilt
  (the framing overhead alone is ``bare_bucketed / ours``, target >= 0.6);
* ``bare_broadcast``: one bare broadcast per step (what a hand-written loader does);
* ``floor``: the least any loader does: gather each step's samples by index and copy them back
  to back into the bucket's buffer (one C loop), the bare broadcast of the previous bucket in
  flight meanwhile; members take the buffer as it comes (``floor / ours``: how close we are);
* ``ours_unbucketed`` and ``bare_scatter`` for information.

``--profile`` then times the loader's phases per bucket on the reader (preparing: the bulk read
and :func:`ddp_hpc.data.wire.raw_bundle`; framing: the join into the send buffer; starting the
collective; waiting for it) and on the members (the collective; slicing), and prints the reader's
and a member's top functions under cProfile; and the reader's work per bucket alone, in one process
with no collective (:func:`alone`), against the floor's.  Writes ``bench/framing.json``.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BATCH = 64


def _setup(ctx, imgs, max_steps):
    """The loader (bucketed and not), the bare cases' buffers and the group, on the same steps."""
    import torch
    import torch.distributed as dist

    from ddp_hpc.data.broadcast import BroadcastDataset, build_plan, encode_samples
    from ddp_hpc.data.images import list_image_folder
    from ddp_hpc.data.samplers import epoch_indices

    _, samples = list_image_folder(imgs)
    blobs = [(open(os.path.join(imgs, rel), "rb").read(), label) for rel, label in samples]
    values, labels = [v for v, _ in blobs], [label for _, label in blobs]

    class Mem(torch.utils.data.Dataset):
        def __len__(self):
            return len(blobs)

        def raw_item(self, i):
            return blobs[i]

        def raw_batch(self, idx):  # the bulk read LMDBDataset has too, C-level as there
            return list(map(values.__getitem__, idx)), list(map(labels.__getitem__, idx))

        def decode_item(self, data, label):
            return data, label

    plan = build_plan(ctx.env, "node")
    g, ranks = plan.level1
    ds, ds_off = BroadcastDataset(Mem(), plan), BroadcastDataset(Mem(), plan, coalesce_bytes=0)
    world = dist.get_world_size()
    perms = {r: epoch_indices(len(blobs), world, r, 0, 0) for r in ranks}
    steps = min(max_steps, -(-len(perms[ranks[0]]) // BATCH))
    msgs = [[encode_samples([blobs[i] for i in perms[r][b * BATCH:(b + 1) * BATCH]], True) for r in ranks]
            for b in range(steps)]
    buckets, cur, nbytes, last = [], [], 0, 0  # the loader's bucketing rule, replayed on the same steps
    for b, step in enumerate(msgs):
        if cur and not ds.takes_another(nbytes, last, len(cur)):
            buckets.append(cur)
            cur, nbytes = [], 0
        cur.append(step)
        last = sum(len(blobs[i][0]) for r in ranks for i in perms[r][b * BATCH:(b + 1) * BATCH])
        nbytes += last
    buckets.append(cur)
    bucket_idx, b = [], 0  # per bucket: each step's indices for each member, in send order
    for bk in buckets:
        bucket_idx.append([perms[r][(b + j) * BATCH:(b + j + 1) * BATCH] for j in range(len(bk)) for r in ranks])
        b += len(bk)
    return dict(ds=ds, ds_off=ds_off, g=g, ranks=ranks, steps=steps, msgs=msgs, buckets=buckets,
                bucket_idx=bucket_idx, total=sum(len(m) for step in msgs for m in step))


def _cases(s):
    import torch
    import torch.distributed as dist

    ds, g, ranks, steps, msgs = s["ds"], s["g"], s["ranks"], s["steps"], s["msgs"]
    me = ranks.index(dist.get_rank())
    step_bufs = [torch.frombuffer(bytearray(b"".join(step)), dtype=torch.uint8) for step in msgs]
    bucket_bufs = [torch.frombuffer(bytearray(b"".join(m for st in bk for m in st)), dtype=torch.uint8)
                   for bk in s["buckets"]]
    width = [max(len(m) for m in step) for step in msgs]
    flats = [torch.zeros((len(ranks), w), dtype=torch.uint8) for w in width]
    outs = [torch.empty(w, dtype=torch.uint8) for w in width]
    want = sum(len(step[me]) for step in msgs)

    def loader(d):
        got = 0
        for b, msg in enumerate(d.messages(batch_size=BATCH, seed=0, epoch=0)):
            got += len(msg)
            if b + 1 == steps:
                break
        assert got == want, (got, want)

    def bcast(bufs):
        for buf in bufs:
            dist.broadcast(buf, group=g, group_src=0)

    sizes = [b.numel() for b in bucket_bufs]
    floor_bufs = [io.BytesIO(bytes(n)) for n in sizes]   # written from the start: same length
    floor_recv = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    raw_batch = ds.inner.raw_batch

    def floor():
        """The least a loader does: per bucket, gather each step's samples by index (the bulk
        read) and copy them back to back into one buffer (one C loop), while the previous
        bucket's bare broadcast is in flight; the members take the buffer as it comes (no
        headers, no slicing).  The same bytes move as in bare_bucketed."""
        if me != 0:
            for recv in floor_recv:
                dist.broadcast(recv, group=g, group_src=0)
            return
        work = None
        for bio, idxs in zip(floor_bufs, s["bucket_idx"]):
            bio.seek(0)
            for idx in idxs:
                bio.writelines(raw_batch(idx)[0])
            t = torch.frombuffer(bio.getbuffer(), dtype=torch.uint8)
            if work is not None:
                work.wait()
            work = dist.broadcast(t, group=g, group_src=0, async_op=True)
            del t   # the work holds it while in flight; then the BytesIO can be written again
        work.wait()

    def scatter():
        for flat, o in zip(flats, outs):
            dist.scatter(o, list(flat.unbind(0)) if me == 0 else None, group=g, group_src=0)

    calls, deliver = [], ds._deliver  # one untimed epoch: ours ships the same buckets as replayed
    ds._deliver = lambda started: calls.append(1) or deliver(started)
    loader(ds)
    del ds._deliver
    assert len(calls) == len(s["buckets"]), (len(calls), len(s["buckets"]))
    return {"ours_s": lambda: loader(ds), "ours_unbucketed_s": lambda: loader(s["ds_off"]),
            "bare_broadcast_s": lambda: bcast(step_bufs), "bare_bucketed_s": lambda: bcast(bucket_bufs),
            "floor_s": floor, "bare_scatter_s": scatter}


def delivery(ctx, imgs, max_steps, reps=11):
    """Broadcast loader delivery with node groups (encode, header, bucketed broadcast, slice;
    samples from memory, no decode) against bare gloo collectives of the same bytes: one
    broadcast per step (what a hand-written loader does), the same bytes in the same buckets as
    ours (pure framing overhead), and a bare scatter per step.  Interleaved repetitions; the
    best and the median of each are kept."""
    import torch.distributed as dist

    s = _setup(ctx, imgs, max_steps)
    cases = _cases(s)
    times = {k: [] for k in cases}
    for _rep in range(reps):
        for k, fn in cases.items():
            dist.barrier()
            t = time.perf_counter()
            fn()
            dist.barrier(group=s["g"])
            times[k].append(time.perf_counter() - t)
    res = {k: min(v) for k, v in times.items()}
    res.update({k.replace("_s", "_median_s"): sorted(v)[len(v) // 2] for k, v in times.items()})
    res.update(steps=s["steps"], buckets=len(s["buckets"]), group_bytes=s["total"],
               coalesce_bytes=s["ds"].coalesce_bytes)
    return res, s, cases


def _timed(obj, name, into):
    """Wrap ``obj.name`` to add each call's wall time to ``into[name]`` (an instance attribute)."""
    fn = getattr(obj, name)

    def wrapper(*args, **kw):
        t = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            into.setdefault(name, []).append(time.perf_counter() - t)

    setattr(obj, name, wrapper)


def _cpu(s, cases, reps) -> dict:
    """Per bucket, this process's CPU time (gloo's threads included) and its main thread's, in
    one ``ours`` epoch, one ``floor`` and one bare bucketed one (microseconds, medians over ``reps``)."""
    import torch.distributed as dist

    kinds = ("ours", "floor", "bare_bucketed")
    cpu = {f"{w}_{k}": [] for w in ("process", "main_thread") for k in kinds}
    for _ in range(reps):
        for k in kinds:
            dist.barrier()
            c, m = time.process_time(), time.thread_time()
            cases[k + "_s"]()
            dist.barrier(group=s["g"])
            cpu[f"process_{k}"].append(time.process_time() - c)
            cpu[f"main_thread_{k}"].append(time.thread_time() - m)
    return {f"cpu_{k}_us": round(sorted(v)[len(v) // 2] / len(s["buckets"]) * 1e6, 1) for k, v in cpu.items()}


def phases(s, cases, reps):
    """Per-bucket wall time of the loader's phases in this rank (microseconds, means over
    ``reps`` epochs), then :func:`_cpu` measured without the timers."""
    import torch.distributed as dist

    ds, ch = s["ds"], s["ds"]._ch1
    spent: dict = {}
    wrapped = ((ds, ("_prepare",)), (ch, ("frame", "start", "finish", "transfer", "_run")))
    for obj, names in wrapped:
        for n in names:
            _timed(obj, n, spent)
    for _ in range(reps):
        dist.barrier()
        cases["ours_s"]()
        dist.barrier(group=s["g"])
    for obj, names in wrapped:
        for n in names:
            obj.__dict__.pop(n, None)
    per = len(s["buckets"]) * reps
    out = {k: round(sum(v) / per * 1e6, 1) for k, v in spent.items()}
    out.update(_cpu(s, cases, reps))
    return out


def profiled(cases, top=14) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        cases["ours_s"]()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def alone(imgs, reps=30) -> dict:
    """The reader's work per bucket in one process, with no collective and no other rank taking
    turns on the cores: ``BroadcastDataset._prepare`` (bulk reads, headers, the join into the send
    buffer) of rank 0's node group (ranks 0 and 1 of 4) against the floor's gather and one copy of
    the same samples (microseconds per bucket, best and median of ``reps`` epochs)."""
    import torch

    from ddp_hpc.data.broadcast import BroadcastDataset, GroupPlan
    from ddp_hpc.data.images import list_image_folder
    from ddp_hpc.data.samplers import batches_per_rank, epoch_permutation

    _, samples = list_image_folder(imgs)
    blobs = [(open(os.path.join(imgs, rel), "rb").read(), label) for rel, label in samples]
    values, labels = [v for v, _ in blobs], [label for _, label in blobs]

    class Mem:
        def __len__(self):
            return len(blobs)

        def raw_item(self, i):
            return blobs[i]

        def raw_batch(self, idx):
            return list(map(values.__getitem__, idx)), list(map(labels.__getitem__, idx))

        def decode_item(self, data, label):
            return data, label

    world, members = 4, [0, 1]
    plan = GroupPlan("node", 0, world, (None, members), None, members, [0, 2], torch.device("cpu"))
    ds, mem = BroadcastDataset(Mem(), plan), Mem()
    steps = batches_per_rank(len(blobs), world, BATCH)
    full = epoch_permutation(len(blobs), world, 0, 0)
    perm = {r: full[r::world] for r in members}
    spans, b = [], 0
    while b < steps:   # the buckets ours makes, replayed by the floor
        b_next, framed = ds._prepare(perm, b, steps, BATCH, None)
        spans.append([perm[r][j * BATCH:(j + 1) * BATCH] for j in range(b, b_next) for r in members])
        b = b_next
    del framed
    bios = [io.BytesIO(bytes(2 << 20)) for _ in spans]

    def ours():
        b = 0
        while b < steps:
            b, _ = ds._prepare(perm, b, steps, BATCH, None)

    def floor():
        for bio, idxs in zip(bios, spans):
            bio.seek(0)
            for idx in idxs:
                bio.writelines(mem.raw_batch(idx)[0])
            t = torch.frombuffer(bio.getbuffer(), dtype=torch.uint8)
            del t

    times = {"ours": [], "floor": []}
    for _ in range(reps):
        for k, fn in (("ours", ours), ("floor", floor)):
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    out = {"buckets": len(spans)}
    for k, v in times.items():
        out[f"{k}_best_us"] = round(min(v) / len(spans) * 1e6, 1)
        out[f"{k}_median_us"] = round(sorted(v)[len(v) // 2] / len(spans) * 1e6, 1)
    return out


def _rank(rank, world_size, a):
    import torch

    from ddp_hpc.dist import cleanup_ddp, setup_ddp

    torch.set_num_threads(1)
    ctx = setup_ddp()
    res, s, cases = delivery(ctx, a["imgs"], 10**6, a["reps"])
    out = {"rank": rank, "delivery": res}
    if a["profile"]:
        out["phases_us_per_bucket"] = phases(s, cases, a["reps"])
        out["cprofile"] = profiled(cases)
    cleanup_ddp()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=20000, help="images in the dataset (default: 20000)")
    p.add_argument("--reps", type=int, default=11, help="interleaved repetitions (default: 11)")
    p.add_argument("--profile", action="store_true", help="also time the phases and print cProfile's top")
    p.add_argument("--ranks", type=int, default=4, help="ranks (default: 4)")
    p.add_argument("--nodes", type=int, default=2, help="pretend nodes they make (default: 2; node groups)")
    p.add_argument("--alone", action="store_true", help="only the reader's work alone (one process, seconds)")
    p.add_argument("--workdir", default="/tmp/ddp_hpc_io_bench", help="where the images go (bench/sharedfs.py's)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "framing.json"))
    args = p.parse_args(argv)
    from ddp_hpc.examples.images import make_images
    from ddp_hpc.launch import launch_distributed

    imgs = make_images(os.path.join(args.workdir, "shared", "imgs"), count=args.files, classes=10, size=16,
                       progress=False)
    if args.alone:
        print(f"load average {os.getloadavg()[0]:.2f}; the reader's work alone, us per bucket: {alone(imgs)}")
        return 0
    a = {"imgs": imgs, "reps": args.reps, "profile": args.profile}
    load = os.getloadavg()
    per_rank = launch_distributed(_rank, args.ranks, args=(a,), nodes=args.nodes, timeout=900)
    d = per_rank[0]["delivery"]
    print(f"load average before: {load[0]:.2f}; after: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs, "
          f"{args.ranks} ranks on {args.nodes} pretend nodes)")
    print(f"{d['steps']} steps, {d['buckets']} buckets, {d['group_bytes'] / 1e6:.1f} MB per group")
    for k in ("ours_s", "bare_bucketed_s", "floor_s", "bare_broadcast_s", "ours_unbucketed_s", "bare_scatter_s"):
        print(f"  {k:20s} best {d[k] * 1e3:7.2f} ms   median {d[k.replace('_s', '_median_s')] * 1e3:7.2f} ms")
    print(f"framing ratio (bare same buckets / ours): {d['bare_bucketed_s'] / d['ours_s']:.2f} best, "
          f"{d['bare_bucketed_median_s'] / d['ours_median_s']:.2f} medians (target >= 0.6)")
    print(f"floor (gather + one copy + bare broadcast) / ours: {d['floor_s'] / d['ours_s']:.2f} best, "
          f"{d['floor_median_s'] / d['ours_median_s']:.2f} medians; bare same buckets / floor: "
          f"{d['bare_bucketed_s'] / d['floor_s']:.2f} best, "
          f"{d['bare_bucketed_median_s'] / d['floor_median_s']:.2f} medians")
    print(f"vs one bare broadcast per step: {d['bare_broadcast_s'] / d['ours_s']:.2f} best (target >= 0.8)")
    if args.profile:
        one = alone(imgs)
        print(f"\nthe reader's work alone (one process, no collective), us per bucket: ours "
              f"{one['ours_best_us']} best, {one['ours_median_us']} median; floor {one['floor_best_us']} best, "
              f"{one['floor_median_us']} median")
        for r in (0, 1):
            role = "reader" if r == 0 else "member"
            print(f"\nrank {r} ({role}), us per bucket: {per_rank[r]['phases_us_per_bucket']}")
        for r in (0, 1):
            print(f"\nrank {r} cProfile, 5 epochs of ours:\n{per_rank[r]['cprofile']}")
    with open(args.out, "w") as f:
        json.dump({"load_before": load, "ranks": args.ranks, "nodes": args.nodes, "per_rank": per_rank,
                   "alone": one if args.profile else None}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
