"""The broadcast loader's wire: one member's samples as bytes, bundles of them, and the
:class:`Channel` that moves a bucket of bundles from a group's reader to its members.

A message is a small header of int64s (sample count, a kind flag, then per sample either
(encoded length, label) for raw items or, for tensors, rows of dtype code, ndim, shape and byte
count) followed by the bytes, back to back.  Raw items are a dataset's compact encoded bytes
(``raw_item``), decoded on the receiver (``decode_item``); anything else ships its tensors.
A bundle joins several messages (one per step, or one per node) with their lengths in front, so
one collective can carry a bucket of steps.

The reader never builds a sample's message in Python: :func:`raw_bundle` lays out the headers of
a whole bucket with numpy, and the result is a list of *pieces* (header views and the samples'
own bytes objects) that :meth:`Channel.frame` joins straight into the send buffer: one copy of
each sample, in C.
"""
from __future__ import annotations

import io
import struct

import numpy as np
import torch
import torch.distributed as dist

from ddp_hpc.data.errors import SampleError

__all__ = ["encode_samples", "decode_samples", "bundle", "unbundle", "raw_bundle", "bundle_pieces", "Pieces", "Channel"]

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


def decode_samples(buf, decode_item=None) -> list:
    """Inverse of :func:`encode_samples`; raw items are passed through ``decode_item``."""
    n, kind = struct.unpack_from("<2q", buf, 0)
    off = 16
    if kind == 0:
        head = np.frombuffer(buf, np.int64, 2 * n, off).reshape(n, 2)
        ends = (off + 16 * n + np.cumsum(head[:, 0])).tolist()
        view = memoryview(buf)
        return [decode_item(bytes(view[end - size:end]), label)
                for end, size, label in zip(ends, head[:, 0].tolist(), head[:, 1].tolist())]
    rows = struct.unpack_from(f"<{2 * n * _ROW}q", buf, off)
    off += 8 * 2 * n * _ROW
    out = []
    for i in range(n):
        pair = []
        for j in range(2):
            r = rows[(2 * i + j) * _ROW:(2 * i + j + 1) * _ROW]
            dtype, shape, nbytes = _DTYPES[r[0]], r[2:2 + r[1]], r[-1]
            t = (torch.frombuffer(bytearray(buf[off:off + nbytes]), dtype=torch.uint8) if nbytes
                 else torch.empty(0, dtype=torch.uint8))
            pair.append(t.view(dtype).reshape(shape))
            off += nbytes
        out.append(tuple(pair))
    return out


class Pieces(list):
    """Bytes-like pieces that make one message when joined in order; ``nbytes`` is their total."""

    nbytes = 0


def _nbytes(message) -> int:
    return message.nbytes if isinstance(message, Pieces) else len(message)


def raw_bundle(values: list, labels: list, counts: list[int], lens: list[int] | None = None) -> Pieces:
    """The pieces of ``bundle([encode_samples(step, raw=True) for step in steps])`` (the same
    bytes once joined), where step j is the next ``counts[j]`` of ``values``/``labels``
    (``lens``: the values' lengths, where the caller has them already): every header of the
    bucket is laid out by numpy at once, as rows of two int64s (a step's (count, 0), then each
    of its samples' (length, label)); the samples' bytes objects are pieces themselves, copied
    only when the pieces are joined."""
    k, n = len(counts), len(values)
    cnt = np.array(counts, dtype=np.int64)
    lens = np.array(list(map(len, values)) if lens is None else lens, dtype=np.int64)
    step_of = np.repeat(np.arange(k), cnt)
    rows = np.zeros((n + k, 2), dtype=np.int64)
    rows[np.cumsum(cnt + 1) - cnt - 1, 0] = cnt  # step j's header row: after j headers and its samples
    at = np.arange(n) + step_of + 1  # sample i's row: after its step's header and those before
    rows[at, 0] = lens
    rows[at, 1] = labels
    sizes = 16 + 16 * cnt + np.bincount(step_of, weights=lens, minlength=k).astype(np.int64)
    hv = memoryview(rows).cast("B")
    pieces = Pieces([np.concatenate(([k], sizes)).astype(np.int64).tobytes()])
    a = 0
    for j, c in enumerate(counts):
        pieces.append(hv[16 * (a + j):16 * (a + j + c + 1)])
        pieces += values[a:a + c]
        a += c
    pieces.nbytes = 8 * (k + 1) + int(sizes.sum())
    return pieces


