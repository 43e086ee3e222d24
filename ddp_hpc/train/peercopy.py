"""One file's bytes from the rank that holds it to the ranks that lack it, in bounded chunks: the
peer restore of a memory snapshot (train/restore.py).

Why chunks: a collective's tensor must be on the GPU with NCCL, and a state as large as the
GPU's free memory sent in one message turned a lost node into a CUDA out-of-memory error that
ended the job. Each message is at most `CHUNK_BYTES`: the sender reads the file one chunk at a
time, each receiver writes the chunks into one CPU buffer of the file's size (its only copy of
the bytes: `BytesView` lets ``torch.load`` read it without another one), and with NCCL each side
holds one chunk on its GPU, never the file.

Why a subgroup: the ranks whose node holds the snapshot read it from their own memory; sending
it to them too cost each a full buffer for nothing. `subgroup` is a collective of the whole world
(``dist.new_group``): every rank calls it with the same ranks.

Failures: every rank of the group makes the same calls whatever fails on it, so that none waits
for a call another never makes. The buffers come first, then one all_reduce of "ready" (a rank
that could not allocate stops the send before any chunk); a read or copy that fails later is
kept and said after the last chunk. A failing collective itself (a lost peer) is raised, as
before: the run cannot go on then.
"""
from __future__ import annotations

import io
from pathlib import Path

import torch
import torch.distributed as dist

from ddp_hpc.train.memsnap import comm_device

__all__ = ["CHUNK_BYTES", "BytesView", "subgroup", "release", "send_file", "words"]

#: bytes per message (the receivers' and the sender's GPU buffer with NCCL); a test sets it small
CHUNK_BYTES = 256 << 20


def words(exc: BaseException, limit: int = 200) -> str:
    """``RuntimeError: CUDA out of memory. Tried to ...``: the error's type and first line."""
    first = (str(exc).strip().splitlines() or [""])[0]
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


class BytesView(io.RawIOBase):
    """A read-only file over a buffer without copying it (``io.BytesIO`` of anything but
    ``bytes`` copies it, and ``.tobytes()`` would be one more copy of a whole snapshot)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        super().__init__()
        self._view, self._pos = memoryview(buffer.numpy()).cast("B"), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = max(0, min(len(b), len(self._view) - self._pos))
        memoryview(b).cast("B")[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


def subgroup(ranks: list[int]):
    """The process group of ``ranks`` (None: they are the whole world, the default group). Every
    rank calls it, with the same ranks in the same order."""
    ranks = sorted(set(ranks))
    if len(ranks) == dist.get_world_size():
        return None
    return dist.new_group(ranks=ranks)


def release(group, member: bool) -> None:
    """`subgroup`'s group gone again (a restore makes one per start)."""
    if group is not None and member:
        try:
            dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 - a group left to the end of the process does no harm
            pass


def send_file(path: Path | None, size: int, src: int, group=None) -> tuple[torch.Tensor | None, str | None]:
    """Rank ``src`` sends the ``size`` bytes of ``path`` to the other ranks of ``group`` (None:
    every rank), `CHUNK_BYTES` at a time; each rank of the group calls it. Returns the bytes (a
    CPU uint8 tensor, on a receiver that got them all) and this rank's failure in words (None
    when it had none)."""
    rank, dev = dist.get_rank(), comm_device()
    chunk = max(1, min(int(CHUNK_BYTES), size))
    cuda = dev.type == "cuda"
    error, f, buf, host, stage = None, None, None, None, None
    try:
        if rank == src:
            f = open(path, "rb")          # noqa: SIM115 - closed below, after the last chunk
            host = torch.empty(chunk, dtype=torch.uint8, pin_memory=cuda)
        else:
            buf = torch.empty(size, dtype=torch.uint8)
        stage = torch.empty(chunk, dtype=torch.uint8, device=dev) if cuda else host
    except Exception as exc:  # noqa: BLE001 - said to every rank, then the file checkpoints
        error = words(exc)
    try:
        ready = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=dev)
        dist.all_reduce(ready, op=dist.ReduceOp.MAX, group=group)
        if int(ready.item()):
            return None, error
        for off in range(0, size, chunk):
            n = min(chunk, size - off)
            if rank == src:
                if error is None:
                    error = _read(f, host, n, off, size, path)
                if cuda:
                    stage[:n].copy_(host[:n])
                dist.broadcast(stage[:n], src=src, group=group)
            else:
                into = stage[:n] if cuda else buf[off:off + n]
                dist.broadcast(into, src=src, group=group)
                if cuda:
                    buf[off:off + n].copy_(into)
        return (buf if error is None else None), error
    finally:
        if f is not None:
            f.close()


def _read(f, host: torch.Tensor, n: int, off: int, size: int, path: Path | None) -> str | None:
    """The next ``n`` bytes of the file into ``host``; the failure in words."""
    try:
        got = f.readinto(memoryview(host.numpy())[:n])
    except Exception as exc:  # noqa: BLE001 - the chunk goes anyway; the failure is said after
        return words(exc)
    if got != n:
        return f"{path} ended at byte {off + got} of {size} (it changed while it was sent)"
    return None
