"""Is this a readable image?  ``pack``'s check, cheaper than decoding every pixel.

A PNG (the common case of many small files) is checked by its structure: the signature, every
chunk's length and CRC-32, ``IHDR`` first with a valid bit depth and colour type, ``IEND`` last,
and the ``IDAT`` data inflating completely to exactly the bytes its header calls for (rows of
``1 + ceil(width x channels x depth / 8)`` bytes; Adam7-interlaced PNGs are decoded by Pillow
instead).  A file damaged or cut short fails one of these, as Pillow's decoder would.  Any other
format is decoded by Pillow (:func:`ddp_hpc.data.images.decode_image`).  Raises ``ValueError``
(or Pillow's error) naming what is wrong.
"""
from __future__ import annotations

import struct
import zlib

from ddp_hpc.data.images import decode_image

__all__ = ["check_image"]

_PNG = b"\x89PNG\r\n\x1a\n"
_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}                 # colour type -> samples per pixel
_DEPTHS = {0: (1, 2, 4, 8, 16), 2: (8, 16), 3: (1, 2, 4, 8), 4: (8, 16), 6: (8, 16)}


def _png_chunks(data: bytes):
    off = len(_PNG)
    while off + 12 <= len(data):
        n, kind = struct.unpack_from(">I4s", data, off)
        end = off + 8 + n
        if end + 4 > len(data):
            raise ValueError(f"PNG chunk {kind!r} runs past the end of the file (cut short?)")
        if zlib.crc32(memoryview(data)[off + 4:end]) != struct.unpack_from(">I", data, end)[0]:
            raise ValueError(f"PNG chunk {kind!r} at byte {off} fails its CRC")
        yield kind, memoryview(data)[off + 8:end]
        off = end + 4
    if off != len(data):
        raise ValueError("PNG ends inside a chunk header (cut short?)")


def _check_png(data: bytes) -> bool:
    """True when the PNG checked out; False for an interlaced one (left to Pillow)."""
    chunks = list(_png_chunks(data))
    if not chunks or chunks[0][0] != b"IHDR" or len(chunks[0][1]) != 13 or chunks[-1][0] != b"IEND":
        raise ValueError("PNG does not start with IHDR and end with IEND")
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    if colour not in _CHANNELS or depth not in _DEPTHS[colour] or not width or not height:
        raise ValueError(f"PNG header: {width}x{height}, bit depth {depth}, colour type {colour}")
    if interlace:
        return False
    inflate = zlib.decompressobj()
    raw = inflate.decompress(b"".join(bytes(body) for kind, body in chunks if kind == b"IDAT"))
    want = height * (1 + (width * _CHANNELS[colour] * depth + 7) // 8)
    if not inflate.eof or len(raw) != want:
        raise ValueError(f"PNG image data inflates to {len(raw)} bytes (complete: {inflate.eof}), "
                         f"{want} expected")
    return True


def check_image(data: bytes) -> None:
    """Raise when ``data`` is not a readable image (see the module's docstring)."""
    if data.startswith(_PNG) and _check_png(data):
        return
    decode_image(data)
