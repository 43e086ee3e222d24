"""One loader per technique, with one interface, for the rank processes of bench/peers.py.

``make(label, ctx, a, tag)`` opens technique ``label`` in this rank and returns an object with

* ``epoch()``: an iterator over this rank's ``(inputs, targets)`` batches of epoch 0;
* ``state(k)``: what a checkpoint after ``k`` batches of ``epoch()`` holds (``None``: no API);
* ``resume(state)``: on a freshly made loader, the rest of the epoch from that state;
* ``close()``.

``tag`` names the cell, so every cell gets its own node-local cache directory under this pretend
node's ``TMPDIR``; the rank runner empties them before every cell (each cell is the first epoch
of a fresh job).

ddp_hpc's cures run through the same calls and ``DataConfig`` as bench/sharedfs.py
(``open_train_data`` / ``make_train_batches`` / ``close_train_data``).  The peers are set up as
their documentation recommends for training from a shared POSIX directory, batch size
``BATCH``, shuffling on, 0 DataLoader workers (like ddp_hpc's cells: 4 ranks share 2 cores):

* WebDataset: shard paths read in place, ``nodesplitter=wds.split_by_node`` (whole shards per
  rank; the exact, non-resampled mode), shard shuffle with a seed, a 1000-sample shuffle buffer,
  ``batched`` in the pipeline and ``WebLoader(batch_size=None)``.
* LitData: ``StreamingDataset("local:<shared dir>", cache_dir=<node-local dir>, shuffle=True,
  drop_last=True)`` (its "network drives" and multi-node pages), ``StreamingDataLoader``.
  LitData reads the node count from ``NNODES`` (on CPU), which the rank sets.  A second row,
  ``litdata drop_last=False``, shows what LitData gives without dropping the last items.
* MosaicML Streaming: ``StreamingDataset(remote=<shared dir>, local=<node-local dir>,
  shuffle=True, batch_size=BATCH)`` with its defaults (py1e shuffle, relaxed partition),
  ``StreamingDataLoader``; it reads RANK / WORLD_SIZE / LOCAL_WORLD_SIZE from the environment.
"""
from __future__ import annotations

import glob
import os

import torch
from peers_pack import import_streaming

SEED = 0
CACHES = "peer-caches"  # below each pretend node's TMPDIR; emptied before every cell


def _decode(data: bytes, label):
    from ddp_hpc.data.images import decode_image

    return decode_image(data), int(label)


def io_bench():
    """bench/sharedfs.py (the folder of bench scripts is first on ``sys.path`` when one runs)."""
    import sharedfs

    return sharedfs


class Ours:
    """ddp_hpc's ``lmdb`` or ``stage+lmdb`` cure, configured exactly as bench/sharedfs.py's cell."""

    def __init__(self, label, ctx, a, tag):
        from ddp_hpc.config import DataConfig
        from ddp_hpc.data.io import open_train_data

        over = {lab: o for lab, o, _ in io_bench().TECHNIQUES}[label]
        self.cfg = DataConfig(lmdb_path=os.path.join(a["shared"], "imgs.lmdb"), stage_cleanup=True, **over)
        self.ctx, self.batch = ctx, a["batch"]
        self.ds = open_train_data(self.cfg, ctx, lambda: None)

    def epoch(self, start_batch=0):
        from ddp_hpc.data.io import make_train_batches

        return make_train_batches(self.ds, self.cfg, self.ctx, batch_size=self.batch, seed=SEED, epoch=0,
                                  start_batch=start_batch, num_workers=self.cfg.num_workers)

    def state(self, k):
        return {"start_batch": k}

    def resume(self, state):
        return self.epoch(state["start_batch"])

    def close(self):
        from ddp_hpc.data.io import close_train_data

        close_train_data(self.ds, self.cfg, self.ctx, completed=True)


