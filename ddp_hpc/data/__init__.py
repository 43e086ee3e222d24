"""Data IO for shared filesystems: ``data.io = direct | lmdb | stage | broadcast``.

* :mod:`ddp_hpc.data.io`: ``open_train_data`` / ``make_train_batches`` / ``close_train_data``, the
  calls the training loop makes;
* :mod:`ddp_hpc.data.pack`: ``pack`` many small files into one LMDB (``ddp-hpc data pack``);
* :mod:`ddp_hpc.data.lmdb`: the LMDB format: ``verify`` / ``read_meta`` / ``LMDBDataset``;
* :mod:`ddp_hpc.data.stage`: ``stage`` a file, LMDB or folder once per node, atomically, reused
  across requeues; its copy kernels are :mod:`ddp_hpc.data.copy`'s, its xxh3 checksums
  :mod:`ddp_hpc.data.hashing`'s; :mod:`ddp_hpc.data.stagefolder` shares one stage folder between
  node leaders (the last one out removes it); :mod:`ddp_hpc.data.sbcast` lets Slurm's ``sbcast``
  pre-place copies;
* :mod:`ddp_hpc.data.broadcast`: group readers that deliver each rank its own samples;
* :mod:`ddp_hpc.data.samplers`: DistributedSampler's order, resumable mid-epoch;
* :mod:`ddp_hpc.data.fsio`: counted opens/bytes on the shared directory (the benchmark's meter);
* :mod:`ddp_hpc.data.errors`: the package's errors (``HintError``: problem + HINT line);
* :mod:`ddp_hpc.data.cli`: ``ddp-hpc data pack|verify|make-images|stage|sbcast``.

For a user's own training script (docs/scripts.md, "Fast data from your own script"):

* ``LMDBDataset(path)``: a packed LMDB as a map-style dataset (``(tensor, label)`` items; safe to
  pickle into DataLoader workers; a DataLoader batch is one bulk read);
* ``BroadcastLoader(dataset, batch_size)``: one reader per node ships each rank its
  ``DistributedSampler`` samples (:mod:`ddp_hpc.data.loader`);
* ``staged_path(name, default)``: the node-local copy ``ddp-hpc submit --stage SRC=NAME`` made
  (``$DDP_HPC_STAGE_<NAME>``; :mod:`ddp_hpc.data.scriptstage`);
* ``ImageFolderDataset(root)``: a class-per-folder image dataset (``ddp-hpc data pack`` makes
  one LMDB of it).

Submodules, and these names, are imported on use, so ``import ddp_hpc.data`` stays cheap.
"""
import importlib

_PUBLIC = {"LMDBDataset": "ddp_hpc.data.lmdb", "BroadcastLoader": "ddp_hpc.data.loader",
           "staged_path": "ddp_hpc.data.scriptstage", "ImageFolderDataset": "ddp_hpc.data.images"}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'ddp_hpc.data' has no attribute {name!r}")
