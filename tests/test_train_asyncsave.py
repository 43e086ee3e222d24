"""Checkpoints written in the background (train/asyncsave.py): the writer on real threads and files,
and the training loop in real gloo processes (the end of training and a preemption wait for the
writer; a resumed run from an async checkpoint equals one from a synchronous checkpoint, bitwise)."""
from __future__ import annotations

import io
import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from ddp_hpc.judge.nodefiles import rank_events
from ddp_hpc.launch import RankFailedError, launch_distributed
from ddp_hpc.train.asyncsave import AsyncSaver, Snapshot
from ddp_hpc.train.checkpoint import CheckpointError, list_checkpoints, load_checkpoint

FAST = "forkserver"  # ranks fork from one server that imported torch (tests/conftest.py)


class Gate:
    """A value whose pickling waits until the test opens the gate: it holds the writer thread in
    the middle of its real write (torch.save), so "while a save is in flight" is a fact."""

    def __init__(self) -> None:
        self.opened = threading.Event()

    def __reduce__(self):
        assert self.opened.wait(60), "the test never opened the gate"
        return (int, (0,))


def _state(seed: int, gate: Gate | None = None) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)},
            "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]},
            "epoch": 0, "batch_in_epoch": 0, "gate": gate}


# ----------------------------------------------------------------------------- the writer, in-process

def test_the_copy_is_independent_of_the_live_state_and_its_buffers_are_reused():
    live = _state(0)
    snap = Snapshot()
    first = snap.take(live)
    before = first["model"]["w"].clone()
    ptr = first["model"]["w"].data_ptr()
    live["model"]["w"].add_(1.0)                  # training goes on, in place
    live["optimizer"]["param_groups"][0]["lr"] = 0.5
    assert torch.equal(first["model"]["w"], before)
    assert first["optimizer"]["param_groups"][0]["lr"] == 0.1
    second = snap.take(live)
    assert second["model"]["w"].data_ptr() == ptr  # the same buffer, copied over
    assert torch.equal(second["model"]["w"], live["model"]["w"])
    assert snap.nbytes == (64 * 64 + 64 + 1) * 4


