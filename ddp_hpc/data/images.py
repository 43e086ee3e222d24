"""Image folders: many small image files, the case that hurts shared filesystems.

* :class:`ImageFolderDataset` reads ROOT/<class>/<file> file by file (one open per sample: the
  "direct" IO path); :func:`list_image_folder` lists it in a stable order.
* :func:`decode_image` is the single decode shared with :class:`ddp_hpc.data.lmdb.LMDBDataset`,
  so every IO technique yields bit-identical tensors and training reaches identical metrics.
* ``ddp_hpc.examples.images.make_images`` writes a demo folder of this layout.

The raw/decode split (``raw_item`` returns encoded bytes, ``decode_item`` turns them into a
sample) lets the group-broadcast loader ship compact encoded bytes and decode on the receiver.
"""
from __future__ import annotations

import io
import os

import numpy as np
import torch

from ddp_hpc.data import fsio
from ddp_hpc.errors import HintError

__all__ = ["ImageFolderDataset", "decode_image", "list_image_folder", "IMAGE_SUFFIXES", "ImageFolderError"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".gif")
_MAKE = "python -m ddp_hpc.data make-images ROOT writes a demo one"


class ImageFolderError(HintError, FileNotFoundError):
    """An image folder that is missing or not laid out as ROOT/<class>/<file>."""


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
