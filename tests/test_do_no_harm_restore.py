"""Issue 38, bug 4: a restore from a peer's memory snapshot does no harm (train/restore.py).

Real gloo ranks on pretend nodes, each with a node folder of its own: the holder sends the
snapshot in bounded chunks, only to the ranks whose node lacks it (a rank that holds it receives
nothing), and the receivers put the chunks back together byte for byte; any failure of a memory
restore on any rank (a holder's broken snapshot, a receiver that cannot allocate the buffer)
brings every rank to the file checkpoint, without a hang, and the ``restored`` event and the
rank's log say why."""
from __future__ import annotations

import resource
from pathlib import Path

import torch

from ddp_hpc.judge.restarts import restored_text
from ddp_hpc.launch import launch_distributed
from ddp_hpc.train.checkpoint import save_checkpoint
from ddp_hpc.train.memsnap import NodeStore

FAST = "forkserver"  # ranks fork from one server that imported torch (tests/conftest.py)


def _state(seed: int, numel: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"epoch": 0, "batch_in_epoch": 0, "world_size": 4,
            "model": {"w": torch.randn(numel, generator=g), "b": torch.randn(7, generator=g)},
            "optimizer": {"state": {}, "param_groups": []}}


def _snapshot(root: Path, node: str, step: int, state: dict) -> Path:
    store = NodeStore(root / node, node)
    store.make()
    return store.write_state(step, state)


def _worker(rank: int, world: int, root: str, files: str, nodes: list[str], chunk: int | None,
            limit_extra: int | None) -> dict:
    import torch.distributed as dist

    from ddp_hpc.dist import cleanup_ddp, setup_ddp
    from ddp_hpc.train import peercopy, restore
    setup_ddp(timeout=60)
    if chunk is not None:
        peercopy.CHUNK_BYTES = chunk
    received: list[int] = []
    plain = dist.broadcast

    def spy(tensor, src=None, group=None, **kw):      # what this rank received from another
        out = plain(tensor, src=src, group=group, **kw)
        if src != rank:
            received.append(tensor.numel() * tensor.element_size())
        return out
    dist.broadcast = spy
    if limit_extra is not None:          # this rank's address space: what it has now and a little
        with open("/proc/self/statm") as f:
            now = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (now + limit_extra, resource.RLIM_INFINITY))
    warned: list[str] = []
    store = NodeStore(Path(root) / nodes[rank], nodes[rank])
    got = restore.freshest(files, store, rank=rank, distributed=True, warn=warned.append)
    if limit_extra is not None:
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    dist.barrier()
    cleanup_ddp()
    return {"step": got.step, "source": got.source, "event": got.event(), "line": got.line(),
            "model": got.state["model"], "received": received, "warned": warned}


def _launch(tmp_path: Path, nodes: list[str], layout, chunk=None, limit_extra=None) -> list[dict]:
    return launch_distributed(_worker, len(nodes), nodes=layout, start_method=FAST, timeout=180,
                              args=(str(tmp_path / "shm"), str(tmp_path / "ckpt"), nodes, chunk, limit_extra))


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_peer_restore_sends_bounded_chunks_only_to_the_ranks_that_lack_the_snapshot(tmp_path):
    state = _state(1, 3000)                            # about 12 kB: a dozen chunks of 1000 bytes
    path = _snapshot(tmp_path / "shm", "a", 5, state)
    save_checkpoint(tmp_path / "ckpt", 3, _state(2, 10))
    size = path.stat().st_size
    out = _launch(tmp_path, ["a", "a", "b", "b"], 2, chunk=1000)
    assert [r["source"] for r in out] == ["memory", "memory", "peer", "peer"], out
    assert {r["step"] for r in out} == {5}
    for r in out:
        assert _equal(r["model"], state["model"])      # the chunks put back together byte for byte
    assert out[0]["received"] == [] and out[1]["received"] == []   # the holders receive nothing
    for r in out[2:]:
        assert sum(r["received"]) == size and len(r["received"]) >= size // 1000, r["received"]
        assert max(r["received"]) <= 1000
    assert all(r["warned"] == [] and "fallback" not in r["event"] for r in out)


def test_a_broken_snapshot_on_one_holder_brings_every_rank_to_the_file_checkpoint(tmp_path):
    good = _state(1, 2000)
    _snapshot(tmp_path / "shm", "a", 5, good)
    broken = _snapshot(tmp_path / "shm", "b", 5, good)
    broken.write_bytes(broken.read_bytes()[: broken.stat().st_size // 2])     # node b's copy is cut
    file_state = _state(2, 10)
    ckpt = save_checkpoint(tmp_path / "ckpt", 3, file_state)
    out = _launch(tmp_path, ["a", "a", "b", "c"], (2, 1, 1), chunk=4096)
    assert [r["source"] for r in out] == ["file"] * 4, out      # rank 3 got it whole; yet all agree
    assert all(r["step"] == 3 and _equal(r["model"], file_state["model"]) for r in out)
    why = out[0]["event"]["fallback"]
    assert why.startswith("restore of step 5 from a's memory failed (rank 2: ") and all(
        r["event"]["fallback"] == why for r in out), why
    assert out[0]["line"] == restored_text(out[0]["event"])
    assert out[0]["line"].startswith(f"{why}: restored step 3 from {ckpt}, "), out[0]["line"]
    assert any("memory" in w and "failed" in w for w in out[2]["warned"]), out[2]["warned"]


def test_a_receiver_that_cannot_allocate_the_snapshot_falls_back_to_the_file_with_the_others(tmp_path):
    state = _state(1, 24 << 20)                        # 96 MB; the receiver has 48 MB to spare
    _snapshot(tmp_path / "shm", "a", 5, state)
    file_state = _state(2, 10)
    save_checkpoint(tmp_path / "ckpt", 3, file_state)
    out = launch_distributed(_limited, 3, nodes=3, start_method=FAST, timeout=180,
                             args=(str(tmp_path / "shm"), str(tmp_path / "ckpt"), ["a", "b", "c"], 8 << 20, 48 << 20))
    assert [r["source"] for r in out] == ["file"] * 3, out
    assert all(r["step"] == 3 and _equal(r["model"], file_state["model"]) for r in out)
    why = out[0]["event"]["fallback"]      # rank 2's error, not rank 1's "the send stopped"
    assert why.startswith("restore of step 5 from a's memory failed (rank 2: RuntimeError: "), why
    assert "can't allocate memory" in why, why
    assert all(r["warned"] and why in r["warned"][0] for r in out), [r["warned"] for r in out]


def _limited(rank: int, world: int, root: str, files: str, nodes: list[str], chunk: int, extra: int) -> dict:
    """`_worker`, with the last rank's address space limited to what it holds now and ``extra`` bytes."""
    return _worker(rank, world, root, files, nodes, chunk, extra if rank == world - 1 else None)
