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

``sbcast`` moves single files: an LMDB goes as its ``data.mdb``, any other folder as one ``tar``
archive (:mod:`ddp_hpc.data.stagearchive`): this node reads each of the folder's files once into an
archive on its local disk, ``sbcast`` puts the archive on every node, and each node's ``stage()``
checks its hash, unpacks it and counts the files and bytes against the manifest.  The shared
folder is then opened once per file for the whole job, whatever the number of nodes; a node that
joins the job later (a spare after a restart) adopts the archive Slurm left on it at the start,
so it does not read the shared folder either.

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
from ddp_hpc.data.stagearchive import make_archive
from ddp_hpc.data.stagedir import private_root, shared
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
    dest = os.path.abspath(dest or resolve_stage_dir("auto", environ))
    key = stage_key(src, job)
    data, manifest = sbcast_paths(dest, key)
    t0 = time.monotonic()
    cli = cli or SlurmCLI(env=environ)
    force = not shared(dest)   # see the module's docstring
    if kind == "dir":
        archive = os.path.join(private_root(dest), f".{key}.tar-{os.getpid()}")
        try:
            info = make_archive(src, archive)   # one read of every file, on this node only
            source = archive
            _send(cli, source, data, manifest, force, dict(info, src=src, kind=kind, job=job))
        finally:
            if os.path.exists(archive):
                os.remove(archive)
        nbytes, digest = info["bytes"], info["xxh3_64"]
    else:
        source = os.path.join(src, "data.mdb") if kind == "lmdb" else src
        fsio.note_open(source)
        nbytes, digest = file_hash(source)  # one read on this node; sbcast's own read follows it
        fsio.note_bytes(source, nbytes)
        _send(cli, source, data, manifest, force,
              {"src": src, "kind": kind, "bytes": nbytes, "xxh3_64": digest, "job": job})
    seconds = time.monotonic() - t0
    log.info("sbcast: %s (%d bytes) to %s on every node in %.1f s", source, nbytes, data, seconds)
    return {"src": src, "kind": kind, "data": data, "manifest": manifest, "bytes": nbytes, "xxh3_64": digest,
            "seconds": seconds, "job": job}


def _send(cli, source: str, data: str, manifest: str, force: bool, fields: dict) -> None:
    """``sbcast`` ``source`` to ``data`` on every node, then its manifest (``fields``)."""
    try:
        cli.sbcast(source, data, force=force)
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(fields, f)
        try:
            cli.sbcast(f.name, manifest, force=force)  # only after the data reached every node
        finally:
            os.remove(f.name)
    except SlurmError as e:
        raise StageError(f"sbcast of {source!r} to {data!r} failed: {e.problem}", e.hint) from e
