"""open_train_data / make_train_batches for every data.io, in 4 gloo processes laid out as
2 pretend nodes x 2 (each pretend node gets its own TMPDIR, like a node-local disk): every
technique yields the same batches as direct reads, staging reads the shared copy once per node,
and bad settings fail with the key named."""
from __future__ import annotations

import os

import pytest
import torch

from ddp_hpc.config import DataConfig

FAST = "forkserver"  # ranks fork from one server that imported torch (tests/conftest.py)


def _digest(x: torch.Tensor) -> tuple:
    """Plain data to return across processes (tensors would travel as shared-memory handles)."""
    import hashlib

    return tuple(x.shape), str(x.dtype), hashlib.sha1(x.contiguous().numpy().tobytes()).hexdigest()


def _rank_main(rank, world_size, shared, local_base):
    from ddp_hpc.data import fsio
    from ddp_hpc.data.images import ImageFolderDataset
    from ddp_hpc.data.io import close_train_data, make_train_batches, open_train_data
    from ddp_hpc.dist import cleanup_ddp, setup_ddp

    ctx = setup_ddp()
    os.environ["TMPDIR"] = os.path.join(local_base, f"node{ctx.env.node_rank}")  # a node-local disk
    os.makedirs(os.environ["TMPDIR"], exist_ok=True)
    root, lmdb_path = os.path.join(shared, "imgs"), os.path.join(shared, "imgs.lmdb")
    factory = lambda: ImageFolderDataset(root)  # noqa: E731
    cases = {
        "direct": DataConfig(io="direct"),
        "lmdb": DataConfig(io="lmdb", lmdb_path=lmdb_path, num_workers=1),
        "stage_lmdb": DataConfig(io="stage", lmdb_path=lmdb_path, stage_to="tmpdir"),
        "stage_dir": DataConfig(io="stage", stage_to="tmpdir"),
        "broadcast_lmdb": DataConfig(io="broadcast", lmdb_path=lmdb_path, broadcast_groups="strided"),
    }
    out = {"node": ctx.env.node_rank}
    fsio.watch(shared)
    try:
        for name, cfg in cases.items():
            fsio.reset()
            ds = open_train_data(cfg, ctx, factory)
            out[name + "_open_opens"] = fsio.snapshot()["opens"]
            out[name + "_path"] = getattr(ds, "root", None)
            batches = []
            rng = torch.get_rng_state()
            for epoch, start in ((0, 0), (1, 0), (1, 1)):
                batches.append([(_digest(x), y.tolist()) for x, y in make_train_batches(
                    ds, cfg, ctx, batch_size=3, seed=7, epoch=epoch, start_batch=start,
                    num_workers=cfg.num_workers)])
            out[name] = batches
            # the global RNG (dropout & co.) must not move, or mid-epoch resume is not bitwise
            out[name + "_rng_untouched"] = torch.equal(rng, torch.get_rng_state())
            close_train_data(ds, cfg, ctx, completed=True)
    finally:
        fsio.unwatch()
        cleanup_ddp()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from ddp_hpc.data.pack import pack
    from ddp_hpc.examples.images import make_images
    from ddp_hpc.launch import launch_distributed

    shared = tmp_path_factory.mktemp("shared")
    make_images(shared / "imgs", count=26, classes=3, size=8, progress=False)
    pack(shared / "imgs", shared / "imgs.lmdb", progress=False)
    local = tmp_path_factory.mktemp("local")
    return launch_distributed(_rank_main, 4, args=(str(shared), str(local)), nodes=2, timeout=300,
                              start_method=FAST), local


@pytest.mark.parametrize("name", ["lmdb", "stage_lmdb", "stage_dir", "broadcast_lmdb"])
def test_same_batches_as_direct(results, name):
    res, _ = results
    for r in res:
        for got, want in zip(r[name], r["direct"]):
            assert len(got) == len(want) > 0
            assert got == want
    assert [r["direct"][2] for r in res] == [r["direct"][1][1:] for r in res]  # resume


@pytest.mark.parametrize("name", ["stage_lmdb", "stage_dir"])
def test_stage_copies_once_per_node_to_each_node_local_dir(results, name):
    res, local = results
    # local rank 0 of each node opens the shared copy once (data.mdb, or each of the folder's 27
    # files once: tar's opens, counted by the stager); the other local ranks open nothing there
    once = 1 if name == "stage_lmdb" else 27
    assert [r[name + "_open_opens"] for r in res] == [once, 0, once, 0]
    for r in res:
        assert r[name + "_path"].startswith(os.path.join(str(local), f"node{r['node']}") + "/")
    # data.stage_cleanup (default true) removed the copies after a completed run
    for node in ("node0", "node1"):
        assert [n for n in os.listdir(local / node) if n.startswith("ddp_hpc-stage-")] == []


@pytest.mark.parametrize("name", ["direct", "lmdb", "stage_lmdb", "stage_dir", "broadcast_lmdb"])
def test_batches_leave_the_global_rng_alone(results, name):
    per_rank, _ = results
    assert all(r[name + "_rng_untouched"] for r in per_rank), name


def test_bad_io_settings_name_the_key():
    from types import SimpleNamespace

    from ddp_hpc.data.io import IOConfigError, open_train_data

    ctx = SimpleNamespace(env=None)
    with pytest.raises(IOConfigError, match="data.io=lmdb needs data.lmdb_path"):
        open_train_data(DataConfig(io="lmdb"), ctx, list)
    with pytest.raises(IOConfigError, match="data.io=broadcast needs torch.distributed"):
        open_train_data(DataConfig(io="broadcast"), ctx, lambda: [1])
