"""Data IO for shared filesystems: ``data.io = direct | lmdb | stage | broadcast``.

* :mod:`ddp_hpc.data.io`: ``open_train_data`` / ``make_train_batches`` / ``close_train_data``, the
  calls the training loop makes;
* :mod:`ddp_hpc.data.lmdb`: ``pack`` / ``verify`` / ``LMDBDataset`` (``python -m ddp_hpc.data pack``);
* :mod:`ddp_hpc.data.stage`: ``stage`` a file, LMDB or folder once per node, atomically;
* :mod:`ddp_hpc.data.broadcast`: group readers that deliver each rank its own samples;
* :mod:`ddp_hpc.data.samplers`: DistributedSampler's order, resumable mid-epoch;
* :mod:`ddp_hpc.data.fsio`: counted opens/bytes on the shared directory (the benchmark's meter).

Submodules are imported on use, so ``import ddp_hpc.data`` stays cheap.
"""