def bundle_pieces(messages: list) -> Pieces:
    """The pieces of a bundle of ``messages`` (each bytes-like or :class:`Pieces`)."""
    sizes = [_nbytes(m) for m in messages]
    out = Pieces([_i64([len(messages)] + sizes)])
    for m in messages:
        if isinstance(m, Pieces):
            out += m
        else:
            out.append(m)
    out.nbytes = 8 * (len(messages) + 1) + sum(sizes)
    return out


def bundle(messages: list[bytes]) -> bytes:
    return b"".join(bundle_pieces(messages))


def unbundle(buf) -> list[memoryview]:
    """Split a bundle into zero-copy views (``buf`` must not be reused: pass immutable bytes)."""
    (k,) = struct.unpack_from("<q", buf, 0)
    view, at, out = memoryview(buf), 8 * (k + 1), []
    for size in struct.unpack_from(f"<{k}q", buf, 8):  # a few sizes: cheaper in Python than in numpy
        out.append(view[at:at + size])
        at += size
    return out


class _Buffers:
    """Byte buffers reused across buckets: a fresh 1 MiB buffer per bucket cost more in page
    faults than its collective (mmap, zero-fill, munmap each time).  A buffer is reused only once
    nothing views it: Python refuses (BufferError) to write to a BytesIO whose memory is still
    exported, here through a tensor or a message view somebody still holds.  Up to ``keep`` are
    kept; when all are in use, a new one is made and not kept."""

    def __init__(self, keep: int = 4):
        self.keep, self.pool = keep, []

    def _free(self) -> io.BytesIO:
        for bio in self.pool:
            try:
                bio.seek(0)
                bio.write(b"")  # raises while exported
                return bio
            except BufferError:
                continue
        bio = io.BytesIO()
        if len(self.pool) < self.keep:
            self.pool.append(bio)
        return bio

    @staticmethod
    def _tensor(bio: io.BytesIO, size: int) -> torch.Tensor:
        """``bio`` as a uint8 tensor of ``size`` bytes (what lies past the written part is left
        as it was: padding nobody reads)."""
        end = bio.seek(0, io.SEEK_END)
        if end < size:
            bio.write(bytes(size - end))
        elif end > size:
            bio.truncate(size)
        return torch.frombuffer(bio.getbuffer(), dtype=torch.uint8)

    def join(self, pieces: list, size: int) -> torch.Tensor:
        """The pieces written back to back (one C loop of copies) into a ``size``-byte tensor."""
        bio = self._free()
        bio.writelines(pieces)
        return self._tensor(bio, size)

    def empty(self, size: int) -> torch.Tensor:
        return self._tensor(self._free(), size)


_ZEROS = bytes(1 << 20)


def _zeros(n: int):
    """``n`` zero bytes, as a view of a shared block where it is big enough (padding)."""
    return memoryview(_ZEROS)[:n] if n <= len(_ZEROS) else bytes(n)


