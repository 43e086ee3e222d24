"""Group broadcast loader: real gloo in 6 local processes laid out as 2 pretend nodes x 3.

Each rank must receive exactly DistributedSampler's samples (so the union over ranks is the
epoch's permutation, no duplicates beyond DistributedSampler's own padding), for node, strided
and two-level groups, for tensor samples and for encoded image bytes, and with a mid-epoch
start; only the group readers may touch the shared folder.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler

from ddp_hpc.data import samplers

N_SAMPLES = 29  # not a multiple of 6: DistributedSampler pads
BATCH = 2
FAST = "forkserver"  # ranks fork from one server that imported torch (tests/conftest.py)


class IndexDataset(torch.utils.data.Dataset):
    """Sample i = (a 2x3 float tensor filled with i, label i): payload and label both identify i."""

    def __len__(self):
        return N_SAMPLES

    def __getitem__(self, i):
        return torch.full((2, 3), float(i)), i


class RawIndexDataset(torch.utils.data.Dataset):
    """Encoded sample i: (i % 7 + 1) bytes of value i % 251, label i; read in bulk like LMDBDataset."""

    def __len__(self):
        return N_SAMPLES

    def raw_item(self, i):
        return bytes([i % 251]) * (i % 7 + 1), i

    def raw_batch(self, idx):
        return [self.raw_item(i)[0] for i in idx], list(idx)

    @staticmethod
    def decode_item(data, label):
        return torch.tensor([data[0], len(data)]), label


def _held_messages(ctx, out):
    """Every message of an epoch kept until the end (buckets of 1-2 steps): receive buffers are
    reused only when nothing views them, so what is held must still read back right."""
    from ddp_hpc.data.broadcast import BroadcastDataset, build_plan
    from ddp_hpc.data.wire import decode_samples

    for mode in ("node", "strided", "two_level"):
        for coll in ("auto", "scatter"):
            ds = BroadcastDataset(RawIndexDataset(), build_plan(ctx.env, mode), collective=coll,
                                  coalesce_bytes=40, max_coalesce=2)
            held = [list(ds.messages(batch_size=BATCH, seed=5, epoch=e)) for e in (0, 1)]
            got = []
            for msgs in held:
                pairs = [xy for m in msgs for xy in decode_samples(m, RawIndexDataset.decode_item)]
                assert all(x.tolist() == [y % 251, y % 7 + 1] for x, y in pairs), (mode, coll)
                got.append([y for _, y in pairs])
            out[f"held_{mode}_{coll}"] = got


def _rank_main(rank, world_size, image_root):
    from ddp_hpc.config import DataConfig
    from ddp_hpc.data import fsio
    from ddp_hpc.data.images import ImageFolderDataset
    from ddp_hpc.data.io import make_train_batches, open_train_data
    from ddp_hpc.dist import cleanup_ddp, setup_ddp

    ctx = setup_ddp()
    out = {"node": ctx.env.node_rank}
    try:
        for mode in ("node", "strided", "two_level"):
            cfg = DataConfig(io="broadcast", broadcast_groups=mode)
            ds = open_train_data(cfg, ctx, IndexDataset)
            got = {}
            for epoch in (0, 1):
                ids = []
                for x, y in make_train_batches(ds, cfg, ctx, batch_size=BATCH, seed=5, epoch=epoch):
                    assert torch.equal(x[:, 0, 0], y.float()), "payload and label disagree"
                    assert x.shape[1:] == (2, 3) and x.dtype == torch.float32
                    ids += y.tolist()
                got[epoch] = ids
            got["resume"] = [i for _, y in make_train_batches(ds, cfg, ctx, batch_size=BATCH, seed=5,
                                                              epoch=1, start_batch=2) for i in y.tolist()]
            out[mode] = got
            out[mode + "_readers"] = ds.plan.readers
        # slots that start far too small grow on the fly (resize slots) without losing a step
        from ddp_hpc.data.broadcast import BroadcastDataset, build_plan

        for mode in ("node", "two_level"):
            for coll in ("scatter", "broadcast"):
                tiny = BroadcastDataset(IndexDataset(), build_plan(ctx.env, mode), capacity=40, collective=coll)
                out[f"{mode}_{coll}_tiny"] = [i for _, y in tiny.batches(batch_size=BATCH, seed=5, epoch=0)
                                              for i in y.tolist()]
        # small steps are coalesced: one collective per bucket of steps, same samples per rank
        for mode in ("node", "strided", "two_level"):
            plan = build_plan(ctx.env, mode)
            for cb, mc, start in ((0, 32, 0), (1 << 20, 2, 0), (4 << 20, 32, 0), (1 << 20, 2, 1)):
                ds = BroadcastDataset(IndexDataset(), plan, coalesce_bytes=cb, max_coalesce=mc)
                calls, deliver = [], ds._deliver
                ds._deliver = lambda msgs, calls=calls, deliver=deliver: calls.append(1) or deliver(msgs)
                ids = [i for _, y in ds.batches(batch_size=BATCH, seed=5, epoch=0, start_batch=start)
                       for i in y.tolist()]
                out[f"{mode}_coalesce_{cb}_{mc}_{start}"] = (ids, len(calls))
        _held_messages(ctx, out)
        # encoded image bytes through the two-level path; count opens below the shared root
        fsio.watch(image_root)
        cfg = DataConfig(io="broadcast", broadcast_groups="two_level")
        ds = open_train_data(cfg, ctx, lambda: ImageFolderDataset(image_root))
        direct = ImageFolderDataset(image_root)
        fsio.reset()
        imgs = []
        for x, y in make_train_batches(ds, cfg, ctx, batch_size=BATCH, seed=1, epoch=0, num_workers=2):
            imgs.append((x, y))
        out["image_opens"] = fsio.snapshot()["opens"]
        mine = samplers.epoch_indices(len(direct), world_size, rank, 1, 0)
        flat_x = torch.cat([x for x, _ in imgs])
        flat_y = torch.cat([y for _, y in imgs]).tolist()
        out["images_match"] = flat_y == [direct[i][1] for i in mine] and all(
            torch.equal(flat_x[k], direct[i][0]) for k, i in enumerate(mine))
        out["image_count"] = len(flat_y)
    finally:
        cleanup_ddp()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from ddp_hpc.examples.images import make_images
    from ddp_hpc.launch import launch_distributed

    root = make_images(tmp_path_factory.mktemp("shared") / "imgs", count=23, classes=3, size=8, progress=False)
    return launch_distributed(_rank_main, 6, args=(root,), nodes=2, timeout=240, start_method=FAST)


def _expected(rank, epoch, seed=5):
    s = DistributedSampler(range(N_SAMPLES), num_replicas=6, rank=rank, shuffle=True, seed=seed, drop_last=False)
    s.set_epoch(epoch)
    return list(s)


@pytest.mark.parametrize("mode", ["node", "strided", "two_level"])
def test_each_rank_gets_exactly_its_distributed_sampler_samples(results, mode):
    for epoch in (0, 1):
        per_rank = [r[mode][epoch] for r in results]
        for rank, ids in enumerate(per_rank):
            assert ids == _expected(rank, epoch), f"{mode} rank {rank} epoch {epoch}"
        union = [i for ids in per_rank for i in ids]
        assert sorted(set(union)) == list(range(N_SAMPLES))  # the whole permutation
        assert len(union) == 6 * -(-N_SAMPLES // 6)  # only DistributedSampler's padding repeats
    assert [r[mode][0] for r in results] != [r[mode][1] for r in results]  # epochs reshuffle


@pytest.mark.parametrize("mode", ["node", "strided", "two_level"])
def test_mid_epoch_start_skips_exactly_the_done_batches(results, mode):
    for rank, r in enumerate(results):
        assert r[mode]["resume"] == _expected(rank, 1)[2 * BATCH:]


@pytest.mark.parametrize("coll", ["scatter", "broadcast"])
@pytest.mark.parametrize("mode", ["node", "two_level"])
def test_buffers_grow_when_a_step_outgrows_them_with_either_collective(results, mode, coll):
    for rank, r in enumerate(results):
        assert r[f"{mode}_{coll}_tiny"] == _expected(rank, 0)


@pytest.mark.parametrize("mode", ["node", "strided", "two_level"])
def test_small_steps_are_coalesced_into_fewer_collectives(results, mode):
    # 29 samples, 6 ranks, batch 2: 3 steps per rank
    for (cb, mc, start), collectives in {(0, 32, 0): 3, (1 << 20, 2, 0): 2, (4 << 20, 32, 0): 1,
                                         (1 << 20, 2, 1): 1}.items():
        for rank, r in enumerate(results):
            ids, calls = r[f"{mode}_coalesce_{cb}_{mc}_{start}"]
            assert ids == _expected(rank, 0)[start * BATCH:], (mode, cb, mc, start, rank)
            assert calls == collectives, (mode, cb, mc, start, rank)


@pytest.mark.parametrize("coll", ["auto", "scatter"])
@pytest.mark.parametrize("mode", ["node", "strided", "two_level"])
def test_raw_samples_in_bulk_and_held_messages_stay_intact(results, mode, coll):
    for rank, r in enumerate(results):
        assert r[f"held_{mode}_{coll}"] == [_expected(rank, 0), _expected(rank, 1)], (mode, coll, rank)


def test_readers_per_mode(results):
    assert results[0]["node_readers"] == [0, 3]
    assert results[0]["strided_readers"] == [0, 1, 2]
    assert results[0]["two_level_readers"] == [0]


def test_encoded_images_decode_identically_and_only_the_reader_opens_files(results):
    assert all(r["images_match"] for r in results)
    assert [r["image_count"] for r in results] == [4] * 6
    assert results[0]["image_opens"] == 23 + 1  # every file once, plus DistributedSampler's pad
    assert [r["image_opens"] for r in results[1:]] == [0] * 5


def test_sampler_matches_torch_for_many_shapes():
    for n in (1, 5, 6, 7, 30, 31):
        for world in (1, 2, 4, 6):
            for rank in range(world):
                for epoch in (0, 3):
                    s = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=9)
                    s.set_epoch(epoch)
                    assert samplers.epoch_indices(n, world, rank, 9, epoch) == list(s)


def test_wire_round_trip_and_unshippable_samples_named():
    from ddp_hpc.data.errors import SampleError
    from ddp_hpc.data.wire import bundle, decode_samples, encode_samples, unbundle

    items = [(torch.arange(6, dtype=torch.int16).reshape(2, 3), torch.tensor(4)), (torch.ones(0), torch.tensor(1.5))]
    back = decode_samples(encode_samples(items, raw=False))
    assert all(torch.equal(a, b) and a.dtype == b.dtype for pair, got in zip(items, back) for a, b in zip(pair, got))
    raw = decode_samples(encode_samples([(b"abc", 7), (b"", 2)], raw=True), lambda data, label: (data, label))
    assert raw == [(b"abc", 7), (b"", 2)]
    assert [bytes(m) for m in unbundle(bundle([b"x", b"", b"yz"]))] == [b"x", b"", b"yz"]
    with pytest.raises(SampleError, match=r"expects samples \(input, target\); got int\nHINT: return an"):
        encode_samples([3], raw=False)
    with pytest.raises(TypeError, match=r"complex64 tensor.*\nHINT: samples must be tensors"):
        encode_samples([(torch.zeros(2, dtype=torch.complex64), 0)], raw=False)


def test_raw_bundle_is_the_bundle_of_the_steps_messages():
    import random

    from ddp_hpc.data.wire import Pieces, bundle, bundle_pieces, encode_samples, raw_bundle, unbundle

    rng = random.Random(1)
    for counts in ([1], [3, 3, 1], [64] * 5 + [17], [0, 2]):
        values = [rng.randbytes(rng.choice([0, 1, 800, 3000])) for _ in range(sum(counts))]
        labels = [rng.randrange(-1, 10) for _ in values]
        pieces = raw_bundle(values, labels, counts)
        steps, at = [], 0
        for c in counts:
            steps.append(encode_samples(list(zip(values[at:at + c], labels[at:at + c])), raw=True))
            at += c
        joined = b"".join(pieces)
        assert joined == bundle(steps) and pieces.nbytes == len(joined)
        assert b"".join(raw_bundle(values, labels, counts, [len(v) for v in values])) == joined
        assert [bytes(m) for m in unbundle(joined)] == steps
        nested = bundle_pieces([pieces, b"xy"])  # a bundle of bundles (two_level's per-node message)
        assert isinstance(nested, Pieces) and b"".join(nested) == bundle([joined, b"xy"])
        assert nested.nbytes == len(b"".join(nested))


def test_buffers_are_reused_only_when_nothing_views_them():
    from ddp_hpc.data.wire import _Buffers

    bufs = _Buffers(keep=2)
    a = bufs.join([b"abc", b"def"], 8)
    assert a.tolist()[:6] == list(b"abcdef") and a.numel() == 8
    view = memoryview(a.numpy())[0:3]
    del a
    b = bufs.join([b"XYZ"], 3)  # the first buffer is still viewed: a second one
    assert bytes(view) == b"abc" and bytes(b.numpy()) == b"XYZ"
    del b
    c = bufs.join([b"123"], 3)  # the second is free again and reused
    assert bytes(c.numpy()) == b"123" and bytes(view) == b"abc" and len(bufs.pool) == 2
    held = [bufs.empty(4) for _ in range(3)]  # all in use: a new one, not kept
    assert len(bufs.pool) == 2 and all(t.numel() == 4 for t in held)