class WebDatasetLoader:
    def __init__(self, label, ctx, a, tag):
        import webdataset as wds

        urls = sorted(glob.glob(os.path.join(a["shared"], "wds", "*.tar")))
        pipeline = (wds.WebDataset(urls, shardshuffle=len(urls), nodesplitter=wds.split_by_node, seed=SEED,
                                   empty_check=False)
                    .shuffle(1000).to_tuple("png", "cls").map(lambda s: _decode(*s))
                    .batched(a["batch"], partial=True))
        self.loader = wds.WebLoader(pipeline, batch_size=None, num_workers=0)

    def epoch(self):
        for x, y in self.loader:
            yield x, torch.as_tensor(y)

    def state(self, k):
        return None  # WebDataset has no loader state: a restarted loader starts the epoch over

    def resume(self, state):
        return self.epoch()

    def close(self):
        self.loader = None


class _StatefulLoader:
    """LitData's and Streaming's loaders keep their own state: an epoch is the loader, a resume
    loads its ``state_dict``."""

    def epoch(self):
        return iter(self.loader)

    def state(self, k):
        return self.loader.state_dict()

    def resume(self, state):
        self.loader.load_state_dict(state)
        return iter(self.loader)

    def close(self):
        self.ds = self.loader = None


class LitDataLoader(_StatefulLoader):
    drop_last = True  # what LitData's multi-GPU page asks for in training

    def __init__(self, label, ctx, a, tag):
        import litdata

        self.cache = os.path.join(os.environ["TMPDIR"], CACHES, "litdata-" + tag)
        os.makedirs(self.cache, exist_ok=True)
        self.ds = litdata.StreamingDataset("local:" + os.path.join(a["shared"], "litdata"), cache_dir=self.cache,
                                           shuffle=True, drop_last=self.drop_last, seed=SEED,
                                           transform=_lit_item)
        self.loader = litdata.StreamingDataLoader(self.ds, batch_size=a["batch"], num_workers=0)


class LitDataKeepLast(LitDataLoader):
    """LitData with ``drop_last=False``: not its recommendation, here to show what it changes."""

    drop_last = False


def _lit_item(item):
    return _decode(item["png"], item["label"])


_MDS_CLASS = []


def _mds_class():
    """A StreamingDataset that decodes like every other technique (its docs' way: subclass)."""
    if not _MDS_CLASS:
        streaming = import_streaming()

        class DecodedMDS(streaming.StreamingDataset):
            def get_item(self, idx):
                obj = super().get_item(idx)
                return _decode(obj["png"], obj["label"])

        _MDS_CLASS.append(DecodedMDS)
    return _MDS_CLASS[0]


class MosaicLoader(_StatefulLoader):
    def __init__(self, label, ctx, a, tag):
        streaming = import_streaming()
        self.local = os.path.join(os.environ["TMPDIR"], CACHES, "mds-" + tag)
        self.ds = _mds_class()(remote=os.path.join(a["shared"], "mds"), local=self.local, shuffle=True,
                               shuffle_seed=SEED, batch_size=a["batch"])
        self.loader = streaming.StreamingDataLoader(self.ds, batch_size=a["batch"], num_workers=0)


PEERS = {"webdataset": WebDatasetLoader, "litdata": LitDataLoader, "litdata drop_last=False": LitDataKeepLast,
         "mosaic streaming": MosaicLoader}
OURS = ("lmdb", "stage+lmdb")
TECHNIQUES = OURS + tuple(PEERS)


def make(label, ctx, a, tag):
    return (Ours if label in OURS else PEERS[label])(label, ctx, a, tag.replace("=", "-"))


def shared_dir(label, a) -> str:
    """The shared folder a technique reads (warmed before warm cells, counted in every cell)."""
    sub = {"webdataset": "wds", "litdata": "litdata", "litdata drop_last=False": "litdata",
           "mosaic streaming": "mds"}.get(label, "imgs.lmdb")
    return os.path.join(a["shared"], sub)
