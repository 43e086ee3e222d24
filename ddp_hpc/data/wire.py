"""The broadcast loader's wire format: one member's samples as one byte string, and bundles of them.

A message is a small header of int64s (sample count, a kind flag, then per sample either
(encoded length, label) for raw items or, for tensors, rows of dtype code, ndim, shape and byte
count) followed by the bytes, back to back.  Raw items are a dataset's compact encoded bytes
(``raw_item``), decoded on the receiver (``decode_item``); anything else ships its tensors.
A bundle joins several messages (one per step, or one per node) with their lengths in front, so
one collective can carry a bucket of steps.
"""
from __future__ import annotations

import struct

import torch

from ddp_hpc.data.errors import SampleError

__all__ = ["encode_samples", "decode_samples", "bundle", "unbundle"]

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
           torch.int16, torch.int32, torch.int64, torch.bool]
_CODE = {d: i for i, d in enumerate(_DTYPES)}
_MAXDIM = 6
_ROW = 2 + _MAXDIM + 1  # dtype, ndim, shape..., nbytes


def _i64(values) -> bytes:
    return struct.pack(f"<{len(values)}q", *values)


def _tensor_row(t: torch.Tensor) -> list[int]:
    if t.dtype not in _CODE or t.dim() > _MAXDIM:
        raise SampleError(f"broadcast loader cannot ship a {t.dtype} tensor of shape {tuple(t.shape)}",
                          f"samples must be tensors of <= {_MAXDIM} dims with a plain dtype")
    shape = list(t.shape) + [0] * (_MAXDIM - t.dim())
    return [_CODE[t.dtype], t.dim(), *shape, t.numel() * t.element_size()]


def _as_tensor(v) -> torch.Tensor:
    return v if isinstance(v, torch.Tensor) else torch.tensor(v)


def encode_samples(items: list, raw: bool) -> bytes:
    """Header + bytes for one member's samples: raw items are (bytes, label), others (x, y)."""
    if raw:
        head = [len(items), 0] + [v for data, label in items for v in (len(data), int(label))]
        return _i64(head) + b"".join(data for data, _ in items)
    rows, blobs = [], []
    for sample in items:
        if not isinstance(sample, (tuple, list)) or len(sample) != 2:
            raise SampleError(f"broadcast loader expects samples (input, target); got {type(sample).__name__}",
                              "return an (input, target) pair from the dataset's __getitem__")
        for v in sample:
            t = _as_tensor(v).contiguous().cpu()
            rows += _tensor_row(t)
            blobs.append(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return _i64([len(items), 1] + rows) + b"".join(blobs)


def decode_samples(buf: bytes, decode_item=None) -> list:
    """Inverse of :func:`encode_samples`; raw items are passed through ``decode_item``."""
    n, kind = struct.unpack_from("<2q", buf, 0)
    off = 16
    out = []
    if kind == 0:
        head = struct.unpack_from(f"<{2 * n}q", buf, off)
        off += 16 * n
        for i in range(n):
            size, label = head[2 * i], head[2 * i + 1]
            out.append(decode_item(bytes(buf[off:off + size]), label))
            off += size
        return out
    rows = struct.unpack_from(f"<{2 * n * _ROW}q", buf, off)
    off += 8 * 2 * n * _ROW
    for i in range(n):
        pair = []
        for j in range(2):
            r = rows[(2 * i + j) * _ROW:(2 * i + j + 1) * _ROW]
            dtype, shape, nbytes = _DTYPES[r[0]], r[2:2 + r[1]], r[-1]
            t = torch.frombuffer(bytearray(buf[off:off + nbytes]), dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
            pair.append(t.view(dtype).reshape(shape))
            off += nbytes
        out.append(tuple(pair))
    return out


def bundle(messages: list[bytes]) -> bytes:
    return _i64([len(messages)] + [len(m) for m in messages]) + b"".join(messages)


def unbundle(buf: bytes) -> list[memoryview]:
    """Split a bundle into zero-copy views (``buf`` must not be reused: pass immutable bytes)."""
    (k,) = struct.unpack_from("<q", buf, 0)
    sizes = struct.unpack_from(f"<{k}q", buf, 8)
    view, off, out = memoryview(buf), 8 * (k + 1), []
    for s in sizes:
        out.append(view[off:off + s])
        off += s
    return out
