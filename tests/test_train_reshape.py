"""Resuming on another number of ranks (train/reshape.py): a 2 x 2 run's checkpoint from the middle
of an epoch resumed on 1 x 2 and on 1 x 1 keeps the global batch (more accumulation steps), trains exactly the
samples not seen yet, and ends with the uninterrupted run's weights and loss; a world size that
cannot keep the global batch is refused with the numbers and the choices; checkpoints written
before the layout fields existed still resume; the ranks' RNG states are carried over."""
from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch

from ddp_hpc.config import ConfigError, TrainConfig
from ddp_hpc.data.samplers import ResumableDistributedSampler, epoch_permutation
from ddp_hpc.launch import RankFailedError, launch_distributed
from ddp_hpc.train.reshape import plan_resume, rank_rng

FAST = "forkserver"  # ranks fork from one server that imported torch (tests/conftest.py)

# 96 samples, 4 ranks x batch 4 x accumulation 1 = global batch 16: 6 steps an epoch, 2 epochs
SIZE, STEPS = 96, 12
COMMON = ["train.batch_size=4", "train.grad_accum=1", "train.epochs=2", "train.seed=0",
          "optim.momentum=0.9", "optim.lr=0.2", "schedule.name=cosine", "schedule.warmup_steps=2",
          "checkpoint.every_epochs=1", "log.progress=off", "log.every_n_steps=2",
          "train.eval_every_epochs=0", "preempt.check_every_steps=1"]


def _worker(rank: int, world: int, run: str, ckpt: str, extra: list[str]):
    from ddp_hpc.examples.models import MLP
    from ddp_hpc.examples.synthetic import SyntheticClassification
    from ddp_hpc.train import fit
    from ddp_hpc.train.build import seed_everything
    seed_everything(0)
    model = MLP(in_dim=8, hidden=16, num_classes=3)
    data = SyntheticClassification(size=SIZE, in_dim=8, num_classes=3, seed=1)

    rng = []

    def hook(step: int, epoch: int) -> None:
        if not rng:                            # the RNG state after the first step (no dropout: as restored)
            rng.append(torch.get_rng_state().numpy().tobytes())
        torch.rand(1)                          # a draw per step, as dropout would: the state moves on
    res = fit(model, data, overrides=[*COMMON, f"log.dir={run}/logs", f"checkpoint.dir={ckpt}",
                                      *extra], on_step=hook)
    buf = io.BytesIO()
    torch.save(res.model.state_dict(), buf)
    return {"status": res.status, "step": res.step, "loss": res.loss, "state": buf.getvalue(),
            "resumed_from": res.resumed_from, "rng": rng[0] if rng else None}


