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

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from ddp_hpc.data.errors import IOConfigError
from ddp_hpc.data.samplers import batches_per_rank, epoch_permutation
from ddp_hpc.data.wire import bundle, decode_samples, encode_samples, unbundle
from ddp_hpc.dist import gather_layout, new_groups, node_rank_lists, strided_rank_lists

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
    by_leader = [next(x for x in nodes if x[0] == lead) for lead in leaders]
    return GroupPlan(mode, rank, world, (gl, leaders) if rank in leaders else None, (gn, node),
                     serves, [leaders[0]], device, by_leader)


class Channel:
    """One collective per step from the reader ``ranks[0]`` to every member of ``ranks``.

    ``collective="scatter"``: each member's slot is a 16-byte header (payload length, capacity)
    and its payload; members receive only their own bytes (best across nodes).
    ``collective="broadcast"``: one buffer (status, capacity, every member's length, then the
    payloads back to back) goes to all members, each slices its own (gloo's broadcast is the
    faster primitive for small groups inside a node, where the extra bytes cost no network).

    Buffers have a capacity every member agrees on and are reused across steps.  When a step
    outgrows it, the reader first sends a resize header (status -1, new capacity, at least 1.5x)
    and then the step: steady state is ONE collective per step, no separate size exchange.
    """

    def __init__(self, group, ranks: list, rank: int, device, capacity: int = 64 << 10,
                 collective: str = "scatter"):
        if collective not in ("scatter", "broadcast"):
            raise ValueError(f"Channel collective={collective!r}: use scatter or broadcast")
        self.group, self.ranks, self.device = group, ranks, torch.device(device)
        self.me, self.collective = ranks.index(rank), collective
        self.head = 16 if collective == "scatter" else 8 * (2 + len(ranks))
        self.cap = max(capacity, self.head + 1)
        self._alloc()

    def _alloc(self) -> None:
        rows = len(self.ranks) if (self.collective == "scatter" and self.me == 0) else 0
        self.out = torch.empty(self.cap, dtype=torch.uint8)  # broadcast: the shared buffer
        self.flat = torch.empty((rows, self.cap), dtype=torch.uint8) if rows else None
        self._np = self.flat.numpy() if rows else self.out.numpy()  # views kept: no per-step wrapping

    def _run(self) -> np.ndarray:
        """Run the collective; returns this rank's received buffer as a numpy view."""
        dev = self.device.type != "cpu"
        if self.collective == "broadcast":
            t = self.out.to(self.device) if dev else self.out
            dist.broadcast(t, group=self.group, group_src=0)
            return (t.cpu() if dev else t).numpy()
        out = torch.empty(self.cap, dtype=torch.uint8, device=self.device) if dev else self.out
        chunks = None
        if self.me == 0:
            chunks = list((self.flat.to(self.device) if dev else self.flat).unbind(0))
        dist.scatter(out, chunks, group=self.group, group_src=0)
        return (out.cpu() if dev else out).numpy()

    def _write_header(self, values) -> None:
        if self.collective == "scatter":
            for row in self._np:
                row[:16].view(np.int64)[:] = values[:2]
        else:
            self._np[:self.head].view(np.int64)[:] = values

    def send(self, messages: list[bytes] | None) -> bytes:
        """Reader: pass one message per member (in ``ranks`` order); members pass None."""
        if len(self.ranks) == 1:
            return messages[0]
        if self.me == 0:
            lens = [len(m) for m in messages]
            need = self.head + (max(lens) if self.collective == "scatter" else sum(lens))
            if need > self.cap:
                new_cap = max(need, self.cap * 3 // 2)
                self._write_header([-1, new_cap] + [0] * (self.head // 8 - 2))
                self._run()
                self.cap = new_cap
                self._alloc()
            view = self._np
            if self.collective == "scatter":
                for i, m in enumerate(messages):
                    view[i, :16].view(np.int64)[:] = (len(m), self.cap)
                    view[i, 16:16 + len(m)] = np.frombuffer(m, dtype=np.uint8)
            else:
                self._write_header([0, self.cap] + lens)
                off = self.head
                for m in messages:  # one copy of each message into place
                    view[off:off + len(m)] = np.frombuffer(m, dtype=np.uint8)
                    off += len(m)
        while True:
            buf = self._run()
            status, cap = buf[:16].view(np.int64).tolist()
            if status < 0:  # the reader grew the buffers: receive this step again at the new size
                self.cap = cap
                self._alloc()
                continue
            if self.me == 0:
                return messages[0]
            if self.collective == "scatter":
                return buf[16:16 + status].tobytes()
            lens = buf[16:self.head].view(np.int64).tolist()
            off = self.head + sum(lens[:self.me])
            return buf[off:off + lens[self.me]].tobytes()


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
        steps in one collective until the group's bytes reach ``coalesce_bytes`` (at most
        ``max_coalesce`` steps), as DDP buckets gradients: a collective's fixed latency then
        counts once per bucket, not once per step.  Steps that are already large go one per
        collective; ``coalesce_bytes=0`` turns it off."""
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

    def __getitem__(self, i):
        return self.inner[i]

    def _read(self, idx: list[int], pool) -> list:
        get = self.inner.raw_item if self.raw else self.inner.__getitem__
        return list(pool.map(get, idx) if pool is not None else map(get, idx))

    def messages(self, *, batch_size: int, seed: int, epoch: int, start_batch: int = 0, num_workers: int = 0):
        """Per step, this rank's encoded message (the part without decoding).

        A reader prepares the next bucket of steps (reads and encodes, in a helper thread) while
        the current bucket's collective runs and its steps are consumed, so shared-filesystem
        latency overlaps the transfer and the training."""
        p, n = self.plan, len(self.inner)
        steps = batches_per_rank(n, p.world_size, batch_size)
        full = epoch_permutation(n, p.world_size, seed, epoch) if p.serves else []
        perm = {r: full[r::p.world_size] for r in p.serves}  # DistributedSampler's slices
        pool = ThreadPoolExecutor(num_workers) if (num_workers and p.serves) else None
        ahead = ThreadPoolExecutor(1) if p.serves else None

        def prepare(b: int) -> tuple[int, dict]:
            """Steps b.. (one bucket) -> (first step after it, {member: bundle of its messages})."""
            parts, nbytes, b0 = {r: [] for r in p.serves}, 0, b
            while b < steps and (b == b0 or (nbytes < self.coalesce_bytes and b - b0 < self.max_coalesce)):
                lo, hi = b * batch_size, (b + 1) * batch_size
                for r in p.serves:
                    parts[r].append(encode_samples(self._read(perm[r][lo:hi], pool), self.raw))
                    nbytes += len(parts[r][-1])
                b += 1
            return b, {r: bundle(ms) for r, ms in parts.items()}

        try:
            b = start_batch
            nxt = ahead.submit(prepare, b) if ahead and b < steps else None
            while b < steps:  # members learn each bucket's size from the bundle they receive
                msgs = {}
                if nxt is not None:
                    b_next, msgs = nxt.result()
                    nxt = ahead.submit(prepare, b_next) if b_next < steps else None
                for part in unbundle(self._deliver(msgs)):
                    b += 1
                    yield part
        finally:
            for ex in (ahead, pool):
                if ex is not None:
                    ex.shutdown(wait=True, cancel_futures=True)

    def _deliver(self, msgs: dict) -> bytes:
        p = self.plan
        if p.mode != "two_level":
            return self._ch1.send([msgs[r] for r in self._ch1.ranks] if msgs else None)
        node_msgs = None
        if self._ch1 is not None:  # node leaders: receive this node's bundle from the reader
            per_node = None
            if msgs:
                per_node = [bundle([msgs[r] for r in node_ranks]) for node_ranks in p.node_lists]
            node_msgs = unbundle(self._ch1.send(per_node))
        return self._ch2.send(node_msgs)

    def batches(self, *, batch_size: int, seed: int, epoch: int, start_batch: int = 0, num_workers: int = 0):
        """Collated (inputs, targets) batches: this rank's DistributedSampler samples, in order."""
        decode = self.inner.decode_item if self.raw else None
        for msg in self.messages(batch_size=batch_size, seed=seed, epoch=epoch,
                                 start_batch=start_batch, num_workers=num_workers):
            yield default_collate(decode_samples(msg, decode))
