"""Checkpoints: atomic writes survive kill -9 at random moments, broken files are skipped, keep-last,
RNG states round-trip through weights_only loading."""
from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time

import numpy as np
import pytest
import torch

from ddp_hpc.train import checkpoint as ckpt


def _state(step: int, big: bool = False) -> dict:
    # big: ~2000 small tensors, so most of a save is spent writing the file (where kills must land)
    layers = {f"l{i}": torch.full((256,), float(step)) for i in range(2000 if big else 1)}
    return {"epoch": step // 10, "batch_in_epoch": step % 10,
            "model": {"b": torch.tensor([step]), **layers},
            "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]},
            "rng": [ckpt.rng_state()]}


def _writer(directory: str, start: int) -> None:
    """Writes checkpoints step after step until killed (this is the subject of the kill -9)."""
    step = start
    while True:
        step += 1
        ckpt.save_checkpoint(directory, step, _state(step, big=True), keep_last=2)


def test_kill_9_during_checkpoint_writes_never_leaves_an_unloadable_newest(tmp_path):
    ctx = mp.get_context("fork")          # the child has torch already: it starts writing at once
    rnd = random.Random(1234)
    d = str(tmp_path)
    last_step, mid_write_kills = 0, 0
    ckpt.save_checkpoint(d, 0, _state(0, big=True))     # what the user had before the first kill
    for i in range(200):   # 20 kills, and more while a loaded machine let the writers do little
        if i >= 20 and last_step > 5 and mid_write_kills >= 1:
            break
        p = ctx.Process(target=_writer, args=(d, last_step))
        p.start()
        time.sleep(rnd.uniform(0.05, 0.4))
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        assert p.exitcode == -signal.SIGKILL
        if list(tmp_path.glob(".ckpt-tmp-*")):
            mid_write_kills += 1
        found = ckpt.find_latest_valid(d, warn=pytest.fail)   # no final-named file is broken
        assert found is not None
        path, state = found
        assert state["step"] >= last_step                      # nothing older wins
        assert len(state["model"]) == 2001
        assert all(torch.equal(v, torch.full((256,), float(state["step"])))
                   for k, v in state["model"].items() if k != "b")
        # and it resumes: the model loads, the RNG state applies
        m = torch.nn.Linear(1, 1)
        m.load_state_dict({"weight": torch.zeros(1, 1), "bias": state["model"]["b"].float()})
        ckpt.set_rng_state(state["rng"][0])
        last_step = state["step"]
    assert last_step > 5                               # the writers did make progress
    assert mid_write_kills >= 1, "no kill landed during a write: the test proved nothing"
    # leftovers of killed writers are cleaned by the next save, and keep_last holds
    ckpt.save_checkpoint(d, last_step + 1, _state(last_step + 1), keep_last=2)
    assert not list(tmp_path.glob(".ckpt-tmp-*"))
    assert [s for s, _ in ckpt.list_checkpoints(d)] == [last_step + 1, last_step]


def test_corrupt_and_foreign_files_are_skipped_with_a_warning(tmp_path):
    for s in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, s, _state(s), keep_last=5)
    ckpt.checkpoint_path(tmp_path, 3).write_bytes(b"PK\x03\x04 truncated zip")
    torch.save({"not": "ours"}, ckpt.checkpoint_path(tmp_path, 4))
    warnings: list[str] = []
    path, state = ckpt.find_latest_valid(tmp_path, warn=warnings.append)
    assert state["step"] == 2 and path == ckpt.checkpoint_path(tmp_path, 2)
    assert len(warnings) == 2
    assert "ckpt-000000004.pt" in warnings[0] and "format marker" in warnings[0]
    assert "ckpt-000000003.pt" in warnings[1]


def test_keep_last_and_empty_dir(tmp_path):
    assert ckpt.find_latest_valid(tmp_path / "missing") is None
    for s in range(1, 6):
        ckpt.save_checkpoint(tmp_path, s, _state(s), keep_last=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [5, 4]


def test_rng_state_round_trip_through_weights_only_load(tmp_path):
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    ckpt.save_checkpoint(tmp_path, 1, _state(1))
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    _, state = ckpt.find_latest_valid(tmp_path)
    ckpt.set_rng_state(state["rng"][0])
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected
