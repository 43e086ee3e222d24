"""In-memory snapshots and the restore from the freshest copy (train/memsnap.py, train/restore.py),
with real gloo ranks: a restore from node memory, and from a peer node's memory sent over the
process group, gives bitwise the same weights, optimizer state and sample order as a restore from
the file checkpoint of the same step; a memory snapshot resumes on another world size; a rank
killed with SIGKILL while it writes leaves its node's newest snapshot whole."""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import random
import shutil
import signal
import socket
import time
import uuid
from pathlib import Path

import pytest
import torch

from ddp_hpc.judge.nodefiles import log_events, rank_events
from ddp_hpc.launch import RankFailedError, launch_distributed
from ddp_hpc.train.memsnap import MemSnapshots, NodeStore, job_folder

FAST = "forkserver"  # ranks fork from one server that imported torch (tests/conftest.py)

# 96 samples, 4 ranks x batch 4 = global batch 16: 6 steps an epoch, 2 epochs; dropout draws from
# each rank's RNG, so a restore that lost a rank's RNG states would train differently (a rank whose
# part went with its node starts from seed + rank, as on another world size: the cluster test)
COMMON = ["train.batch_size=4", "train.grad_accum=1", "train.epochs=2", "train.seed=0", "optim.name=adamw",
          "optim.lr=0.01", "schedule.name=cosine", "checkpoint.every_steps=3", "checkpoint.every_epochs=0",
          "log.progress=off", "log.every_n_steps=2", "train.eval_every_epochs=0", "preempt.check_every_steps=1"]
STEPS = 12


class Boom(RuntimeError):
    pass


def _worker(rank: int, world: int, job: str, run: str, ckpt: str, extra: list[str], fail_at: int | None):
    from ddp_hpc.examples.synthetic import SyntheticClassification
    from ddp_hpc.train import fit
    from ddp_hpc.train.build import seed_everything
    os.environ["DDP_HPC_JOB_ID"] = job          # the job whose node folders hold the snapshots
    seed_everything(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(16, 3))
    data = SyntheticClassification(size=96, in_dim=8, num_classes=3, seed=1)

    def hook(step: int, epoch: int) -> None:      # every rank's writes of step 3 end long before
        if fail_at is not None and rank == world - 1 and step == fail_at:
            time.sleep(1.0)
            raise Boom(f"injected at step {step}")
    res = fit(model, data, overrides=[*COMMON, f"log.dir={run}/logs", f"checkpoint.dir={ckpt}", *extra],
              on_step=hook)
    buf = io.BytesIO()
    torch.save(res.model.state_dict(), buf)
    return {"status": res.status, "step": res.step, "loss": res.loss, "state": buf.getvalue()}


def _launch(world: int, nodes: int, job: str, run: Path, ckpt: Path, extra=(), fail_at=None) -> dict:
    out = launch_distributed(_worker, world, args=(job, str(run), str(ckpt), list(extra), fail_at),
                             nodes=nodes, start_method=FAST, timeout=300)
    out[0]["state"] = torch.load(io.BytesIO(out[0]["state"]), weights_only=True)
    return out[0]


def _restored(run: Path) -> dict[int, dict]:
    out = {}
    for d in {p.parent for p in (run / "logs").rglob("*.events.jsonl")}:
        for stream in log_events(d).values():
            for e in stream.events:
                if e["event"] == "restored":
                    out[e["rank"]] = e
    return out


def _rank0_log(run: Path) -> str:
    return "".join(p.read_text() for p in (run / "logs").rglob("rank0.log"))


