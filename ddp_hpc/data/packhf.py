"""A Hugging Face ``datasets`` folder (``Dataset.save_to_disk``) as a ``pack`` source.

Such a folder holds ``state.json``, ``dataset_info.json`` and the Arrow files; it is read with
``datasets.load_from_disk`` (``datasets`` is an optional dependency: ``pip install datasets`` or
``ddp_hpc[hf]``).  Mapped the way a WebDataset shard set is (:mod:`ddp_hpc.data.packsources`):

* the payload is the image column's encoded bytes, unchanged: the column of type
  ``datasets.Image`` (stored as ``{bytes, path}``), else a binary column; with several, the one
  named ``image``, ``img``, ``png``, ``jpg``, ... (an image suffix);
* the label is a ``ClassLabel`` column (its names become the classes), else an integer column
  named ``label``, ``labels``, ``cls``, ``class`` or ``target`` (classes ``"0" .. "max"``, as
  for ``.cls`` members); -1 without one, or for a missing (null) label;
* records keep row order and are named ``FOLDER/ROW``, plus ``:FILE`` when the image column
  kept the name of the file it came from.

Each sample's ``where`` is a zero-copy view (a ``pyarrow.Buffer``) of the memory-mapped Arrow
files (their opens are counted with :mod:`ddp_hpc.data.fsio`): the packing process copies a
chunk's bytes out only as it hands the chunk to a pack worker
(:func:`ddp_hpc.data.packsources.read_in_order`), so it holds the chunks in flight, not the
dataset's bytes.
A ``DatasetDict`` folder (``dataset_dict.json``, one sub-folder per split) is refused with its
splits named: pack one split folder at a time.
"""
from __future__ import annotations

import json
import os

from ddp_hpc.data import fsio
from ddp_hpc.data.errors import PackError
from ddp_hpc.data.images import IMAGE_SUFFIXES

__all__ = ["is_hf_folder", "hf_source"]

_IMAGE_NAMES = ("image", "img") + tuple(s.lstrip(".") for s in IMAGE_SUFFIXES) + ("webp",)
_LABEL_NAMES = ("label", "labels", "cls", "class", "target")
_INSTALL = "pip install datasets (or pip install 'ddp_hpc[hf]'), then run the pack again"


def is_hf_folder(src: str) -> bool:
    """Is ``src`` a folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``?"""
    has = lambda name: os.path.isfile(os.path.join(src, name))  # noqa: E731
    return os.path.isdir(src) and (has("dataset_dict.json") or (has("state.json") and has("dataset_info.json")))


def _load(src: str):
    """The ``datasets.Dataset`` saved at ``src``; PackError when ``datasets`` is missing or it is a DatasetDict."""
    try:
        import datasets
    except ImportError as e:
        raise PackError(f"pack: {src!r} is a Hugging Face datasets folder (save_to_disk); reading it needs "
                        f"the `datasets` package, which cannot be imported here ({e})", _INSTALL) from None
    manifest = os.path.join(src, "dataset_dict.json")
    if os.path.isfile(manifest):
        with open(manifest, encoding="utf-8") as f:
            splits = json.load(f).get("splits") or []
        first = os.path.join(src, splits[0]) if splits else os.path.join(src, "SPLIT")
        raise PackError(f"pack: {src!r} is a Hugging Face DatasetDict with the splits {splits}, not one dataset",
                        f"pack one split at a time: pass {first!r} as SRC")
    try:
        return datasets.load_from_disk(src)
    except Exception as e:  # datasets raises several types for a damaged folder
        raise PackError(f"pack: cannot load the Hugging Face datasets folder {src!r} ({type(e).__name__}: {e})",
                        "pass a folder written by Dataset.save_to_disk, complete (state.json, dataset_info.json "
                        "and its .arrow files)") from None


def _pick(candidates: list[str], preferred: tuple[str, ...]) -> str | None:
    if len(candidates) == 1:
        return candidates[0]
    return next((c for c in candidates if c.lower() in preferred), None)


def _image_column(features, src: str) -> tuple[str, bool]:
    """-> (the column holding the encoded images, whether it is a ``datasets.Image`` struct)."""
    import datasets

    images = [n for n, f in features.items() if isinstance(f, datasets.Image)]
    binary = [n for n, f in features.items()
              if isinstance(f, datasets.Value) and f.dtype in ("binary", "large_binary")]
    name = _pick(images, _IMAGE_NAMES) or (None if images else _pick(binary, _IMAGE_NAMES))
    if name is None:
        found = {n: type(f).__name__ if not isinstance(f, datasets.Value) else f.dtype for n, f in features.items()}
        raise PackError(f"pack: no single image column in the Hugging Face dataset {src!r} (columns: {found})",
                        "give it one column of type datasets.Image (or of encoded image bytes), or name the one "
                        f"to pack one of {', '.join(_IMAGE_NAMES)}")
    return name, name in images


def _label_column(features) -> tuple[str | None, list[str] | None]:
    """-> (the label column or None, the ClassLabel names or None)."""
    import datasets

    named = [n for n, f in features.items() if isinstance(f, datasets.ClassLabel)]
    name = _pick(named, _LABEL_NAMES) or (named[0] if named else None)
    if name is not None:
        return name, list(features[name].names)
    ints = [n for n, f in features.items() if isinstance(f, datasets.Value) and "int" in f.dtype
            and n.lower() in _LABEL_NAMES]
    return (ints[0] if ints else None), None


def hf_source(src: str) -> tuple[str, list[str], list[tuple[str, int, object]]]:
    """``(kind, classes, samples)`` of the ``save_to_disk`` folder ``src`` (see the module text)."""
    ds = _load(src)
    for f in ds.cache_files:
        fsio.note_open(f["filename"])
    image, is_struct = _image_column(ds.features, src)
    label, classes = _label_column(ds.features)
    table = ds.select_columns([c for c in (image, label) if c]).with_format("arrow")[:]
    column = table.column(image)
    chunks = [c.field("bytes") for c in column.chunks] if is_struct else column.chunks
    payloads = [v.as_buffer() for c in chunks for v in c]  # views of the mapped file, no copy
    paths = [p for c in column.chunks for p in c.field("path").to_pylist()] if is_struct else [None] * len(payloads)
    labels = [-1 if y is None else int(y) for y in table.column(label).to_pylist()] if label else [-1] * len(payloads)
    base, width = os.path.basename(src.rstrip(os.sep)), len(str(max(len(payloads) - 1, 0)))
    samples = []
    for i, (data, path, y) in enumerate(zip(payloads, paths, labels)):
        name = f"{base}/{i:0{width}d}" + (f":{os.path.basename(path)}" if path else "")
        if data is None:
            raise PackError(f"pack: row {i} ({name}) of the Hugging Face dataset {src!r} holds no image bytes "
                            f"in column {image!r}" + (f" (only the path {path!r})" if path else ""),
                            "save the dataset with its images embedded (save_to_disk embeds local files), "
                            "or remove the row")
        samples.append((name, y, data))
    if not samples:
        raise PackError(f"pack: the Hugging Face dataset {src!r} has no rows", "point SRC at a dataset with rows")
    if classes is None:
        classes = [str(i) for i in range(max(y for _, y, _ in samples) + 1)]
    return "images", classes, samples
