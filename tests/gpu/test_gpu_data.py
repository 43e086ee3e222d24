"""``data.io=lmdb|stage|broadcast`` feeding a CUDA model: ``python -m ddp_hpc.run jobs/images.yaml`` on a
small packed image set, one rank per GPU (up to 2), each IO cure against ``direct``. broadcast
runs over nccl with CUDA buffers (the backend of the job's group, as designed in data/io.py)."""
from __future__ import annotations

import math

import pytest
import torch

from ddp_hpc.launch import run_local
from ddp_hpc.train.checkpoint import find_latest_valid

from ._helpers import DEVICE, MARKS, REPO, WORLD, child_env, events, python, tail

pytestmark = MARKS + [pytest.mark.timeout(240)]

IMAGES = str(REPO / "jobs" / "images.yaml")


@pytest.fixture(scope="module")
def image_set(tmp_path_factory):
    pytest.importorskip("lmdb", reason="lmdb is not installed (offline node: scripts/gpu-wheels.sh, docs/gpu.md)")
    pytest.importorskip("PIL", reason="pillow is not installed")
    from ddp_hpc.data.pack import pack
    from ddp_hpc.examples.images import make_images
    root = tmp_path_factory.mktemp("images")
    make_images(root / "train", count=96, classes=10, size=16, seed=0, progress=False)
    make_images(root / "eval", count=40, classes=10, size=16, seed=1, progress=False)
    pack(root / "train", root / "train.lmdb", progress=False)
    return root


def _run(root, tmp, io: str) -> dict:
    argv = [python(), "-m", "ddp_hpc.run", IMAGES, f"data.io={io}", f"data.kwargs.root={root}/train",
            f"data.eval_kwargs.root={root}/eval", f"log.dir={tmp}/logs", f"checkpoint.dir={tmp}/ckpt",
            f"data.stage_to={tmp}/node-local", "train.epochs=2", "train.batch_size=16",
            "log.every_n_steps=1", "log.progress=off"]
    if io != "direct":
        argv.append(f"data.lmdb_path={root}/train.lmdb")
    (tmp / "node-local").mkdir()
    res = run_local(argv, nodes=1, procs_per_node=WORLD, log_dir=tmp / "out", env=child_env())
    assert res.ok, tail(tmp / "out")
    ev = events(tmp / "logs")
    start = next(e for e in ev[0] if e["event"] == "start")
    evals = [e for e in ev[0] if e["event"] == "eval"]
    _, state = find_latest_valid(tmp / "ckpt", warn=pytest.fail)
    return {"device": start["device"], "end": ev[0][-1], "eval": evals[-1]["metrics"],
            "model": state["model"]}


@pytest.fixture(scope="module")
def direct(image_set, tmp_path_factory):
    return _run(image_set, tmp_path_factory.mktemp("direct"), "direct")


@pytest.mark.parametrize("io", ["lmdb", "stage", "broadcast"])
def test_io_cure_feeds_a_cuda_model_like_direct_reads(image_set, direct, tmp_path, io):
    got = _run(image_set, tmp_path, io)
    assert got["device"] == direct["device"] == DEVICE
    assert got["end"]["status"] == "completed" and got["end"]["step"] == direct["end"]["step"]
    assert got["eval"]["count"] == 40 and math.isfinite(got["eval"]["loss"])
    # the same samples in the same order train the same weights (up to the GPU's summation order)
    for k, v in got["model"].items():
        torch.testing.assert_close(v, direct["model"][k], rtol=1e-2, atol=2e-3, msg=f"{io}: {k}")
    if io == "stage":   # the staged copy in the node-local folder is removed once the run completed
        assert not list((tmp_path / "node-local").glob("ddp_hpc-stage-*"))
