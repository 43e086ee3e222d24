"""Stage with Slurm's ``sbcast``: the shared file is read on one node and Slurm fans it out.

``stage()`` (:mod:`ddp_hpc.data.stage`) makes local rank 0 of every node read the shared file:
``nodes x 1`` reads.  ``sbcast`` reads it once and sends it node to node over Slurm's own tree,
so the shared filesystem sees one reader per job.  Use it from the batch script, before srun::

    python -m ddp_hpc.data sbcast /shared/imgs.lmdb --to slurm_tmpdir
    srun python -m ddp_hpc.run job.yaml        # data.io=stage finds and adopts the copies

:func:`sbcast_stage` hashes the source (xxh3-64), ``sbcast``s it to ``DEST/.KEY.sbcast`` on
every node and then a small manifest (size, hash, source) beside it.  The training ranks'
``stage()`` on each node, under its usual lock, finds the manifest, re-hashes the local copy,
moves it into the stage folder and writes the completion marker: from there on it is an
ordinary staged copy (reused across requeues).  A missing manifest, a short or damaged copy,
or a manifest for another source are ignored (logged) and ``stage()`` copies as usual, so
``sbcast`` can only speed staging up, never make it wrong.

Only files and LMDB folders (their ``data.mdb``) can be sbcast: ``sbcast`` moves single files.
DEST must be the same path on every node (``$SLURM_TMPDIR`` or ``$TMPDIR`` usually are). In a
DEST other users may write to (``/tmp`` without a job-private TMPDIR) the copies' names can be
foreseen, so ``sbcast`` runs without ``--force`` there: Slurm then creates each file anew and
fails where a file (or link) of that name is already there, rather than write this user's data
into a file another user made (and can read) or through a link they planted; the nodes then copy
as usual (``stage()`` adopts only this user's own files).
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import time

from ddp_hpc.data import fsio
from ddp_hpc.data.copy import source_kind
from ddp_hpc.data.errors import StageError
from ddp_hpc.data.hashing import file_hash
from ddp_hpc.data.stage import resolve_stage_dir, sbcast_paths, stage_key
from ddp_hpc.data.stagedir import shared
from ddp_hpc.env import job_facts
from ddp_hpc.slurm.cli import SlurmCLI, SlurmError

__all__ = ["sbcast_stage", "sbcast_paths"]

log = logging.getLogger("ddp_hpc.data.sbcast")


def sbcast_stage(src: str | os.PathLike, dest: str | None = None, *, cli=None, environ=None) -> dict:
    """Hash ``src`` once, ``sbcast`` it and its manifest to ``dest`` on every node of this job."""
    job = job_facts(environ).key  # the key ddp_hpc.env gives the training ranks
    if not job:
        raise StageError("sbcast staging needs a Slurm allocation but SLURM_JOB_ID is not set",
                         "run `python -m ddp_hpc.data sbcast` inside the batch script (or salloc), or let "
                         "data.io=stage copy once per node without it")
    src = os.path.abspath(os.fspath(src))
    kind = source_kind(src)
    if kind == "dir":
        raise StageError(f"sbcast moves single files but {src!r} is a folder",
                         "pack it into one LMDB (python -m ddp_hpc.data pack SRC OUT.lmdb) or stage it without sbcast")
    dest = os.path.abspath(dest or resolve_stage_dir("auto", environ))
    key = stage_key(src, job)
    data, manifest = sbcast_paths(dest, key)
    source = os.path.join(src, "data.mdb") if kind == "lmdb" else src
    t0 = time.monotonic()
    fsio.note_open(source)
    nbytes, digest = file_hash(source)  # one read on this node; sbcast's own read follows it
    fsio.note_bytes(source, nbytes)
    cli = cli or SlurmCLI(env=environ)
    force = not shared(dest)   # see the module's docstring
    try:
        cli.sbcast(source, data, force=force)
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"src": src, "kind": kind, "bytes": nbytes, "xxh3_64": digest, "job": job}, f)
        try:
            cli.sbcast(f.name, manifest, force=force)  # only after the data reached every node
        finally:
            os.remove(f.name)
    except SlurmError as e:
        raise StageError(f"sbcast of {source!r} to {data!r} failed: {e.problem}", e.hint) from e
    seconds = time.monotonic() - t0
    log.info("sbcast: %s (%d bytes) to %s on every node in %.1f s", source, nbytes, data, seconds)
    return {"src": src, "data": data, "manifest": manifest, "bytes": nbytes, "xxh3_64": digest,
            "seconds": seconds, "job": job}
