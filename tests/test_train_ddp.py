"""The training core in real gloo process groups: DDP == one big batch, exact evaluation, and a run
stopped by the preemption signal resuming to bitwise the same parameters."""
from __future__ import annotations

import io
import os
import signal
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

from ddp_hpc.judge.nodefiles import log_events
from ddp_hpc.launch import launch_distributed

FAST = "forkserver"  # ranks fork from one server that imported torch (tests/conftest.py)


def _cfg(tmp: str, *extra: str) -> list[str]:
    return [f"log.dir={tmp}/logs", f"checkpoint.dir={tmp}/ckpt", "log.progress=off",
            "log.every_n_steps=2", "train.eval_every_epochs=0", "preempt.check_every_steps=1",
            *extra]


def _fit_worker(rank: int, world: int, tmp: str, size: int, overrides: list[str],
                model_kwargs: dict, signal_at: int | None = None):
    from ddp_hpc.examples.models import MLP
    from ddp_hpc.examples.synthetic import SyntheticClassification
    from ddp_hpc.train import fit
    from ddp_hpc.train.build import seed_everything
    seed_everything(0)
    model = MLP(in_dim=8, hidden=16, num_classes=3, **model_kwargs)
    data = SyntheticClassification(size=size, in_dim=8, num_classes=3, seed=1)

    def hook(step: int, epoch: int) -> None:   # a real signal, delivered to this process
        if signal_at is not None and rank == world - 1 and step == signal_at:
            os.kill(os.getpid(), signal.SIGUSR2)
    res = fit(model, data, config=None, overrides=overrides, on_step=hook)
    buf = io.BytesIO()      # tensors as bytes: a tensor sent through a pipe would share memory
    torch.save(res.model.state_dict(), buf)   # with a process that is about to exit
    return {"status": res.status, "step": res.step, "reason": res.reason, "state": buf.getvalue(),
            "resumed_from": res.resumed_from, "checkpoint": res.checkpoint,
            "requeued": res.requeued}


def _launch(world: int, *args, timeout: float = 120):
    out = launch_distributed(_fit_worker, world, args=args, start_method=FAST, timeout=timeout)
    for r in out:
        r["state"] = torch.load(io.BytesIO(r["state"]), weights_only=True)
    return out


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _fits_worker(rank: int, world: int, runs: list[tuple]) -> list[dict]:
    """`_fit_worker` for each of ``runs`` in turn, in one process group set up once (fit uses a
    group it finds as is): one start of the ranks for several runs."""
    from ddp_hpc.dist import cleanup_ddp, setup_ddp
    setup_ddp()
    try:
        return [_fit_worker(rank, world, *run) for run in runs]
    finally:
        cleanup_ddp()


@pytest.fixture(scope="module")
def equivalence(tmp_path_factory) -> dict:
    """accum -> (the 4 ranks' results, the one process's): 4 ranks x batch 8 x accum a against
    1 process x batch 32a, each step the same samples; both accumulations in one launch of 4
    ranks and one of 1 (each run in its own directories)."""
    tmp, b = tmp_path_factory.mktemp("equiv"), 8
    common = ["optim.momentum=0.9", "optim.lr=0.2", "train.epochs=1", "train.seed=0"]
    four, one = [], []
    for accum in (1, 2):
        size = 32 * accum * 3        # 3 optimizer steps, dataset divisible (no padding)
        four.append((str(tmp / f"four{accum}"), size, _cfg(str(tmp / f"four{accum}"), *common,
                     f"train.batch_size={b}", f"train.grad_accum={accum}"), {}))
        one.append((str(tmp / f"one{accum}"), size, _cfg(str(tmp / f"one{accum}"), *common,
                    f"train.batch_size={4 * b * accum}"), {}))
    outs = {}
    for world, runs in ((4, four), (1, one)):
        per_rank = launch_distributed(_fits_worker, world, args=(runs,), start_method=FAST, timeout=120)
        for i, accum in enumerate((1, 2)):
            res = [r[i] for r in per_rank]
            for r in res:
                r["state"] = torch.load(io.BytesIO(r["state"]), weights_only=True)
            outs.setdefault(accum, []).append(res)
    return outs


@pytest.mark.parametrize("accum", [1, 2])
def test_four_ranks_equal_one_process_with_four_times_the_batch(equivalence, accum):
    four, one = equivalence[accum]
    assert [r["step"] for r in four] == [3] * 4 and one[0]["step"] == 3
    for r in four[1:]:                             # DDP keeps replicas identical
        assert _max_diff(r["state"], four[0]["state"]) == 0.0
    from ddp_hpc.examples.models import MLP
    torch.manual_seed(0)
    init = MLP(in_dim=8, hidden=16, num_classes=3).state_dict()
    assert _max_diff(one[0]["state"], init) > 1e-3   # training really moved the weights
    assert _max_diff(four[0]["state"], one[0]["state"]) <= 1e-6


