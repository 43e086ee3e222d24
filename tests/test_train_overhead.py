"""What keeps the toolkit's step path cheap, and that it stays correct: the preemption flag checked
every N steps (fixed or automatic) still stops every rank at the same step, a log interval's
numbers all-reduced asynchronously still give one complete, identical step event per log step on
every rank, and the resource sampler's throttle.  Real gloo process groups, as tests/test_train_ddp."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from ddp_hpc.judge.nodefiles import log_events
from ddp_hpc.launch import launch_distributed

REPO = Path(__file__).resolve().parents[1]
FAST = "forkserver"  # ranks fork from one server that imported torch (tests/conftest.py)


def _fit_worker(rank: int, world: int, tmp: str, overrides: list[str], signal_at: int | None,
                step_sleep: float) -> dict:
    from ddp_hpc.examples.models import MLP
    from ddp_hpc.examples.synthetic import SyntheticClassification
    from ddp_hpc.train import fit
    torch.manual_seed(0)
    model = MLP(in_dim=8, hidden=16, num_classes=3)
    data = SyntheticClassification(size=world * 4 * 60, in_dim=8, num_classes=3, seed=1)

    def hook(step: int, epoch: int) -> None:
        if step_sleep:                       # slow steps: the automatic interval becomes small
            time.sleep(step_sleep)
        if signal_at is not None and rank == world - 1 and step == signal_at:
            os.kill(os.getpid(), signal.SIGUSR2)   # a real signal, on one rank only
    res = fit(model, data, overrides=[f"log.dir={tmp}/logs", f"checkpoint.dir={tmp}/ckpt",
                                      "log.progress=off", "train.batch_size=4",
                                      "train.eval_every_epochs=0", *overrides], on_step=hook)
    return {"status": res.status, "step": res.step, "checkpoint": res.checkpoint, "loss": res.loss}


def _run(tmp: Path, world: int, overrides: list[str], signal_at: int | None = None,
         step_sleep: float = 0.0) -> list[dict]:
    return launch_distributed(_fit_worker, world, args=(str(tmp), overrides, signal_at, step_sleep),
                              start_method=FAST, timeout=180)


def _events(root: Path) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for d in {f.parent for f in root.rglob("*.events.jsonl")}:
        for r, s in log_events(d).items():
            out.setdefault(r, []).extend(s.events)
    return out          # in the order each rank wrote them


def test_flag_checked_every_3_steps_stops_every_rank_at_the_same_step(tmp_path):
    # 60 steps per epoch; the signal reaches rank 2 during step 5.  Checks at steps 3, 6, 9...:
    # the all_reduce started at 6 carries the flag, the one read at 9 decides -> all stop at 9
    out = _run(tmp_path, 3, ["preempt.check_every_steps=3", "log.every_n_steps=4"], signal_at=5)
    assert [r["status"] for r in out] == ["preempted"] * 3
    assert [r["step"] for r in out] == [9] * 3
    assert Path(out[0]["checkpoint"]).name == "ckpt-000000009.pt"
    ev = _events(tmp_path / "logs")
    for rank, events in ev.items():
        names = [e["event"] for e in events]
        # the step events of steps 4 and 8 are all written, before the preempt event
        assert [e["step"] for e in events if e["event"] == "step"] == [4, 8], rank
        assert names.index("preempt") > max(i for i, n in enumerate(names) if n == "step")
        assert [e["step"] for e in events if e["event"] == "preempt"] == [9]


def test_automatic_check_interval_stops_every_rank_at_the_same_step(tmp_path):
    # steps of ~40 ms: after the first log interval (read back at step 3) the ranks check about
    # every 0.2 s, i.e. every 4-5 steps, at the same steps since they compute the interval from
    # the same all-reduced numbers
    out = _run(tmp_path, 2, ["preempt.check_every_steps=0", "log.every_n_steps=2"],
               signal_at=12, step_sleep=0.04)
    steps = [r["step"] for r in out]
    assert [r["status"] for r in out] == ["preempted"] * 2
    assert steps[0] == steps[1] and 12 < steps[0] <= 12 + 2 * 5, steps   # interval <= 0.2/0.04


def test_asynchronous_step_events_are_complete_and_equal_on_every_rank(tmp_path):
    # 2 epochs of 60 steps, a step event every 7 steps and at the last step (120)
    out = _run(tmp_path, 2, ["train.epochs=2", "log.every_n_steps=7", "checkpoint.every_epochs=0"])
    assert [r["status"] for r in out] == ["completed"] * 2
    assert out[0]["loss"] == out[1]["loss"] is not None
    ev = _events(tmp_path / "logs")
    want = [*range(7, 120, 7), 120]
    for rank, events in ev.items():
        steps = [e for e in events if e["event"] == "step"]
        assert [e["step"] for e in steps] == want, rank
        assert [e["epoch"] for e in steps] == [0] * 8 + [1] * 10
        assert all(e["samples_per_s"] > 0 and "rss_mb" in e for e in steps)
        names = [e["event"] for e in events]
        # epoch 0 ends at step 60: its event follows the step event of step 56, precedes 63's
        i = names.index("epoch")
        assert names[i - 1] == "step" and events[i - 1]["step"] == 56 and events[i + 1]["step"] == 63
        # the last step event comes before the last epoch event, the checkpoint (announced by a
        # progress event, the supervisor's sign of life during a long save) and the end
        tail = ["step", "epoch", "progress", "checkpoint", "end"] if rank == 0 else ["step", "epoch", "end"]
        assert names[-len(tail):] == tail
    losses = [[e["loss"] for e in ev[r] if e["event"] == "step"] for r in (0, 1)]
    assert losses[0] == losses[1] and out[0]["loss"] == losses[0][-1]


def _async_sum_worker(rank: int, world: int) -> list[list[float]]:
    from ddp_hpc.dist import cleanup_ddp, setup_ddp
    from ddp_hpc.train.metrics import AsyncSum
    setup_ddp()
    try:
        a = AsyncSum(torch.tensor(0.5 * (rank + 1)), [rank, 10.0], torch.device("cpu"))
        b = AsyncSum(torch.tensor(1.0), [2.0 ** 40 + rank], torch.device("cpu"))  # two in flight
        return [b.result(), a.result()]
    finally:
        cleanup_ddp()


def test_async_sum_over_three_ranks():
    out = launch_distributed(_async_sum_worker, 3, start_method=FAST, timeout=60)
    assert out == [[[3.0, 3 * 2.0 ** 40 + 3], [3.0, 3.0, 30.0]]] * 3


def test_async_sum_without_a_process_group():
    from ddp_hpc.train.metrics import AsyncSum
    assert AsyncSum(torch.tensor(2.5), [1, 2], torch.device("cpu")).result() == [2.5, 1.0, 2.0]


def test_resource_sampler_reads_at_most_once_per_interval():
    from ddp_hpc.train.metrics import ResourceSampler
    now = [100.0]
    s = ResourceSampler(min_interval_s=1.0, clock=lambda: now[0])
    reads = []
    real = s.proc.memory_info
    s.proc.memory_info = lambda: reads.append(1) or real()
    first = s.sample()
    assert set(first) == {"rss_mb", "cpu_percent"} and len(reads) == 1
    now[0] += 0.5
    assert s.sample() == first and len(reads) == 1          # repeated, not read again
    now[0] += 0.6
    s.sample()
    assert len(reads) == 2


def _bench():
    spec = importlib.util.spec_from_file_location("overhead_bench", REPO / "bench" / "overhead.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_overhead_bench_verdict_rules():
    bench = _bench()
    assert bench.verdict(0.99, 0.985, 0.995).endswith("target >= 0.98 met")
    assert bench.verdict(0.95, 0.94, 0.96).endswith("target >= 0.98 missed")
    assert "too wide to judge" in bench.verdict(0.98, 0.90, 1.06)
    assert "met by the median" in bench.verdict(0.985, 0.97, 1.0)
    med, lo, hi = bench.median_ci([1.0, 0.9, 1.1, 0.95, 1.05])
    assert med == 1.0 and 0.9 <= lo <= med <= hi <= 1.1


def test_overhead_bench_runs_pairs_and_writes_json(tmp_path):
    out = tmp_path / "o.json"
    res = subprocess.run([sys.executable, str(REPO / "bench" / "overhead.py"), "--seconds", "0",
                          "--min-pairs", "2", "--size", "256", "--batch-size", "16", "--epochs", "1",
                          "--warmup", "2", "--json", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "verdict (steady state): median" in res.stdout
    data = json.loads(out.read_text())
    assert [p["first"] for p in data["pairs"]] == ["plain", "toolkit"]
    assert len(data["steady"]["ratios"]) == 2 and data["timed_steps"] == 6
    lo, hi = data["steady"]["ci95"]
    assert lo <= data["steady"]["median"] <= hi
