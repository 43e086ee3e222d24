"""Group broadcast loader: one reader per group reads the shared directory for the whole group.

Why: with R ranks each opening its own files, the shared filesystem sees R clients; with group
readers it sees only the readers (one per node, one per local-rank stride, or one in total), and
the bytes travel over the interconnect instead.

Modes (``data.broadcast_groups``), for 2 nodes x 3 ranks:

* ``node``: groups [0,1,2], [3,4,5]; readers 0 and 3 (one per node, traffic stays in the node);
* ``strided``: groups [0,3], [1,4], [2,5]; readers 0, 1, 2 (all on node 0, spread across nodes);
* ``two_level``: rank 0 reads everything, scatters per-node bundles to the node leaders [0, 3],
  and each leader scatters within its node.

Every step the reader builds one message per member (:mod:`ddp_hpc.data.wire`: a small header,
then the bytes); one collective delivers them (see :class:`Channel`: scatter across nodes,
broadcast and slice inside a node), so each member keeps only its own samples.  Small steps
travel in buckets (``data.broadcast_bucket_mb``, 1 MiB by default): one collective carries
several consecutive steps, as DDP buckets gradients, so a collective's latency is paid once per
bucket.  Datasets with ``raw_item(i) -> (bytes, label)`` and
``decode_item(bytes, label)`` ship compact encoded bytes and decode on the receiver; any other
dataset ships ``dataset[i]``'s tensors.  Each rank gets exactly its ``DistributedSampler``
indices (see :mod:`ddp_hpc.data.samplers`), in order.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from ddp_hpc.data.errors import IOConfigError
from ddp_hpc.data.samplers import batches_per_rank, epoch_permutation
from ddp_hpc.data.wire import Channel, bundle_pieces, decode_samples, encode_samples, raw_bundle, unbundle
from ddp_hpc.dist import gather_layout, group_initialized, new_groups, node_rank_lists, strided_rank_lists

__all__ = ["BroadcastDataset", "GroupPlan", "build_plan", "encode_samples", "decode_samples", "MODES"]

MODES = ("node", "strided", "two_level")


@dataclass
class GroupPlan:
    """Who reads for whom.  ``level1``: (group, ranks) this rank takes part in first (the reader
    scatters per-member messages); ``level2``: for two_level, the node (group, ranks) after the
    leaders level.  ``serves``: the ranks whose samples this rank reads (readers only)."""

    mode: str
    rank: int
    world_size: int
    level1: tuple | None
    level2: tuple | None
    serves: list
    readers: list
    comm_device: torch.device
    node_lists: list | None = None


def build_plan(env, mode: str, comm_device=None) -> GroupPlan:
    """Create the groups for ``mode`` (a collective: every rank calls it, in the same order)."""
    if mode not in MODES:
        raise IOConfigError(f"data.broadcast_groups={mode!r} is not one of {', '.join(MODES)}",
                            "node (one reader per node) is the usual choice")
    layout = gather_layout(env)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(comm_device or "cpu")
    nodes = [sorted(x) for x in node_rank_lists(layout)]  # torch orders group ranks ascending:
    strided = [sorted(x) for x in strided_rank_lists(layout)]  # the reader is the lowest rank
    leaders = sorted(min(x) for x in nodes)

    def mine(lists):
        return next((lst for lst in lists if rank in lst), None)

    if mode in ("node", "strided"):
        lists = nodes if mode == "node" else strided
        g = new_groups(lists)
        ranks = mine(lists)
        serves = ranks if rank == ranks[0] else []
        return GroupPlan(mode, rank, world, (g, ranks), None, serves, [lst[0] for lst in lists], device)
    gl = new_groups([leaders])
    gn = new_groups(nodes)
    node = mine(nodes)
    serves = list(range(world)) if rank == leaders[0] else []
    first = {x[0]: x for x in nodes}          # a leader -> its node's ranks (not a scan per leader)
    by_leader = [first[lead] for lead in leaders]
    return GroupPlan(mode, rank, world, (gl, leaders) if rank in leaders else None, (gn, node),
                     serves, [leaders[0]], device, by_leader)


class BroadcastDataset(torch.utils.data.Dataset):
    """Wraps a dataset so that :meth:`batches` reads it through group readers.

    Indexing still works (``dataset[i]`` reads directly), so code that only needs ``len`` or a
    single sample is unaffected.
    """

    def __init__(self, inner, plan: GroupPlan, capacity: int = 64 << 10, collective: str = "auto",
                 coalesce_bytes: int = 1 << 20, max_coalesce: int = 32):
        """``collective``: auto (broadcast+slice inside a node: node groups and the second level
        of two_level; scatter across nodes: strided groups and the leaders level), or force
        scatter / broadcast everywhere.

        ``coalesce_bytes``/``max_coalesce``: when steps are small, the reader ships consecutive
        steps in one collective while another step fits in ``coalesce_bytes`` of the group's
        bytes (at most ``max_coalesce`` steps), as DDP buckets gradients: a collective's fixed
        latency then counts once per bucket, not once per step.  Steps that are already large go
        one per collective; ``coalesce_bytes=0`` turns it off."""
        if coalesce_bytes < 0 or max_coalesce < 1:
            raise ValueError(f"BroadcastDataset: coalesce_bytes={coalesce_bytes} must be >= 0 and "
                             f"max_coalesce={max_coalesce} >= 1")
        self.inner, self.plan = inner, plan
        self.coalesce_bytes, self.max_coalesce = coalesce_bytes, max_coalesce
        self.raw = hasattr(inner, "raw_item") and hasattr(inner, "decode_item")
        first = collective if collective != "auto" else ("broadcast" if plan.mode == "node" else "scatter")
        second = collective if collective != "auto" else "broadcast"
        self._ch1 = Channel(*plan.level1, plan.rank, plan.comm_device, capacity, first) if plan.level1 else None
        self._ch2 = Channel(*plan.level2, plan.rank, plan.comm_device, capacity, second) if plan.level2 else None

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def released(self) -> bool:
        return self.plan.level1 is None and self.plan.level2 is None

    def release(self) -> None:
        """Destroy this reader's process groups (while the default group still exists) and drop
        every reference to them, so their gloo / nccl state goes now, not at interpreter exit.
        Local (no collective); the dataset cannot deliver batches afterwards."""
        groups = [lv[0] for lv in (self.plan.level1, self.plan.level2) if lv is not None and lv[0] is not None]
        self._ch1 = self._ch2 = None
        self.plan.level1 = self.plan.level2 = None
        for group in groups:
            if group is not dist.GroupMember.WORLD and group_initialized():
                try:
                    dist.destroy_process_group(group)
                except ValueError:   # already gone (the default group was destroyed first)
                    pass

    def __getitem__(self, i):
        return self.inner[i]

    def _read_raw(self, idx: list[int], pool) -> tuple[list, list]:
        """(encoded bytes, labels) of ``idx``: one bulk ``raw_batch`` where the dataset has it and
        no reader threads are asked for, else ``raw_item`` per index (on the threads)."""
        if pool is None and hasattr(self.inner, "raw_batch"):
            return self.inner.raw_batch(idx)
        items = list(pool.map(self.inner.raw_item, idx) if pool is not None else map(self.inner.raw_item, idx))
        return [v for v, _ in items], [label for _, label in items]

    def takes_another(self, nbytes: int, last: int, count: int) -> bool:
        """Does a bucket of ``count`` steps and ``nbytes`` (its last step ``last`` bytes) take the
        next step?  While another step like the last still fits in ``coalesce_bytes`` (and below
        ``max_coalesce`` steps): buckets then stay close to one size, and the buffer every
        collective moves in full (sized to the largest bucket) carries little padding."""
        return nbytes + last <= self.coalesce_bytes and count < self.max_coalesce

    def _prepare(self, perm: dict, b: int, steps: int, batch_size: int, pool) -> tuple[int, tuple]:
        """Reader: steps b.. (one bucket, see :meth:`takes_another`) -> (first step after it, the
        bucket framed for sending); raw samples are read in bulk and laid out by :func:`raw_bundle`."""
        p, b0, nbytes, last, counts = self.plan, b, 0, 0, []
        cols = {r: ([], [], []) for r in p.serves}  # values, labels, their lengths (measured once)
        msgs = {r: [] for r in p.serves}
        while b < steps and (b == b0 or self.takes_another(nbytes, last, b - b0)):
            lo, hi, before = b * batch_size, (b + 1) * batch_size, nbytes
            for r in p.serves:
                if self.raw:
                    values, labels = self._read_raw(perm[r][lo:hi], pool)
                    lens = list(map(len, values))
                    cols[r][0].extend(values)
                    cols[r][1].extend(labels)
                    cols[r][2].extend(lens)
                    nbytes += sum(lens)
                else:
                    idx = perm[r][lo:hi]
                    msgs[r].append(encode_samples(list(pool.map(self.inner.__getitem__, idx) if pool is not None
                                                       else map(self.inner.__getitem__, idx)), False))
                    nbytes += len(msgs[r][-1])
            counts.append(len(perm[p.serves[0]][lo:hi]))
            last = nbytes - before
            b += 1
        if self.raw:
            pieces = {r: raw_bundle(cols[r][0], cols[r][1], counts, cols[r][2]) for r in p.serves}
        else:
            pieces = {r: bundle_pieces(msgs[r]) for r in p.serves}
        if p.mode != "two_level":
            return b, self._ch1.frame([pieces[r] for r in self._ch1.ranks])
        per_node = [bundle_pieces([pieces[r] for r in node_ranks]) for node_ranks in p.node_lists]
        return b, self._ch1.frame(per_node)

    def messages(self, *, batch_size: int, seed: int, epoch: int, start_batch: int = 0, num_workers: int = 0):
        """Per step, this rank's encoded message (the part without decoding).

        A reader prepares the next bucket (reads, encodes and frames it) while the current one
        travels.  Datasets with ``raw_batch`` (memory-mapped or in memory: the work is Python's)
        do it in this thread while the collective runs asynchronously; a helper thread would only
        take turns with this one for the GIL, and each turn can wait out the interpreter's switch
        interval (5 ms).  Other datasets (file reads that wait on the filesystem) are read in a
        helper thread, one bucket ahead, so shared-filesystem latency also overlaps the training."""
        p, n = self.plan, len(self.inner)
        steps = batches_per_rank(n, p.world_size, batch_size)
        full = epoch_permutation(n, p.world_size, seed, epoch) if p.serves else []
        perm = {r: full[r::p.world_size] for r in p.serves}  # DistributedSampler's slices
        pool = ThreadPoolExecutor(num_workers) if (num_workers and p.serves) else None
        inline = self.raw and pool is None and hasattr(self.inner, "raw_batch")
        ahead = ThreadPoolExecutor(1) if (p.serves and not inline) else None

        def prepare(b: int):  # inline: the result itself; else a future of it
            args = (perm, b, steps, batch_size, pool)
            return self._prepare(*args) if inline else ahead.submit(self._prepare, *args)

        try:
            b = start_batch
            nxt = prepare(b) if p.serves and b < steps else None
            while b < steps:  # members learn each bucket's size from the bundle they receive
                started = None
                if nxt is not None:
                    b_next, framed = nxt if inline else nxt.result()
                    started = self._ch1.start(framed)  # the reader's collective is in flight...
                    nxt = prepare(b_next) if b_next < steps else None  # ...while the next is framed
                for part in unbundle(self._deliver(started)):
                    b += 1
                    yield part
        finally:
            for ex in (ahead, pool):
                if ex is not None:
                    ex.shutdown(wait=True, cancel_futures=True)

    def _deliver(self, started):
        """One bucket to this rank (the reader passes its started transfer, members None)."""
        def first_level():
            return self._ch1.finish(started) if started is not None else self._ch1.transfer(None)

        if self.plan.mode != "two_level":
            return first_level()
        node_msgs = None
        if self._ch1 is not None:  # node leaders: receive this node's bundle from the reader
            node_msgs = unbundle(first_level())
        return self._ch2.transfer(self._ch2.frame(node_msgs) if node_msgs is not None else None)

    def batches(self, *, batch_size: int, seed: int, epoch: int, start_batch: int = 0, num_workers: int = 0):
        """Collated (inputs, targets) batches: this rank's DistributedSampler samples, in order."""
        decode = self.inner.decode_item if self.raw else None
        for msg in self.messages(batch_size=batch_size, seed=seed, epoch=epoch,
                                 start_batch=start_batch, num_workers=num_workers):
            yield default_collate(decode_samples(msg, decode))