def _same(a, b) -> bool:
    """Bitwise equal nested state (tensors by their bytes)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture
def job():
    name = f"memsnap-test-{uuid.uuid4().hex[:8]}"
    yield name
    for folder in job_folder(name).parent.glob(f"{job_folder(name).name}*"):
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_a_restore_from_memory_or_a_peer_equals_the_file_restore_bitwise_also_on_another_world(tmp_path, job):
    """Real 2 x 2 runs: a restore from node memory, or from a peer node for the node whose snapshot
    was lost, equals the file restore bitwise; and a memory snapshot of 4 ranks resumes on 2."""
    ckpt = tmp_path / "ckpt"
    with pytest.raises(RankFailedError) as info:          # rank 3 fails at step 5: both tiers hold step 3
        _launch(4, 2, job, tmp_path / "first", ckpt, ["checkpoint.memory_every_steps=3"], fail_at=5)
    assert info.value.exc_type == "Boom"
    folder = job_folder(job, key=str(ckpt))      # the run's checkpoint directory keys its snapshots
    host = sorted(p.name for p in folder.iterdir() if p.is_dir())      # and the .job file
    assert len(host) == 2 and all(sorted(x.name for x in (folder / n).iterdir() if not x.name.startswith("."))
                                  == sorted(["ckpt-000000003.pt", f"rank{2 * i}-000000003.pt",
                                             f"rank{2 * i + 1}-000000003.pt"]) for i, n in enumerate(host))
    file_state = torch.load(ckpt / "ckpt-000000003.pt", weights_only=True)
    mem_state = torch.load(folder / host[0] / "ckpt-000000003.pt", weights_only=True)
    for key in ("model", "optimizer", "scheduler", "epoch", "batch_in_epoch", "samples_in_epoch", "world_size"):
        assert _same(mem_state[key], file_state[key]), key
    for r in range(4):
        part = torch.load(folder / host[r // 2] / f"rank{r}-000000003.pt", weights_only=True)
        assert _same(part["rng"], file_state["rng"][r]), r
    ckpt2 = tmp_path / "ckpt2"                          # for 2 ranks on 1 node, from memory only
    shutil.copytree(folder / host[0], job_folder(job + "-w2", key=str(ckpt2)) / socket.gethostname())

    # the file tier alone (snapshots off) from the file of step 3
    shutil.copytree(ckpt, tmp_path / "files")
    by_file = _launch(4, 2, job, tmp_path / "file", tmp_path / "files", ["checkpoint.memory_every_steps=-1"])
    assert _restored(tmp_path / "file")[0]["source"] == "file"
    # node 1's snapshot gone (its ranks' parts kept): ranks 0, 1 read their memory, 2 and 3 get it
    # from rank 0 over the process group
    (folder / host[1] / "ckpt-000000003.pt").unlink()
    (ckpt / "ckpt-000000003.pt").unlink()                # and no file: the memory is all there is
    by_mem = _launch(4, 2, job, tmp_path / "mem", ckpt)
    ev = _restored(tmp_path / "mem")
    assert [ev[r]["source"] for r in range(4)] == ["memory", "memory", "peer", "peer"], ev
    assert {ev[r]["step"] for r in range(4)} == {3} and {ev[r]["node"] for r in range(4)} == {host[0]}
    assert f"restored step 3 from {host[0]}'s memory ({host[1]} was lost), " in _rank0_log(tmp_path / "mem")
    assert by_file["status"] == by_mem["status"] == "completed" and by_file["step"] == by_mem["step"] == STEPS
    assert _same(by_mem["state"], by_file["state"]) and by_mem["loss"] == by_file["loss"]
    assert not folder.exists()                  # the clean end removed the job's snapshots
    # the snapshots' seconds on the training thread reach the step events (goodput's checkpoint share)
    steps = [e for d in {p.parent for p in (tmp_path / "mem" / "logs").rglob("*.events.jsonl")}
             for e in rank_events(d, 0).events]
    spent = [e["snapshot_s"] for e in steps if e["event"] == "step"]
    assert spent and all(s >= 0 for s in spent) and sum(spent) > 0, spent

    # a world size change from a memory snapshot: 2 ranks, accumulation 2, the same global batch
    on2 = _launch(2, 1, job + "-w2", tmp_path / "on2", ckpt2)
    assert _restored(tmp_path / "on2")[0]["source"] == "memory"
    log = _rank0_log(tmp_path / "on2")
    assert "resuming step 3 written by 4 ranks on 2 ranks: per-rank batch 4, accumulation 1 -> 2" in log
    assert on2["status"] == "completed" and on2["step"] == STEPS
    # the same samples per step, summed in another order (and the RNGs of 4 ranks do not map onto 2)
    assert max(float((on2["state"][k] - by_file["state"][k]).abs().max()) for k in on2["state"]) < 0.05


def _writer(folder: str) -> None:
    """A child that writes snapshots of a 4 MB state as fast as it can (no process group)."""
    torch.set_num_threads(1)
    store = NodeStore(folder, "here")
    snaps = MemSnapshots(store, rank=0, local_rank=0, every=1, device=torch.device("cpu"),
                         distributed=False, warn=print)
    w = torch.zeros(1 << 20)
    step = 0
    while True:
        step += 1
        w.fill_(float(step))
        snaps.after_step(step, lambda s=step: {"model": {"w": w}, "optimizer": {"step": s}, "epoch": 0,
                                        "batch_in_epoch": s})


def test_a_rank_killed_while_it_writes_leaves_its_node_snapshot_whole(tmp_path):
    folder = tmp_path / "node"
    ctx = mp.get_context(FAST)
    rng = random.Random(0)
    seen = []
    for _ in range(12):
        p = ctx.Process(target=_writer, args=(str(folder),))
        p.start()
        deadline = time.monotonic() + 30
        before = NodeStore(folder, "here").newest()
        while NodeStore(folder, "here").newest() == before:   # a new snapshot, then kill mid-way
            assert p.is_alive() and time.monotonic() < deadline, "the writer wrote no snapshot"
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.05))
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        step, path = NodeStore(folder, "here").newest()
        state = torch.load(path, weights_only=True)    # whole: loads, and holds its own step
        assert state["step"] == step and torch.equal(state["model"]["w"], torch.full((1 << 20,), float(step)))
        part = torch.load(folder / f"rank0-{step:09d}.pt", weights_only=True) \
            if (folder / f"rank0-{step:09d}.pt").exists() else None
        assert part is None or part["step"] == step
        seen.append(step)
    assert len(set(seen)) > 1, seen


def _script_worker(rank: int, world: int, job: str, ckpt: str) -> dict:
    from ddp_hpc import checkpoint
    from ddp_hpc.dist import cleanup_ddp, setup_ddp
    os.environ["DDP_HPC_JOB_ID"] = job
    setup_ddp()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), 0.1)
    for step in range(1, 4):
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        checkpoint.snapshot(model, opt, step=step, epoch=0)
        if step == 2:
            checkpoint.save(ckpt, model, opt, step=step, epoch=0)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    fresh, fresh_opt = torch.nn.Linear(4, 2), torch.optim.Adam(torch.nn.Linear(4, 2).parameters(), 0.1)
    got = checkpoint.load(ckpt, fresh, fresh_opt)           # step 3: the memory is newer than the file
    same = all(torch.equal(fresh.state_dict()[k], want[k]) for k in want)
    checkpoint.discard_snapshots()
    after = checkpoint.load(ckpt, torch.nn.Linear(4, 2))     # the snapshots gone: the file of step 2
    cleanup_ddp()
    return {"got": got, "same": same, "after": after, "gone": not job_folder(job, key=os.path.abspath(ckpt)).exists()}


def test_a_script_loads_the_newest_of_its_memory_snapshots_and_files(tmp_path, job):
    out = launch_distributed(_script_worker, 2, args=(job, str(tmp_path / "ckpt")), start_method=FAST, timeout=120)
    for res in out:
        assert res["got"] == {"epoch": 0, "step": 3} and res["same"], res
        assert res["after"] == {"epoch": 0, "step": 2} and res["gone"], res