def _launch(world: int, nodes: int, run: Path, ckpt: Path, extra=()) -> dict:
    out = launch_distributed(_worker, world, args=(str(run), str(ckpt), list(extra)),
                             nodes=nodes, start_method=FAST, timeout=120)
    out[0]["state"] = torch.load(io.BytesIO(out[0]["state"]), weights_only=True)
    out[0]["rngs"] = [o["rng"] for o in out]
    return out[0]


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _rank0_log(run: Path) -> str:
    return "".join(p.read_text() for p in (run / "logs").rglob("rank0.log"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted 2 x 2 run, which also checkpoints after step 3 (mid epoch 0): the resumes
    start from that checkpoint, as from a run stopped there (a stop by the preemption signal and
    its bitwise resume on the same ranks: tests/test_train_ddp.py), and end where it ended."""
    tmp = tmp_path_factory.mktemp("reshape")
    full = _launch(4, 2, tmp / "full", tmp / "full_ckpt", ["checkpoint.every_steps=3", "checkpoint.keep_last=5"])
    assert full["status"] == "completed" and full["step"] == STEPS
    (tmp / "cut_ckpt").mkdir()
    shutil.copy2(tmp / "full_ckpt" / "ckpt-000000003.pt", tmp / "cut_ckpt")
    return tmp, full


def _copy_cut(tmp: Path, name: str) -> Path:
    dest = tmp / f"{name}_ckpt"
    shutil.copytree(tmp / "cut_ckpt", dest)
    return dest


_resumed: dict[int, dict] = {}


def _resume_on(tmp: Path, world: int) -> dict:
    """The step-3 checkpoint resumed on ``world`` ranks of one node (run ``on<world>``): one launch,
    shared by the tests that read it."""
    if world not in _resumed:
        _resumed[world] = _launch(world, 1, tmp / f"on{world}", _copy_cut(tmp, f"on{world}"))
    return _resumed[world]


@pytest.mark.parametrize("world, accum", [(2, 2), (1, 4)])
def test_a_2x2_run_resumed_on_fewer_ranks_keeps_the_global_batch_and_ends_the_same(runs, world, accum):
    tmp, full = runs
    run = tmp / f"on{world}"
    res = _resume_on(tmp, world)
    assert res["status"] == "completed" and res["step"] == STEPS
    assert Path(res["resumed_from"]).name == "ckpt-000000003.pt"
    assert (f"resuming step 3 written by 4 ranks on {world} ranks: per-rank batch 4, "
            f"accumulation 1 -> {accum} (global batch 16 kept)") in _rank0_log(run)
    # the same samples per step, summed in another order: equal within float32 rounding
    assert _max_diff(res["state"], full["state"]) <= 1e-6    # seen: 3e-8
    assert res["loss"] == pytest.approx(full["loss"], rel=1e-6)
    saved = torch.load(run.parent / f"on{world}_ckpt" / f"ckpt-{STEPS:09d}.pt", weights_only=True)
    assert (saved["world_size"], saved["batch_size"], saved["grad_accum"]) == (world, 4, accum)


def test_a_checkpoint_without_the_layout_fields_resumes_on_another_world_size(runs):
    tmp, full = runs
    ckpt = _copy_cut(tmp, "old")
    path = ckpt / "ckpt-000000003.pt"
    state = torch.load(path, weights_only=True)
    assert state["samples_in_epoch"] == 48 and state["batch_in_epoch"] == 3
    for key in ("batch_size", "grad_accum", "samples_in_epoch"):   # as written before they existed
        del state[key]
    torch.save(state, path)
    run = tmp / "old"
    res = _launch(2, 1, run, ckpt)
    assert res["status"] == "completed" and res["step"] == STEPS
    assert "accumulation 1 -> 2 (global batch 16 kept)" in _rank0_log(run)
    assert _max_diff(res["state"], full["state"]) <= 1e-6


def test_the_rng_states_are_carried_over_a_world_size_change(runs):
    """Resumed on 2 ranks, ranks 0 and 1 go on from the RNG states ranks 0 and 1 of the 2 x 2 run
    saved, exactly as a resume on the same 4 ranks does (before: seed + rank, a fresh stream)."""
    tmp, _ = runs
    same = _launch(4, 2, tmp / "rng4", _copy_cut(tmp, "rng4"))
    fewer = _resume_on(tmp, 2)                   # the 2-rank resume of the test above
    assert same["resumed_from"] and fewer["resumed_from"]
    assert fewer["rngs"] == same["rngs"][:2] and fewer["rngs"][0] != fewer["rngs"][1]
    assert "the RNG states of 4 ranks carried onto 2: rank 0 goes on from the old rank's" in _rank0_log(tmp / "on2")


def test_a_rank_the_old_run_did_not_have_is_seeded_from_the_old_states_deterministically(runs):
    """Growing (2 old ranks' states onto 4): ranks 0-1 keep theirs, ranks 2 and 3 get seeds of
    their own, the same on every resume and changed by any old rank's state."""
    tmp, _ = runs
    state = torch.load(tmp / "cut_ckpt" / "ckpt-000000003.pt", weights_only=True)
    old = state["rng"][:2]
    got = [rank_rng(old, r) for r in range(4)]
    assert got[0] is old[0] and got[1] is old[1]
    assert isinstance(got[2], int) and isinstance(got[3], int) and got[2] != got[3]
    assert [rank_rng(old, r) for r in (2, 3)] == got[2:]
    assert rank_rng(state["rng"][1:3], 2) != got[2]


def test_a_world_size_that_cannot_keep_the_global_batch_is_refused(runs):
    tmp, _ = runs
    with pytest.raises(RankFailedError) as info:
        _launch(3, 1, tmp / "on3", _copy_cut(tmp, "on3"))
    assert info.value.exc_type == "ConfigError"
    msg = info.value.message
    assert ("cannot resume step 3 on 3 ranks with the same global batch: it was written by 4 ranks "
            "x per-rank batch 4 x accumulation 1 = global batch 16, and 16 is not a multiple of "
            "per-rank batch 4 x 3 ranks = 12") in msg
    assert "HINT: run on a number of ranks that divides 16 / 4 = 4 (1, 2, 4)" in msg
    assert "train.allow_global_batch_change=true to go on with global batch 12" in msg


def _state(world: int, batch: int, accum: int, step: int, samples: int) -> dict:
    return {"step": step, "epoch": 0, "batch_in_epoch": samples // (world * batch),
            "world_size": world, "batch_size": batch, "grad_accum": accum, "samples_in_epoch": samples}


def test_the_per_rank_batch_changes_only_when_allowed():
    state = _state(4, 4, 1, 3, 48)                  # global batch 16; 8 ranks x 4 cannot keep it
    with pytest.raises(ConfigError, match="allow_batch_size_change=true \\(per-rank batch 2 x "
                                          "accumulation 1 keeps it\\)"):
        plan_resume(state, TrainConfig(batch_size=4), 8)
    plan = plan_resume(state, TrainConfig(batch_size=4, allow_batch_size_change=True), 8)
    assert (plan.layout.batch_size, plan.layout.grad_accum, plan.samples) == (2, 1, 48)
    assert plan.note.endswith("per-rank batch 4 -> 2, accumulation 1 -> 1 (global batch 16 kept)")
    assert plan.warning is None


def test_an_allowed_global_batch_change_says_what_changed_and_where_the_epoch_goes_on():
    plan = plan_resume(_state(4, 4, 1, 5, 80), TrainConfig(batch_size=4, allow_global_batch_change=True), 3)
    assert (plan.layout.global_batch, plan.samples) == (12, 72)   # the last step boundary of 12
    assert plan.note.endswith("(global batch 16 -> 12 changed)")
    assert "global batch 16 -> 12" in plan.warning and "8 samples" in plan.warning


def test_the_sampler_position_is_global_so_other_ranks_go_on_with_the_unseen_samples():
    n, seed, epoch = 50, 3, 1
    order = epoch_permutation(n, 1, seed, epoch)

    def consumed(world: int, start: int, per_rank: int | None = None) -> list[int]:
        out = []
        for rank in range(world):
            s = ResumableDistributedSampler(n, world, rank, seed)
            s.epoch, s.start = epoch, start
            out += list(s)[:per_rank]
        return out
    before = consumed(4, 0, 6)                       # 4 ranks took 24 samples (6 each)...
    after = consumed(3, 24)                          # ...3 ranks go on from global position 24
    assert sorted(before) == sorted(order[:24])
    # the other 26, each once, plus one padding sample (DistributedSampler's: the order's first)
    assert len(after) == 27 and sorted(after) == sorted(order[24:] + order[:1])
    s = ResumableDistributedSampler(n, 3, 0, seed)
    s.start = 25
    with pytest.raises(ValueError, match="start=25 is not a multiple of world_size=3"):
        list(s)
