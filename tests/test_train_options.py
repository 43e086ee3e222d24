"""Loop options in real process groups: bf16 autocast, DataParallel in one process, gradient
clipping and zero-gradient filtering, and the refusals that name the fix."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from ddp_hpc.launch import RankFailedError, launch_distributed

FAST = "forkserver"  # ranks fork from one server that imported torch (tests/conftest.py)


class TwoHeads(nn.Module):
    """`unused` never takes part in the loss: its gradient stays zero (or None)."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(8, 3)
        self.unused = nn.Linear(8, 3)

    def forward(self, x):
        return self.used(x) + 0.0 * self.unused(x)     # in the graph, zero gradient


def _worker(rank: int, world: int, tmp: str, overrides: list[str], two_heads: bool):
    from ddp_hpc.examples.models import Linear
    from ddp_hpc.examples.synthetic import SyntheticClassification
    from ddp_hpc.train import fit
    torch.manual_seed(0)
    model = TwoHeads() if two_heads else Linear(in_dim=8, num_classes=3)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    res = fit(model, SyntheticClassification(size=64, in_dim=8, num_classes=3),
              eval_dataset=SyntheticClassification(size=21, in_dim=8, num_classes=3, seed=5),
              overrides=[f"log.dir={tmp}/logs", f"checkpoint.dir={tmp}/ckpt", "log.progress=off",
                         "train.batch_size=8", "train.epochs=2", *overrides])
    after = res.state_dict()
    return {"status": res.status, "eval": res.eval_metrics,
            "moved": {k: not torch.equal(before[k], after[k]) for k in before}}


def _run(world, tmp, overrides, two_heads=False):
    return launch_distributed(_worker, world, args=(str(tmp), overrides, two_heads),
                              start_method=FAST, timeout=90)


def test_bf16_autocast_trains_and_evaluates_exactly(tmp_path):
    out = _run(2, tmp_path, ["train.precision=bf16", "optim.momentum=0.9"])
    assert [r["status"] for r in out] == ["completed"] * 2
    assert out[0]["eval"]["count"] == 21 and out[0]["eval"] == out[1]["eval"]
    assert all(out[0]["moved"].values())


def test_dataparallel_strategy_runs_in_one_process_and_is_refused_in_several(tmp_path):
    out = _run(1, tmp_path / "dp", ["train.strategy=dp"])
    assert out[0]["status"] == "completed" and all(out[0]["moved"].values())
    with pytest.raises(RankFailedError, match=r"train.strategy='dp' runs in one process.*world_size=2"):
        _run(2, tmp_path / "dp2", ["train.strategy=dp"])


def test_fp16_without_cuda_is_refused_with_the_fix(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: fp16 is allowed")
    with pytest.raises(RankFailedError, match=r"fp16 needs CUDA.*\n.*HINT: use train.precision=bf16"):
        _run(1, tmp_path, ["train.precision=fp16"])


def test_zero_gradient_filtering_keeps_momentum_and_decay_off_unused_weights(tmp_path):
    common = ["optim.momentum=0.9", "optim.weight_decay=0.1", "train.find_unused_parameters=true",
              "train.clip_grad_norm=0.5"]
    plain = _run(2, tmp_path / "a", common, two_heads=True)[0]["moved"]
    filtered = _run(2, tmp_path / "b", [*common, "train.filter_zero_grads=true"], two_heads=True)[0]["moved"]
    assert plain["unused.weight"]            # weight decay moves a zero-gradient weight ...
    assert not filtered["unused.weight"]     # ... unless its all-zero gradient is dropped
    assert not filtered["unused.bias"]
    assert filtered["used.weight"] and filtered["used.bias"]


def _screen(raw: str) -> list[str]:
    """What a terminal shows for `raw`: carriage returns move to the line start, later characters
    overwrite earlier ones."""
    lines, cur, col = [], [], 0
    for ch in raw:
        if ch == "\n":
            lines.append("".join(cur).rstrip())
            cur, col = [], 0
        elif ch == "\r":
            col = 0
        else:
            cur[col:col + 1] = [ch]
            col += 1
    return lines + ["".join(cur).rstrip()]


def test_log_lines_never_land_on_the_progress_bar(tmp_path, monkeypatch):
    import io
    import sys

    from ddp_hpc.runlogs.schema import text_log
    from ddp_hpc.runlogs.writer import RunLog, StepBar
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    progress = StepBar(rank=0, total=4, initial=0, mode="bar")     # log.progress=bar
    log = RunLog(tmp_path, rank=0)
    assert not progress.bar.disable and not progress.lines
    for step in range(4):
        progress.update(1)
        log.info(f"epoch 0 step {step + 1}/4")
        log.warning("a warning reaches the console too")
    progress.close()
    log.close()
    written = (tmp_path / text_log(0)).read_text().splitlines()
    shown = _screen(stream.getvalue())
    assert len(written) == 8 and "|" in stream.getvalue()             # the bar was drawn
    infos = [line for line in written if "WARNING" not in line]
    assert len(infos) == 4
    for line in infos:                             # each log line is a whole line of its own
        assert line in shown, (line, shown)
    assert shown.count("[rank 0] WARNING: a warning reaches the console too") == 4, shown
    assert any("4/4" in s and "|" in s for s in shown)                 # the bar ends on its own line
