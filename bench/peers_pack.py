"""Each peer's own packer, run once on the PNG folder that ``ddp-hpc data make-images`` wrote.

Every format stores the PNG file's bytes unchanged plus its class index, so every loader hands
``ddp_hpc.data.images.decode_image`` the same bytes that ddp_hpc's readers decode, and every
technique delivers bit-identical tensors (the coverage check relies on that: a sample is known by
the hash of its decoded tensor and label).  Settings follow each peer's documentation:

* WebDataset: ``wds.ShardWriter`` tar shards, ``<key>.png`` + ``<key>.cls`` per sample.  Its docs
  ask for at least as many shards as ranks x workers (shards are split across ranks whole) and
  for shards of 100 MB+; this dataset is 16 MB, so it gets ``SHARDS_PER_RANK`` shards per rank.
* LitData: ``litdata.optimize`` with ``chunk_bytes="64MB"``, the size its docs' examples use.
* MosaicML Streaming: ``streaming.MDSWriter`` with its default shard size limit, no compression
  (PNG is compressed already), columns ``png: bytes``, ``label: int``.
"""
from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import types

import xxhash

SHARDS_PER_RANK = 4
_DONE = "PACKED.json"


def import_streaming():
    """``import streaming`` (MosaicML).  Its package __init__ imports its torchvision-based
    vision datasets; PyPI's torchvision wheels are CUDA builds that cannot load against the CPU
    torch this project pins, so bench/setup.sh leaves torchvision out, and while streaming is
    imported a stand-in module gives ``streaming.vision`` the names it imports (the benchmark
    never uses them).  transformers, which streaming's loader imports, is imported first so that
    it records torchvision as absent; the stand-in is removed again afterwards."""
    if "streaming" in sys.modules:
        return sys.modules["streaming"]
    try:
        importlib.import_module("torchvision")
    except ImportError:
        importlib.import_module("transformers")

        stub = types.ModuleType("torchvision")
        datasets = types.ModuleType("torchvision.datasets")
        datasets.VisionDataset = type("VisionDataset", (), {})
        datasets.CIFAR10 = type("CIFAR10", (), {})
        transforms = types.ModuleType("torchvision.transforms")
        functional = types.ModuleType("torchvision.transforms.functional")
        functional.to_tensor = None
        stub.datasets, stub.transforms, transforms.functional = datasets, transforms, functional
        names = {"torchvision": stub, "torchvision.datasets": datasets, "torchvision.transforms": transforms,
                 "torchvision.transforms.functional": functional}
        sys.modules.update(names)
        try:
            importlib.import_module("streaming")
        finally:
            for name in names:
                sys.modules.pop(name, None)
    return importlib.import_module("streaming")


def sample_hash(x, label) -> int:
    """A decoded sample's identity: xxh3-64 of its tensor's bytes and its label."""
    return xxhash.xxh3_64_intdigest(x.numpy().tobytes() + int(label).to_bytes(2, "little"))


def expected_hashes(imgs: str) -> dict[int, int]:
    """hash -> sample index for every file of the folder, decoded the way every rank decodes."""
    from ddp_hpc.data.images import decode_image, list_image_folder

    _, samples = list_image_folder(imgs)
    out = {}
    for i, (rel, label) in enumerate(samples):
        with open(os.path.join(imgs, rel), "rb") as f:
            out[sample_hash(decode_image(f.read()), label)] = i
    return out


def _samples(imgs: str):
    from ddp_hpc.data.images import list_image_folder

    _, samples = list_image_folder(imgs)
    return [(os.path.join(imgs, rel), label) for rel, label in samples]


def _fresh(out: str, key: dict) -> bool:
    """True when ``out`` holds a finished pack of the same input; otherwise clears it."""
    try:
        with open(os.path.join(out, _DONE)) as f:
            if json.load(f) == key:
                return True
    except (OSError, ValueError):
        pass
    shutil.rmtree(out, ignore_errors=True)
    return False


def _finish(out: str, key: dict) -> None:
    with open(os.path.join(out, _DONE), "w") as f:
        json.dump(key, f)


def pack_wds(imgs: str, out: str, world: int) -> None:
    import webdataset as wds

    samples = _samples(imgs)
    shards = world * SHARDS_PER_RANK
    key = {"files": len(samples), "shards": shards}
    if _fresh(out, key):
        return
    os.makedirs(out)
    per_shard = -(-len(samples) // shards)
    with wds.ShardWriter(os.path.join(out, "imgs-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i, (path, label) in enumerate(samples):
            with open(path, "rb") as f:
                sink.write({"__key__": f"{i:07d}", "png": f.read(), "cls": str(label).encode()})
    _finish(out, key)


def litdata_item(sample):
    """litdata.optimize's fn: one (path, label) input -> one stored item."""
    path, label = sample
    with open(path, "rb") as f:
        return {"png": f.read(), "label": label}


def pack_litdata(imgs: str, out: str) -> None:
    import litdata

    samples = _samples(imgs)
    key = {"files": len(samples)}
    if _fresh(out, key):
        return
    litdata.optimize(fn=litdata_item, inputs=samples, output_dir=out, chunk_bytes="64MB", num_workers=1,
                     mode="overwrite", start_method="fork", verbose=False)
    _finish(out, key)


def pack_mds(imgs: str, out: str) -> None:
    samples = _samples(imgs)
    key = {"files": len(samples)}
    if _fresh(out, key):
        return
    streaming = import_streaming()
    with streaming.MDSWriter(out=out, columns={"png": "bytes", "label": "int"}) as sink:
        for path, label in samples:
            with open(path, "rb") as f:
                sink.write({"png": f.read(), "label": label})
    _finish(out, key)
