"""The image-folder example: many small image files, the case that hurts shared filesystems.

* :func:`make_images` writes a class-per-folder dataset of small PNG files (pillow) whose classes
  differ in colour and stripe orientation, so a tiny CNN learns them in a few epochs.
* :class:`ImageFolderDataset` reads it file by file (one open per sample: the "direct" IO path).
* :func:`decode_image` is the single decode shared with :class:`ddp_hpc.data.lmdb.LMDBDataset`,
  so every IO technique yields bit-identical tensors and training reaches identical metrics.
* :func:`small_cnn` is the model the ``jobs/images.yaml`` job trains.

The raw/decode split (``raw_item`` returns encoded bytes, ``decode_item`` turns them into a
sample) lets the group-broadcast loader ship compact encoded bytes and decode on the receiver.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import tempfile

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from ddp_hpc.data import fsio
from ddp_hpc.errors import HintError

__all__ = ["make_images", "ImageFolderDataset", "decode_image", "small_cnn", "IMAGE_SUFFIXES",
           "ImageFolderError", "ImagesExistError", "ImageParamsError"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".gif")
_MARKER = ".ddp_hpc_images.json"
_MAKE = "python -m ddp_hpc.data make-images ROOT writes a demo one"


class ImageFolderError(HintError, FileNotFoundError):
    """An image folder that is missing or not laid out as ROOT/<class>/<file>."""


class ImagesExistError(HintError, FileExistsError):
    """make_images would overwrite a folder it did not make with these parameters."""


class ImageParamsError(HintError, ValueError):
    """make_images parameters that cannot make a dataset."""


def _render(rng: np.random.Generator, label: int, classes: int, size: int) -> np.ndarray:
    """A noisy image whose hue and stripe direction encode the class."""
    hue = np.array([np.cos(2 * np.pi * label / classes), np.sin(2 * np.pi * label / classes), (label % 3) / 2.0])
    base = 0.5 + 0.35 * hue
    yy, xx = np.mgrid[0:size, 0:size]
    stripes = np.sin((xx if label % 2 else yy) * (0.6 + 0.1 * (label % 4)))
    img = base[None, None, :] + 0.15 * stripes[..., None] + rng.normal(0.0, 0.08, (size, size, 3))
    return (np.clip(img, 0.0, 1.0) * 255).astype(np.uint8)


def make_images(root: str | os.PathLike, count: int = 2000, classes: int = 10, size: int = 16,
                seed: int = 0, progress: bool | None = None) -> str:
    """Write ``count`` PNG files into ``root/class_XX/NNNNNNN.png`` and return ``root``.

    Atomic: files go to a temporary sibling folder that is renamed into place, so an interrupted
    run leaves nothing half-made; an existing ``root`` made with the same parameters is reused,
    any other existing ``root`` is refused rather than overwritten.
    """
    from PIL import Image  # pillow: the images extra, needed only here and to decode

    root = os.path.abspath(os.fspath(root))
    params = {"count": int(count), "classes": int(classes), "size": int(size), "seed": int(seed)}
    if count < 1 or classes < 1 or size < 4:
        raise ImageParamsError(f"make_images: count={count}, classes={classes}, size={size}",
                               "use count >= 1, classes >= 1, size >= 4")
    if os.path.exists(root):
        marker = os.path.join(root, _MARKER)
        if os.path.isfile(marker):
            with open(marker) as f:
                if json.load(f) == params:
                    return root
        raise ImagesExistError(f"make_images: {root} already exists and was not made with {params}",
                               "choose a new folder or remove the old one yourself")
    parent = os.path.dirname(root)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-images-", dir=parent)
    try:
        rng = np.random.default_rng(seed)
        for c in range(classes):
            os.mkdir(os.path.join(tmp, f"class_{c:02d}"))
        show = progress if progress is not None else os.isatty(2)
        for i in tqdm(range(count), desc="make-images", disable=not show, unit="img"):
            label = i % classes
            buf = io.BytesIO()
            Image.fromarray(_render(rng, label, classes, size)).save(buf, format="PNG", compress_level=1)
            with open(os.path.join(tmp, f"class_{label:02d}", f"{i:07d}.png"), "wb") as f:
                f.write(buf.getvalue())
        with open(os.path.join(tmp, _MARKER), "w") as f:
            json.dump(params, f)
        os.rename(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root


def decode_image(data: bytes) -> torch.Tensor:
    """Encoded image bytes -> float tensor [3, H, W] in [0, 1] (shared by every IO path)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        arr = np.asarray(im.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).float().div_(255.0)


def list_image_folder(root: str) -> tuple[list[str], list[tuple[str, int]]]:
    """Classes (sorted sub-folders) and (relative path, label) pairs in a stable order."""
    classes = sorted(d.name for d in os.scandir(root) if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise ImageFolderError(f"image folder {root} has no class sub-folders",
                               f"lay it out as ROOT/<class>/<file>.png ({_MAKE})")
    samples = []
    for label, cls in enumerate(classes):
        names = sorted(e.name for e in os.scandir(os.path.join(root, cls))
                       if e.is_file() and e.name.lower().endswith(IMAGE_SUFFIXES))
        samples.extend((f"{cls}/{n}", label) for n in names)
    return classes, samples


class ImageFolderDataset(torch.utils.data.Dataset):
    """Class-per-folder images read file by file: one shared-filesystem open per sample."""

    def __init__(self, root: str | os.PathLike, *, _listing=None):
        self.root = os.path.abspath(os.fspath(root))
        if not os.path.isdir(self.root):
            raise ImageFolderError(f"ImageFolderDataset: root {self.root!r} is not a directory",
                                   "point root at the image folder: data.kwargs.root for data.dataset, "
                                   f"data.eval_kwargs.root for data.eval_dataset ({_MAKE})")
        self.classes, self.samples = _listing or list_image_folder(self.root)

    def __len__(self) -> int:
        return len(self.samples)

    def raw_item(self, index: int) -> tuple[bytes, int]:
        rel, label = self.samples[index]
        return fsio.read_bytes(os.path.join(self.root, rel)), label

    @staticmethod
    def decode_item(data: bytes, label: int):
        return decode_image(data), label

    def __getitem__(self, index: int):
        return self.decode_item(*self.raw_item(index))

    def relocated(self, new_root: str) -> "ImageFolderDataset":
        """The same samples read from a copy of the folder (node-local staging)."""
        return ImageFolderDataset(new_root, _listing=(self.classes, self.samples))


def small_cnn(num_classes: int = 10, in_channels: int = 3, width: int = 16) -> nn.Module:
    """A tiny CNN for small images (a few thousand parameters: trains on CPU in seconds)."""
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(width, width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(width, num_classes),
    )
