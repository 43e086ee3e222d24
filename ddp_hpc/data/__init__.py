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

Submodules are imported on use, so ``import ddp_hpc.data`` stays cheap.
"""