class Channel:
    """One collective per bucket from the reader ``ranks[0]`` to every member of ``ranks``.

    ``collective="scatter"``: each member's slot is a 16-byte header (payload length, capacity)
    and its payload; members receive only their own bytes (best across nodes).
    ``collective="broadcast"``: one buffer (status, capacity, every member's length, then the
    payloads back to back) goes to all members, each slices its own (gloo's broadcast is the
    faster primitive for small groups inside a node, where the extra bytes cost no network).

    The reader lays a bucket out with :meth:`frame` (while the previous bucket travels): one C
    loop of copies of the pieces into a reused buffer, sent as it is.
    Buffers have a capacity every member agrees on, and every collective moves all of it, so it
    grows only to the largest bucket seen plus 1/32 (growing by half, as before, made a third of
    the bytes sent padding).  When a bucket outgrows
    it, :meth:`start` first sends a resize header (status -1, new capacity) and then the bucket:
    steady state is ONE collective per bucket, no separate size exchange.
    """

    def __init__(self, group, ranks: list, rank: int, device, capacity: int = 64 << 10,
                 collective: str = "scatter"):
        if collective not in ("scatter", "broadcast"):
            raise ValueError(f"Channel collective={collective!r}: use scatter or broadcast")
        self.group, self.ranks, self.device = group, ranks, torch.device(device)
        self.me, self.collective = ranks.index(rank), collective
        self.head = 16 if collective == "scatter" else 8 * (2 + len(ranks))
        self.cap = self.planned = max(capacity, self.head + 1)  # planned: the reader's next frames'
        self._buffers = _Buffers()
        self._alloc()

    def _alloc(self) -> None:
        """The next receive buffer: a member hands out views of it, so one still viewed is not
        reused (see :class:`_Buffers`)."""
        self.out = self._buffers.empty(self.cap)

    def frame(self, messages: list) -> tuple:
        """Reader: one message per member (in ``ranks`` order), each bytes-like or :class:`Pieces`;
        returns the send buffer and the messages' lengths."""
        parts = [m if isinstance(m, Pieces) else [m] for m in messages]
        lens = [_nbytes(m) for m in messages]
        if len(self.ranks) == 1:
            return b"".join(parts[0]), lens
        need = self.head + (max(lens) if self.collective == "scatter" else sum(lens))
        if need > self.planned:  # grow with 1/32 to spare: every collective moves the whole capacity
            self.planned = need + need // 32
        cap, pieces = self.planned, []
        if self.collective == "scatter":
            for p, n in zip(parts, lens):  # row i: header, message, padding to the next row
                pieces += [_i64([n, cap]), *p, _zeros(cap - 16 - n)]
            pieces.pop()  # the last row's padding: left as the buffer holds it
        else:
            pieces.append(_i64([0, cap] + lens))
            for p in parts:
                pieces += p
        size = cap * (len(parts) if self.collective == "scatter" else 1)
        return self._buffers.join(pieces, size), lens

    def _launch(self, send: torch.Tensor | None) -> tuple:
        """Start the collective (the reader passes its send buffer): (work, what this rank holds)."""
        dev = self.device.type != "cpu"
        if self.collective == "broadcast":
            t = send if self.me == 0 else self.out
            t = t.to(self.device) if dev else t
            return dist.broadcast(t, group=self.group, group_src=0, async_op=True), t
        out = torch.empty(self.cap, dtype=torch.uint8, device=self.device) if dev else self.out
        chunks = None
        if self.me == 0:
            rows = send.view(len(self.ranks), self.cap)
            chunks = list((rows.to(self.device) if dev else rows).unbind(0))
        return dist.scatter(out, chunks, group=self.group, group_src=0, async_op=True), out

    def _run(self, send: torch.Tensor | None) -> np.ndarray:
        work, held = self._launch(send)
        work.wait()
        return held.cpu().numpy()

    def _resize(self, cap: int) -> None:
        """Reader: tell the members the next buffer has ``cap`` bytes (sent at the old size)."""
        header = _i64([-1, cap] + [0] * (self.head // 8 - 2))
        rows = len(self.ranks) if self.collective == "scatter" else 1
        msg = torch.zeros((rows, self.cap), dtype=torch.uint8)
        msg[:, :len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        self._run(msg.view(-1))
        self.cap = cap
        self._alloc()

    def start(self, framed: tuple) -> tuple:
        """Reader: start delivering a framed bucket (the collective runs while the caller goes on,
        e.g. framing the next one); :meth:`finish` waits for it."""
        buf, lens = framed
        if len(self.ranks) == 1:
            return None, buf
        size = buf.numel() // (len(self.ranks) if self.collective == "scatter" else 1)
        if size != self.cap:
            self._resize(size)
        start = 16 if self.collective == "scatter" else self.head
        return self._launch(buf)[0], memoryview(buf.numpy())[start:start + lens[0]]

    def finish(self, started: tuple):
        """Reader: wait for :meth:`start`'s collective; returns the reader's own message."""
        work, own = started
        if work is not None:
            work.wait()
        return own

    def transfer(self, framed: tuple | None):
        """Deliver a bucket: the reader passes :meth:`frame`'s result, members None; returns this
        rank's message (a view of a buffer used for this bucket only)."""
        if self.me == 0:
            return self.finish(self.start(framed))
        while True:
            self._alloc()
            buf = self._run(None)
            status, cap = buf[:16].view(np.int64).tolist()
            if status < 0:  # the reader grew the buffers: receive this bucket again at the new size
                self.cap = cap
                continue
            view = memoryview(buf)
            if self.collective == "scatter":
                return view[16:16 + status]
            lens = buf[16:self.head].view(np.int64).tolist()
            off = self.head + sum(lens[:self.me])
            return view[off:off + lens[self.me]]

    def send(self, messages: list | None):
        """:meth:`frame` and :meth:`transfer` in one call (reader: one message per member; members None)."""
        return self.transfer(self.frame(messages) if messages is not None else None)
