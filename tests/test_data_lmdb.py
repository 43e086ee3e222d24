"""LMDB packing, verification and reading: round trip, DataLoader workers (fork and spawn,
persistent), map growth, corrupt inputs and corrupt files refused, the CLI's exit codes."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from ddp_hpc.data import fsio
from ddp_hpc.data.cli import main as cli
from ddp_hpc.data.images import ImageFolderDataset
from ddp_hpc.data.lmdb import LMDBDataset, VerifyError, verify
from ddp_hpc.data.pack import PackError, pack
from ddp_hpc.examples.images import make_images


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return make_images(tmp_path_factory.mktemp("src") / "imgs", count=40, classes=4, size=8, progress=False)


@pytest.fixture(scope="module")
def packed(images, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "imgs.lmdb"
    pack(images, out, progress=False)
    return str(out)


def test_round_trip_is_bit_identical_to_the_image_folder(images, packed):
    direct, ds = ImageFolderDataset(images), LMDBDataset(packed)
    assert len(ds) == len(direct) == 40 and ds.classes == direct.classes == [f"class_{i:02d}" for i in range(4)]
    for i in range(len(ds)):
        (a, la), (b, lb) = ds[i], direct[i]
        assert torch.equal(a, b) and la == lb
    info = verify(packed)
    assert info["count"] == 40 and info["verified_bytes"] == sum(
        os.path.getsize(os.path.join(images, rel)) for rel, _ in direct.samples)


def test_one_open_per_process_not_per_sample(packed):
    from ddp_hpc.data import lmdb as lmdb_mod

    for env in lmdb_mod._ENVS.values():  # start as a fresh process would
        env.close()
    lmdb_mod._ENVS.clear()
    fsio.watch(os.path.dirname(packed))
    try:
        fsio.reset()
        ds = LMDBDataset(packed)
        for i in range(len(ds)):
            ds[i]
        counts = fsio.snapshot()
        assert counts["opens"] == 1
        assert counts["bytes"] == verify(packed)["verified_bytes"]
    finally:
        fsio.unwatch()


def _epochs(ds, ctx_name, epochs=2):
    loader = DataLoader(ds, batch_size=7, shuffle=False, num_workers=2, persistent_workers=True,
                        multiprocessing_context=ctx_name)
    return [[(x, y) for x, y in loader] for _ in range(epochs)]


@pytest.mark.parametrize("ctx_name", ["fork", "spawn"])
def test_workers_with_fork_and_spawn_and_persistent_workers(packed, images, ctx_name):
    ds = LMDBDataset(packed)
    ds[0]  # the parent opens its own handle first: workers must not inherit it
    parent_pid = ds._pid
    direct = ImageFolderDataset(images)
    want_x = torch.stack([direct[i][0] for i in range(len(direct))])
    want_y = torch.tensor([direct[i][1] for i in range(len(direct))])
    for epoch in _epochs(ds, ctx_name):
        assert torch.equal(torch.cat([x for x, _ in epoch]), want_x)
        assert torch.equal(torch.cat([y for _, y in epoch]), want_y)
    assert ds._pid == parent_pid  # the parent's handle is untouched
    ds[1]


def test_map_grows_on_demand(images, tmp_path):
    out = tmp_path / "small.lmdb"
    info = pack(images, out, map_size=16 << 10, txn_bytes=4 << 10, progress=False)
    assert info["map_growths"] >= 1
    assert verify(out)["count"] == 40


def test_flat_folder_of_files(tmp_path):
    src = tmp_path / "flat"
    src.mkdir()
    for i in range(5):
        (src / f"f{i}.bin").write_bytes(bytes([i]) * (i + 1))
    pack(src, tmp_path / "flat.lmdb", progress=False)
    ds = LMDBDataset(tmp_path / "flat.lmdb")
    assert ds.kind == "files" and ds.classes == []
    x, y = ds[3]
    assert y == -1 and x.dtype == torch.uint8 and x.tolist() == [3, 3, 3, 3]


def test_corrupt_image_refused_by_name_and_nothing_written(images, tmp_path):
    import shutil

    src = tmp_path / "imgs"
    shutil.copytree(images, src)
    (src / "class_01" / "zz_broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    with pytest.raises(PackError, match="zz_broken.png.*not a readable image"):
        pack(src, tmp_path / "bad.lmdb", progress=False)
    assert not (tmp_path / "bad.lmdb").exists()
    assert [p for p in os.listdir(tmp_path) if p.startswith(".tmp-pack")] == []


def _flip_inside_a_record(lmdb_dir, needle: bytes):
    path = os.path.join(lmdb_dir, "data.mdb")
    data = bytearray(open(path, "rb").read())
    at = data.find(needle)
    assert at > 0
    data[at + len(needle) // 2] ^= 0xFF
    with open(path, "wb") as f:
        f.write(data)


def test_corrupt_lmdb_refused_by_verify_and_cli(images, tmp_path, capsys):
    out = tmp_path / "c.lmdb"
    pack(images, out, progress=False)
    victim = ImageFolderDataset(images).samples[17][0]
    _flip_inside_a_record(out, open(os.path.join(images, victim), "rb").read()[20:60])
    with pytest.raises(VerifyError, match=r"record 17 \(" + victim + r"\) fails its checksum"):
        verify(out)
    assert cli(["verify", str(out)]) == 2
    assert "HINT" in capsys.readouterr().err


def test_truncated_lmdb_refused(packed, tmp_path):
    bad = tmp_path / "t.lmdb"
    bad.mkdir()
    data = open(os.path.join(packed, "data.mdb"), "rb").read()
    (bad / "data.mdb").write_bytes(data[: len(data) // 3])
    with pytest.raises(VerifyError):
        verify(bad)


def test_cli_pack_verify_and_refuse_overwrite(images, tmp_path, capsys):
    out = str(tmp_path / "cli.lmdb")
    assert cli(["pack", images, out, "--map-size", "32k"]) == 0
    assert "packed 40 files" in capsys.readouterr().out
    assert cli(["verify", out]) == 0
    assert "checksums match" in capsys.readouterr().out
    before = os.path.getmtime(os.path.join(out, "data.mdb"))
    assert cli(["pack", images, out]) == 2
    assert "already exists" in capsys.readouterr().err
    assert os.path.getmtime(os.path.join(out, "data.mdb")) == before
    assert cli(["verify", str(tmp_path / "missing.lmdb")]) == 2
    assert cli(["pack", str(tmp_path / "nope"), str(tmp_path / "x.lmdb")]) == 2


def test_missing_image_folder_names_the_config_keys(tmp_path):
    from ddp_hpc.data.images import ImageFolderError

    with pytest.raises(FileNotFoundError, match=r"root '.*/eval' is not a directory\nHINT: point root at the image "
                                                r"folder: data.kwargs.root for data.dataset, data.eval_kwargs.root "
                                                r"for data.eval_dataset"):
        ImageFolderDataset(tmp_path / "eval")
    assert issubclass(ImageFolderError, FileNotFoundError)
    with pytest.raises(ValueError, match=r"count=0.*\nHINT: use count >= 1"):
        make_images(tmp_path / "x", count=0)


@pytest.mark.parametrize("txn_bytes", [64 << 20, 64 << 10])
def test_packed_file_is_at_most_1_3x_its_payload_for_800_byte_records(tmp_path, txn_bytes):
    import random

    rng = random.Random(3)
    src = tmp_path / "recs"
    src.mkdir()
    sizes = [rng.randint(700, 900) for _ in range(3000)]
    for i, n in enumerate(sizes):
        (src / f"r{i:05d}.bin").write_bytes(rng.randbytes(n))
    info = pack(src, tmp_path / "recs.lmdb", txn_bytes=txn_bytes, progress=False)
    size = os.path.getsize(tmp_path / "recs.lmdb" / "data.mdb")
    assert info["bytes"] == sum(sizes)
    assert size <= 1.3 * sum(sizes), f"{size} bytes for {sum(sizes)} of payload ({size / sum(sizes):.2f}x)"
    ds = LMDBDataset(tmp_path / "recs.lmdb")
    assert verify(tmp_path / "recs.lmdb")["verified_bytes"] == sum(sizes)
    assert [len(ds.raw_item(i)[0]) for i in range(0, 3000, 7)] == sizes[::7]


def test_raw_batch_negative_and_missing_indices(packed, images):
    from ddp_hpc.data.errors import RecordIndexError

    ds, direct = LMDBDataset(packed), ImageFolderDataset(images)
    want = [direct.raw_item(i) for i in range(len(direct))]
    assert list(zip(*ds.raw_batch([3, 0, 39, 3]))) == [want[3], want[0], want[39], want[3]]
    assert ds.raw_item(-1) == want[-1] and ds.raw_item(-40) == want[0]  # as a list counts
    for bad in (40, -41, 10**12):
        with pytest.raises(RecordIndexError, match=rf"no record {bad} \(0\.\.39\)"):
            ds.raw_item(bad)
    with pytest.raises(RecordIndexError, match=r"no record 40 "):
        ds.raw_batch([1, 40, 2])
    assert ds.raw_batch([]) == ([], [])


def test_big_datasets_format_keys_instead_of_caching_them(monkeypatch, packed, images):
    from ddp_hpc.data import lmdb as lmdb_mod
    from ddp_hpc.data.errors import RecordIndexError

    monkeypatch.setattr(lmdb_mod, "KEY_CACHE_MAX", 10)
    ds, direct = LMDBDataset(packed), ImageFolderDataset(images)
    assert not isinstance(ds._key, type([].__getitem__))
    assert ds.raw_item(25) == direct.raw_item(25) and ds.raw_item(-1) == direct.raw_item(39)
    assert list(zip(*ds.raw_batch([39, 5]))) == [direct.raw_item(39), direct.raw_item(5)]
    with pytest.raises(RecordIndexError):
        ds.raw_item(40)


def test_handles_are_reopened_after_close_all_and_fork(packed):
    import multiprocessing as mp

    from ddp_hpc.data import lmdb as lmdb_mod

    ds = LMDBDataset(packed)
    first = ds.raw_item(5)
    txn = ds._txn
    lmdb_mod.close_all()
    assert ds._txn is None and ds.raw_item(5) == first and ds._txn is not txn
    global _INHERITED
    _INHERITED = ds  # inherited through fork, not pickled: the child must not use our handle
    try:
        with mp.get_context("fork").Pool(1) as pool:
            before, child_pid, child_first, after = pool.apply(_read_inherited)
    finally:
        _INHERITED = None
    assert before is None and after == child_pid != os.getpid() and child_first == first
    assert ds._pid == os.getpid()


_INHERITED = None


def _read_inherited():
    before = _INHERITED._pid  # forgotten at fork
    value = _INHERITED.raw_item(5)
    return before, os.getpid(), value, _INHERITED._pid


def test_parallel_pack_is_byte_identical_to_one_worker_and_refuses_a_corrupt_image(images, tmp_path):
    """3 worker processes write the same data.mdb, byte for byte, as 1 (the records in key order,
    whatever worker read them); a corrupt image among many chunks is refused by name with
    nothing written; the shared opens are counted once per file across the workers."""
    import shutil

    from ddp_hpc.data import fsio

    src = tmp_path / "imgs"
    shutil.copytree(images, src)
    for i in range(300):   # several chunks per worker
        shutil.copy(src / "class_00" / sorted(os.listdir(src / "class_00"))[0], src / "class_02" / f"more{i:03d}.png")
    fsio.watch(src)
    try:
        one = pack(src, tmp_path / "one.lmdb", progress=False, workers=1)
        assert fsio.snapshot()["opens"] == 340
        fsio.reset()
        many = pack(src, tmp_path / "many.lmdb", progress=False, workers=3)
        assert fsio.snapshot()["opens"] == 340
    finally:
        fsio.unwatch()
    assert (one["workers"], many["workers"], many["count"]) == (1, 3, 340)
    assert (tmp_path / "one.lmdb" / "data.mdb").read_bytes() == (tmp_path / "many.lmdb" / "data.mdb").read_bytes()
    (src / "class_02" / "more250.png").write_bytes(b"\x89PNG\r\n\x1a\nbroken")
    with pytest.raises(PackError, match="more250.png.*not a readable image"):
        pack(src, tmp_path / "bad.lmdb", progress=False, workers=3)
    assert not (tmp_path / "bad.lmdb").exists()
    assert [p for p in os.listdir(tmp_path) if p.startswith(".tmp-pack")] == []


def test_pack_from_webdataset_shards_keeps_samples_labels_and_order(images, tmp_path):
    """WebDataset shards (KEY.png + KEY.cls, two .tar files in a folder) pack to the same images
    and labels, in shard and key order; `ddp-hpc data verify` passes on the result."""
    import io
    import tarfile

    from ddp_hpc.data.images import list_image_folder
    from ddp_hpc.data.lmdb import LMDBDataset, verify

    _, listing = list_image_folder(str(images))
    shards = tmp_path / "shards"
    shards.mkdir()
    want = []
    for s in range(2):
        with tarfile.open(shards / f"train-{s:04d}.tar", "w") as tf:
            for k, (rel, label) in enumerate(listing[s * 20:(s + 1) * 20]):
                data = (Path(images) / rel).read_bytes()
                for ext, payload in (("png", data), ("cls", str(label).encode())):
                    info = tarfile.TarInfo(f"s{k:05d}.{ext}")
                    info.size = len(payload)
                    tf.addfile(info, io.BytesIO(payload))
                want.append((data, label))
    out = pack(shards, tmp_path / "wds.lmdb", progress=False, workers=2)
    assert (out["count"], out["kind"]) == (40, "images")
    ds = LMDBDataset(tmp_path / "wds.lmdb")
    assert [ds.raw_item(i) for i in range(40)] == want
    assert verify(tmp_path / "wds.lmdb")["count"] == 40
    ds.close()
    one = pack(shards / "train-0001.tar", tmp_path / "one.lmdb", progress=False, workers=1)
    assert one["count"] == 20


def test_image_check_refuses_damaged_pngs_and_passes_every_png_pillow_reads():
    """pack's PNG check (chunk CRCs, complete image data) against Pillow: every mode Pillow
    writes passes (interlaced ones go to Pillow), and a cut or a flipped byte anywhere is
    refused wherever Pillow refuses it too (and never passes where Pillow fails)."""
    import io

    from PIL import Image

    from ddp_hpc.data.imagecheck import check_image
    from ddp_hpc.data.images import decode_image

    pngs = []
    for mode in ("1", "L", "LA", "P", "RGB", "RGBA", "I;16"):
        for interlace in (0, 1):
            buf = io.BytesIO()
            Image.new(mode, (13, 7), color=1).save(buf, "PNG", interlace=interlace)
            pngs.append(buf.getvalue())
    for data in pngs:
        check_image(data)
    for data in pngs:
        for cut in (len(data) - 1, len(data) // 2, 20):
            with pytest.raises((ValueError, OSError, SyntaxError)):   # ours, or Pillow's
                check_image(data[:cut])
        for at in range(8, len(data), 3):
            bad = bytearray(data)
            bad[at] ^= 0x04
            try:
                decode_image(bytes(bad))
                pillow = True
            except Exception:
                pillow = False
            try:
                check_image(bytes(bad))
                ours = True
            except Exception:
                ours = False
            assert pillow or not ours, (at, data[:40])
