"""``ddp-hpc data pack`` from a Hugging Face ``datasets`` folder written by ``save_to_disk``:
samples, labels and order kept, byte-identical for any number of workers, a corrupt image
refused by name with nothing written, a DatasetDict refused with its splits named, and the
error when ``datasets`` is not installed (a test-only dependency, requirements-ci.txt)."""
from __future__ import annotations

import io
import os
import sys

import pytest

from ddp_hpc.data import fsio
from ddp_hpc.data.cli import main as cli
from ddp_hpc.data.lmdb import LMDBDataset
from ddp_hpc.data.pack import PackError, pack


def _png(i: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (5, 3), color=(i * 7 % 256, i % 3, 200)).save(buf, "PNG")
    return buf.getvalue()


def _save(path, images: list[bytes], labels: list[int], names=("cat", "dog", "eel")) -> str:
    import datasets

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(names)),
                                  "caption": datasets.Value("string")})
    ds = datasets.Dataset.from_dict({"image": [{"bytes": b, "path": None} for b in images], "label": labels,
                                     "caption": [f"row {i}" for i in range(len(images))]}, features=features)
    datasets.disable_progress_bars()
    ds.save_to_disk(str(path))
    return str(path)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    images = [_png(i) for i in range(150)]   # 3 chunks of 64 rows: several per worker
    labels = [i % 3 for i in range(150)]
    return _save(tmp_path_factory.mktemp("hf") / "train", images, labels), images, labels


def test_pack_from_save_to_disk_keeps_images_labels_order_and_verifies(hf, tmp_path, capsys):
    """One CLI command packs the folder; `ddp-hpc data verify` passes; every record is the source
    row's PNG bytes, its label the ClassLabel index, the classes its names; the Arrow file is the
    one shared open; 2 workers write the same data.mdb, byte for byte, as 1."""
    src, images, labels = hf
    out = str(tmp_path / "hf.lmdb")
    fsio.watch(src)
    try:
        assert cli(["pack", src, out, "--workers", "1"]) == 0
        assert fsio.snapshot()["opens"] == 1
    finally:
        fsio.unwatch()
    assert "packed 150 files" in capsys.readouterr().out
    assert cli(["verify", out]) == 0
    assert "checksums match" in capsys.readouterr().out
    ds = LMDBDataset(out)
    assert (len(ds), ds.kind, ds.classes) == (150, "images", ["cat", "dog", "eel"])
    assert [ds.raw_item(i) for i in range(150)] == list(zip(images, labels))
    x, y = ds[4]
    assert tuple(x.shape) == (3, 3, 5) and y == 1
    ds.close()
    many = pack(src, tmp_path / "two.lmdb", progress=False, workers=2)
    assert (many["workers"], many["count"]) == (2, 150)
    assert (tmp_path / "two.lmdb" / "data.mdb").read_bytes() == open(os.path.join(out, "data.mdb"), "rb").read()


def test_binary_column_and_int_labels_map_like_webdataset(tmp_path):
    """A plain binary column `png` with an integer `cls` column (a WebDataset converted to
    datasets) packs with classes "0".."max", as `.cls` members do."""
    import datasets

    images = [_png(i) for i in range(5)]
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"png": images, "cls": [0, 4, 2, 4, 1], "__key__": list("abcde")}) \
        .save_to_disk(str(tmp_path / "wds"))
    info = pack(tmp_path / "wds", tmp_path / "out.lmdb", progress=False, workers=1)
    assert (info["count"], info["classes"]) == (5, ["0", "1", "2", "3", "4"])
    ds = LMDBDataset(tmp_path / "out.lmdb")
    assert [ds.raw_item(i) for i in range(5)] == list(zip(images, [0, 4, 2, 4, 1]))
    ds.close()


def test_corrupt_image_refused_by_name_and_nothing_written(tmp_path):
    images = [_png(i) for i in range(100)]
    images[70] = images[70][:-20]   # cut: the IEND chunk and part of IDAT are gone
    src = _save(tmp_path / "bad", images, [0] * 100)
    with pytest.raises(PackError, match=r"'bad/70' is not a readable image"):
        pack(src, tmp_path / "bad.lmdb", progress=False, workers=2)
    assert not (tmp_path / "bad.lmdb").exists()
    assert [p for p in os.listdir(tmp_path) if p.startswith(".tmp-pack")] == []


def test_dataset_dict_refused_naming_its_splits(tmp_path):
    import datasets

    datasets.disable_progress_bars()
    one = datasets.Dataset.from_dict({"image": [_png(0)]}).cast_column("image", datasets.Image())
    datasets.DatasetDict({"train": one, "test": one}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(PackError, match=r"DatasetDict with the splits \['train', 'test'\]") as e:
        pack(tmp_path / "dd", tmp_path / "dd.lmdb", progress=False)
    assert os.path.join(str(tmp_path / "dd"), "train") in e.value.hint
    assert not (tmp_path / "dd.lmdb").exists()


def test_without_datasets_installed_the_error_names_the_folder_and_the_install(hf, tmp_path, monkeypatch, capsys):
    """`datasets` not importable (None in sys.modules makes `import datasets` raise ImportError,
    as on a machine without it): exit 2, the folder and `pip install datasets` named, nothing written."""
    src, _, _ = hf
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert cli(["pack", src, str(tmp_path / "x.lmdb")]) == 2
    err = capsys.readouterr().err
    assert src in err and "Hugging Face datasets folder" in err and "pip install datasets" in err
    assert os.listdir(tmp_path) == []


def test_arrow_rows_stay_views_of_the_file_until_their_chunk_is_read(hf):
    """The source's samples are views of the memory-mapped Arrow file, not copies; read_in_order
    copies them to bytes one chunk (CHUNK_FILES samples) at a time, as the chunk is taken."""
    import pyarrow as pa

    from ddp_hpc.data.packsources import CHUNK_FILES, open_source, read_in_order

    src, images, _ = hf
    _, _, samples = open_source(src)
    assert all(isinstance(where, pa.Buffer) for _, _, where in samples)

    class Counted:
        copied = 0

        def __init__(self, where):
            self.where = where

        def __bytes__(self):
            Counted.copied += 1
            return bytes(self.where)

    payloads = read_in_order([(n, y, Counted(w)) for n, y, w in samples], check=True, workers=1)
    assert next(payloads) == images[0] and Counted.copied == CHUNK_FILES
    assert list(payloads) == images[1:] and Counted.copied == len(images)
