"""What ``pack`` reads, and the worker processes that read and check it in parallel.

Sources (:func:`open_source`): a folder of files or a class-per-folder tree, a WebDataset
shard set (one ``.tar`` file, or a folder of them: members grouped by key, the part of the name
before its first dot; the sample's payload is its image member, its label the integer in its
``.cls`` member, -1 without one), or a Hugging Face ``datasets`` folder written by
``save_to_disk`` (:mod:`ddp_hpc.data.packhf`, mapped the same way).  Each gives
``(kind, classes, samples)``, where a sample is ``(name, label, where)``: ``where`` a path to
read, for a tar member the bytes already read (a shard is one sequential read on the packing
process), or for an Arrow row a buffer of the memory-mapped file, copied to bytes as its chunk
is handed out.

:func:`read_in_order` reads (where needed) and checks the samples in ``workers`` processes, in
chunks, and yields their payloads in sample order: the LMDB written from it does not depend
on the number of workers.  A file that cannot be read or is not a readable image stops it with
a :class:`PackError` naming the file.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import tarfile
from collections.abc import Iterator

from ddp_hpc.data import fsio
from ddp_hpc.data.errors import PackError
from ddp_hpc.data.imagecheck import check_image
from ddp_hpc.data.images import IMAGE_SUFFIXES
from ddp_hpc.data.packhf import hf_source, is_hf_folder
from ddp_hpc.env import job_facts

__all__ = ["open_source", "read_in_order", "allocation_cpus", "CHUNK_FILES"]

CHUNK_FILES = 64   #: samples per task handed to a worker


def allocation_cpus(environ=None) -> int:
    """The CPUs this process may use: ``SLURM_CPUS_PER_TASK`` in a Slurm task, else its affinity."""
    return job_facts(environ).cpus_per_task or len(os.sched_getaffinity(0))


def _folder(src: str) -> tuple[str, list[str], list[tuple[str, int, str]]]:
    entries = sorted(os.scandir(src), key=lambda e: e.name)
    subdirs = [e.name for e in entries if e.is_dir() and not e.name.startswith(".")]
    files = [e.name for e in entries if e.is_file() and not e.name.startswith(".")]
    if subdirs:
        samples = []
        for label, cls in enumerate(subdirs):
            for dirpath, dirnames, names in os.walk(os.path.join(src, cls)):
                dirnames.sort()
                for n in sorted(names):
                    if not n.startswith("."):
                        rel = os.path.relpath(os.path.join(dirpath, n), src)
                        samples.append((rel, label, os.path.join(src, rel)))
        classes = subdirs
    else:
        samples, classes = [(n, -1, os.path.join(src, n)) for n in files], []
    if not samples:
        raise PackError(f"pack: source {src!r} holds no files",
                        "point SRC at a folder of files or a class-per-folder tree (ROOT/<class>/<file>)")
    images = all(rel.lower().endswith(IMAGE_SUFFIXES) for rel, _, _ in samples)
    return ("images" if images else "files"), classes, samples


def _shards(src: str) -> list[str] | None:
    """The WebDataset shards ``src`` names (a .tar file, or a folder holding only .tar files)."""
    if os.path.isfile(src):
        return [src] if src.endswith(".tar") else None
    names = sorted(n for n in os.listdir(src) if not n.startswith("."))
    if names and all(n.endswith(".tar") and os.path.isfile(os.path.join(src, n)) for n in names):
        return [os.path.join(src, n) for n in names]
    return None


def _webdataset(shards: list[str]) -> tuple[str, list[str], list[tuple[str, int, bytes]]]:
    samples: list[tuple[str, int, bytes]] = []
    for shard in shards:
        groups: dict[str, dict[str, bytes]] = {}
        fsio.note_open(shard)
        with tarfile.open(shard, mode="r|") as tf:
            for m in tf:
                if not m.isfile():
                    continue
                base = os.path.basename(m.name)
                key, _, ext = base.partition(".")
                groups.setdefault(os.path.join(os.path.dirname(m.name), key), {})[ext.lower()] = \
                    tf.extractfile(m).read()
        for key, parts in groups.items():
            image = next((e for e in parts if "." + e in IMAGE_SUFFIXES), None)
            if image is None:
                raise PackError(f"pack: sample {key!r} in {shard!r} has no image member ({sorted(parts)})",
                                f"give each sample one of {', '.join(IMAGE_SUFFIXES)}")
            label = parts.get("cls", b"-1").strip()
            if not label.lstrip(b"-").isdigit():
                raise PackError(f"pack: sample {key!r} in {shard!r}: .cls holds {label[:40]!r}, not an integer",
                                "write the class index as a decimal integer in KEY.cls")
            samples.append((f"{os.path.basename(shard)}/{key}.{image}", int(label), parts[image]))
    if not samples:
        raise PackError(f"pack: the shards {shards} hold no samples", "point SRC at WebDataset .tar shards")
    top = max(label for _, label, _ in samples)
    return "images", [str(i) for i in range(top + 1)], samples


def open_source(src: str) -> tuple[str, list[str], list[tuple[str, int, object]]]:
    """``(kind, classes, samples)`` of a folder, a WebDataset shard set or a Hugging Face
    ``save_to_disk`` folder at ``src``."""
    shards = _shards(src)
    if shards is not None:
        return _webdataset(shards)
    if not os.path.isdir(src):
        raise PackError(f"pack: source {src!r} is not a directory or a WebDataset .tar shard",
                        "pass the dataset folder, a .tar shard, a folder of .tar shards or a Hugging Face "
                        "save_to_disk folder as SRC")
    if is_hf_folder(src):
        return hf_source(src)
    return _folder(src)


def _work(task: tuple[list, bool]) -> tuple[list[bytes], tuple[int, int], str | None]:
    """One chunk: -> (payloads, (opens, bytes) fsio counted for it, the first problem or None)."""
    items, check = task
    before = fsio.snapshot()
    out, problem = [], None
    for name, where in items:
        try:
            payload = where if isinstance(where, bytes) else fsio.read_bytes(where)
        except OSError as e:
            problem = f"pack: cannot read {where!r}: {e}\0fix permissions or remove the file"
            break
        if check:
            try:
                check_image(payload)
            except Exception as e:  # pillow raises several types for broken files
                problem = (f"pack: {name!r} is not a readable image ({type(e).__name__}: {e})\0"
                           "remove or replace the file, or pack with --no-check")
                break
        out.append(payload)
    after = fsio.snapshot()
    return out, (after["opens"] - before["opens"], after["bytes"] - before["bytes"]), problem


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)


def read_in_order(samples: list, check: bool, workers: int) -> Iterator[bytes]:
    """Each sample's payload, in order, read and checked by ``workers`` processes (1: here)."""
    # a generator: a chunk's buffers (Arrow rows) become bytes as the pool takes it, not all at once
    tasks = (([(name, where if isinstance(where, (str, bytes)) else bytes(where))
               for name, _, where in samples[i:i + CHUNK_FILES]], check)
             for i in range(0, len(samples), CHUNK_FILES))
    pool = mp.get_context("fork").Pool(workers, initializer=_init_worker) if workers > 1 else None
    try:
        results = pool.imap(_work, tasks) if pool else map(_work, tasks)
        for payloads, (opens, nbytes), problem in results:
            if pool is not None:   # the workers counted in their own processes
                fsio.add(opens, nbytes)
            if problem:
                text, hint = problem.split("\0")
                raise PackError(text, hint)
            yield from payloads
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
