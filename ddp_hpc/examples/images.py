"""The image-folder demo: a dataset of many small image files and a model that learns it.

* :func:`make_images` writes a class-per-folder dataset of small PNG files (pillow) whose classes
  differ in colour and stripe orientation, so a tiny CNN learns them in a few epochs;
  ``ddp_hpc.data.images.ImageFolderDataset`` reads it.
* :func:`small_cnn` is the model the ``jobs/images.yaml`` job trains.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import tempfile

import numpy as np
from torch import nn
from tqdm import tqdm

from ddp_hpc.errors import HintError

__all__ = ["make_images", "small_cnn", "ImagesExistError", "ImageParamsError"]

_MARKER = ".ddp_hpc_images.json"


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


def small_cnn(num_classes: int = 10, in_channels: int = 3, width: int = 16) -> nn.Module:
    """A tiny CNN for small images (a few thousand parameters: trains on CPU in seconds)."""
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(width, width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(width, num_classes),
    )