def test_a_failed_background_write_raises_on_the_next_save_naming_the_file(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the checkpoint directory should be\n")
    written = []
    saver = AsyncSaver(on_written=written.append)
    saver.save(tmp_path / "ok", 1, _state(1), keep_last=3).wait()
    failing = saver.save(blocker / "ckpt", 2, _state(2), keep_last=3)    # returns: the write is later
    with pytest.raises(CheckpointError) as err:
        saver.save(tmp_path / "ok", 3, _state(3), keep_last=3)
    text = str(err.value)
    assert str(failing.path) in text and "ckpt-000000002.pt" in text and "NotADirectoryError" in text
    assert "HINT:" in text
    assert [p.step for p in written] == [1]       # no event for the file that was not written
    assert saver.wait() is None                   # told once; the next save works again
    assert saver.save(tmp_path / "ok", 3, _state(3), keep_last=3).wait().exists()
    assert [s for s, _ in list_checkpoints(tmp_path / "ok")] == [3, 1]


def test_a_failed_write_raises_at_the_end_and_through_the_handle(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x\n")
    saver = AsyncSaver()
    pending = saver.save(blocker / "ckpt", 7, _state(7), keep_last=1)
    with pytest.raises(CheckpointError, match="ckpt-000000007.pt"):
        saver.wait()
    pending2 = saver.save(blocker / "ckpt", 8, _state(8), keep_last=1)
    with pytest.raises(CheckpointError, match="ckpt-000000008.pt"):
        pending2.wait()
    assert saver.wait() is None                   # the handle told it: not raised twice
    warned = []
    saver.save(blocker / "ckpt", 9, _state(9), keep_last=1)
    saver.close(warned.append)                    # a run that fails anyway: told, not raised
    assert len(warned) == 1 and "ckpt-000000009.pt" in warned[0]
    assert pending.error is not None


def test_one_save_in_flight_and_pruning_only_after_the_file_is_complete(tmp_path):
    order = []
    saver = AsyncSaver(on_written=lambda p: order.append(("written", p.step)))
    saver.save(tmp_path, 1, _state(1), keep_last=1).wait()
    gate = Gate()
    held = saver.save(tmp_path, 2, _state(2, gate), keep_last=1)
    # the writer is inside torch.save of step 2: step 1 stays, no step 2 under its final name
    assert not held.done
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    threading.Timer(0.5, gate.opened.set).start()
    saver.save(tmp_path, 3, _state(3), keep_last=1)   # waits for step 2's write first
    order.append(("returned", 3))
    assert order[:2] == [("written", 1), ("written", 2)] and order[2] == ("returned", 3)
    assert held.done and held.error is None
    saver.wait()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3]
    assert torch.equal(load_checkpoint(tmp_path / "ckpt-000000003.pt")["model"]["w"],
                       _state(3)["model"]["w"])


def test_a_blocking_save_writes_on_the_calling_thread_and_reports_all_as_blocking(tmp_path):
    seen = []
    saver = AsyncSaver(on_written=lambda p: seen.append((threading.current_thread().name,
                                                          p.blocking_s, p.write_s)))
    path = saver.save(tmp_path, 4, _state(4), keep_last=2, blocking=True).path
    assert path.exists() and saver.pending is None
    (name, blocking_s, write_s), = seen
    assert name == threading.current_thread().name and blocking_s >= write_s > 0


# ----------------------------------------------------------------------------- the loop, real ranks

def _cfg(tmp: str, *extra: str) -> list[str]:
    return [f"log.dir={tmp}/logs", f"checkpoint.dir={tmp}/ckpt", "log.progress=off",
            "log.every_n_steps=2", "train.eval_every_epochs=0", "preempt.check_every_steps=1",
            "train.batch_size=8", "train.epochs=2", "optim.momentum=0.9", "checkpoint.every_steps=2",
            *extra]


def _worker(rank: int, world: int, tmp: str, overrides: list[str], signal_at: int | None = None,
            ballast: int = 0):
    from ddp_hpc.examples.models import MLP
    from ddp_hpc.examples.synthetic import SyntheticClassification
    from ddp_hpc.train import fit
    from ddp_hpc.train.build import seed_everything
    seed_everything(0)
    model = MLP(in_dim=8, hidden=16, num_classes=3, dropout=0.2)
    if ballast:     # a frozen parameter: a big file to write (slow), no gradient, no per-step sync
        model.ballast = torch.nn.Parameter(torch.arange(ballast, dtype=torch.float32), requires_grad=False)
    data = SyntheticClassification(size=96, in_dim=8, num_classes=3, seed=1)

    def hook(step: int, epoch: int) -> None:       # a real signal, to the last rank only
        if signal_at is not None and rank == world - 1 and step == signal_at:
            os.kill(os.getpid(), signal.SIGUSR2)
    res = fit(model, data, config=None, overrides=overrides, on_step=hook)
    out = {"status": res.status, "step": res.step, "checkpoint": res.checkpoint,
           "resumed_from": res.resumed_from}
    if rank == 0:          # at once, after fit returned: the newest file is complete and loads
        state = load_checkpoint(res.checkpoint)
        out["saved_step"] = state["step"]
        state["model"].pop("ballast", None)      # not sent back: big, and checked by the file
        out["saved"] = {k: state[k] for k in ("model", "optimizer", "scheduler", "rng", "epoch",
                                              "batch_in_epoch")}
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def _launch(world: int, *args, timeout: float = 180):
    return [torch.load(io.BytesIO(b), weights_only=True)
            for b in launch_distributed(_worker, world, args=args, start_method=FAST, timeout=timeout)]


def _events(tmp: Path) -> list[dict]:
    """Rank 0's events of every run in ``tmp`` (a launch is a job of its own), in time order."""
    out = [e for d in {f.parent for f in (tmp / "logs").rglob("*.events.jsonl")} for e in rank_events(d, 0).events]
    return sorted(out, key=lambda e: e["time"])


def _equal(a, b, where: str = "") -> None:
    """Bitwise equal nested checkpoint values."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


BALLAST = 4_000_000


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_usr2_and_the_end_wait_for_the_write_and_async_checkpoints_resume_like_synchronous_ones(tmp_path):
    # 96 samples / 2 ranks / batch 8 = 6 steps an epoch, 12 in all; a 16 MB frozen parameter
    # makes each write take a while: it is still under way when the ranks stop
    runs = {}
    for mode in ("true", "false"):
        tmp = str(tmp_path / mode)
        cfg = _cfg(tmp, f"checkpoint.async={mode}", "checkpoint.every_steps=0")
        # SIGUSR2 on rank 1 after step 3; the ranks agree one step later: stop after step 4
        cut = _launch(2, tmp, cfg, 3, BALLAST)
        assert [o["status"] for o in cut] == ["preempted"] * 2 and cut[0]["saved_step"] == 4
        names = [(e["event"], e.get("step")) for e in _events(Path(tmp))]
        assert names.index(("checkpoint", 4)) < names.index(("preempt", 4))
        runs[mode] = cut[0]["saved"]
    _equal(runs["true"], runs["false"])     # the same step-4 state, whichever way it was written
    ends = {}
    for mode in ("true", "false"):          # resumed, checkpoints every 2 steps, to the end
        tmp = str(tmp_path / mode)
        end = _launch(2, tmp, _cfg(tmp, f"checkpoint.async={mode}"), None, BALLAST)
        assert end[0]["status"] == "completed" and end[0]["step"] == 12
        assert Path(end[0]["resumed_from"]).name == "ckpt-000000004.pt"
        assert end[0]["saved_step"] == 12      # complete when fit returned: the end waited for it
        events = _events(Path(tmp))
        names = [(e["event"], e.get("step")) for e in events]
        assert names.index(("checkpoint", 12)) < names.index(("end", 12))
        saves = [e for e in events if e["event"] == "checkpoint"]
        assert [e["step"] for e in saves] == [4, 6, 8, 10, 12]
        assert all(e["write_s"] > 0 and e["blocking_s"] > 0 for e in saves)
        assert [s for s, _ in list_checkpoints(Path(tmp) / "ckpt")] == [12, 10, 8]   # keep_last 3
        ends[mode] = end[0]["saved"]
    _equal(ends["true"], ends["false"])


def test_a_failed_write_in_the_loop_fails_the_run_naming_the_file(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where checkpoint.dir should be\n")
    cfg = _cfg(str(tmp_path)) + [f"checkpoint.dir={blocker}/ckpt"]
    with pytest.raises(RankFailedError) as err:
        _launch(1, str(tmp_path), cfg)
    assert err.value.rank == 0 and err.value.exc_type == "CheckpointError"
    assert f"{blocker}/ckpt/ckpt-000000002.pt" in err.value.message
    assert "NotADirectoryError" in err.value.message