def _eval_worker(rank: int, world: int, size: int):
    from ddp_hpc.dist import cleanup_ddp, setup_ddp
    from ddp_hpc.examples.models import MLP
    from ddp_hpc.examples.synthetic import SyntheticClassification
    from ddp_hpc.train.metrics import evaluate
    from ddp_hpc.train.parts import RankPlace
    ctx = setup_ddp()
    try:
        torch.manual_seed(3)
        model = MLP(in_dim=8, hidden=16, num_classes=3)
        data = SyntheticClassification(size=size, in_dim=8, num_classes=3, seed=2)
        return evaluate(model, data, torch.nn.CrossEntropyLoss(), RankPlace(rank, world, ctx.device, world > 1),
                        batch_size=5)
    finally:
        cleanup_ddp()


def test_exact_evaluation_on_4n_plus_3_samples_over_4_ranks():
    size = 4 * 10 + 3
    # what a padded DistributedSampler would evaluate: 44 samples, one counted twice
    padded = sum(len(DistributedSampler(range(size), num_replicas=4, rank=r)) for r in range(4))
    assert padded == size + 1
    four = launch_distributed(_eval_worker, 4, args=(size,), start_method=FAST, timeout=60)
    one = launch_distributed(_eval_worker, 1, args=(size,), start_method=FAST, timeout=60)[0]
    assert one["count"] == size
    for m in four:                                  # every rank holds the global result
        assert m["count"] == size
        assert m["correct"] == one["correct"]
        assert m["accuracy"] == one["accuracy"]
        assert abs(m["loss"] - one["loss"]) <= 1e-6 * max(1.0, abs(one["loss"]))


def _events(log_root: Path, name: str) -> list[dict]:
    out = []
    for d in {f.parent for f in log_root.rglob("*.events.jsonl")}:
        out += [e for s in log_events(d).values() for e in s.events if e["event"] == name]
    return sorted(out, key=lambda e: e["time"])


def test_preempted_run_resumes_bitwise_equal(tmp_path):
    """The training core's preemption and resume end bitwise where an uninterrupted run ends (three
    real runs of 4 ranks)."""
    # 198 samples / 4 ranks / batch 8 -> 7 micro-batches per epoch (the last one padded),
    # accum 2 -> 4 steps per epoch, 3 epochs = 12 steps; dropout makes the RNG state matter, and
    # 4 ranks make the all-reduce summation order matter (DDP's bucket layout, see step.py)
    size, world = 198, 4
    common = ["train.batch_size=8", "train.grad_accum=2", "train.epochs=3", "optim.momentum=0.9",
              "schedule.name=cosine", "schedule.warmup_steps=2", "checkpoint.every_epochs=1"]
    mk = {"dropout": 0.2}
    full = _launch(world, str(tmp_path / "full"), size, _cfg(str(tmp_path / "full"), *common), mk)
    assert full[0]["status"] == "completed" and full[0]["step"] == 12

    cut = str(tmp_path / "cut")
    first = _launch(world, cut, size, _cfg(cut, *common), mk, 5)   # SIGUSR2 on rank 3 at step 5
    # the ranks agree one step later (the flag's all_reduce overlaps step 6): stop after step 6,
    # in the middle of epoch 1
    assert [r["status"] for r in first] == ["preempted"] * world
    assert [r["step"] for r in first] == [6] * world
    assert first[0]["reason"] == "preemption" and not first[0]["requeued"]
    assert Path(first[0]["checkpoint"]).name == "ckpt-000000006.pt"
    pre = _events(Path(cut) / "logs", "preempt")
    assert sorted(e["rank"] for e in pre) == [0, 1, 2, 3]
    assert {e["signal"] for e in pre if e["rank"] == 3} == {"SIGUSR2"}   # only rank 3 got it
    assert {e["signal"] for e in pre if e["rank"] != 3} == {None}

    second = _launch(world, cut, size, _cfg(cut, *common), mk)
    assert second[0]["status"] == "completed" and second[0]["step"] == 12
    assert Path(second[0]["resumed_from"]).name == "ckpt-000000006.pt"
    for a, b in zip(second, full):
        for k in a["state"]:
            assert torch.equal(a["state"][k], b["state"][k]), k
    ends = [e["status"] for e in _events(Path(cut) / "logs", "end") if e["rank"] == 0]
    assert ends == ["preempted", "completed"]


def test_seed_signature_train_ddp_runs_under_launch_distributed(tmp_path, monkeypatch):
    from ddp_hpc.examples.models import Linear
    from ddp_hpc.train import train_ddp
    monkeypatch.chdir(tmp_path)                    # default log dir ./runs lands in tmp
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(90, 32, generator=g), torch.randint(0, 10, (90,), generator=g))
    res = launch_distributed(train_ddp, 2, args=(Linear, data, 2), start_method=FAST, timeout=60)
    assert [r.status for r in res] == ["completed", "completed"]
    assert res[0].step == 2 * 2                      # 45 samples per rank, batch 32 -> 2 steps
    a, b = res[0].state_dict(), res[1].state_dict()
    assert list(a) == ["fc.weight", "fc.bias"]       # no "module." prefix
    assert all(torch.equal(a[k], b[k]) for k in a)
    torch.manual_seed(0)
    assert not torch.equal(a["fc.weight"], Linear().fc.weight.detach())
    assert (tmp_path / "runs").is_dir()
