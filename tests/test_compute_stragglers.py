"""Issue 34 item 1: each rank's own compute per step (``compute_s``, ddp_hpc/instrument/compute.py)
and the ranks and nodes status names for it (ddp_hpc/judge/compute.py). The end-to-end tests run
a plain DDP script (no ddp_hpc import) as a real local job of 3 ranks on one pretend node under
``ddp-hpc submit`` (the node judgement of several nodes: the synthetic-event tests here)."""
from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from ddp_hpc.instrument.compute import ComputeTimer
from ddp_hpc.judge import compute
from ddp_hpc.judge.compute import Timing, compute_stragglers, with_compute
from ddp_hpc.judge.timing import Stragglers

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "plain_ddp.py"
DDP_HPC = str(Path(sys.executable).with_name("ddp-hpc"))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# --------------------------------------------------------------------------- the timer
def test_the_span_runs_from_the_input_being_ready_to_backward_and_sums_per_step():
    clock = Clock()
    t = ComputeTimer(clock)
    t.backward(None)                        # no span open (the script's first backward): nothing
    assert t.take(1) is None
    for _ in range(4):                      # 2 steps of 2 micro-batches, 0.25 s forward each
        t.ready()
        clock.now += 0.25
        t.backward(object())
        clock.now += 1.0                    # backward, all-reduce, optimizer step: not counted
        t.backward(object())                # a second backward() of the same input: not counted
    assert t.take(2) == pytest.approx(0.5)
    t.ready()
    t.ready()                               # the later of two starts wins (batch after step)
    clock.now += 0.1
    t.backward(object())
    assert t.take(1) == pytest.approx(0.1) and t.take(1) is None


class FakeEvent:
    """torch.cuda.Event's surface the timer uses: record, query, elapsed_time (ms)."""
    done = False

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at = None

    def record(self, stream=None) -> None:
        self.at = FakeCuda.gpu_time

    def query(self) -> bool:
        return FakeCuda.done

    def elapsed_time(self, end: "FakeEvent") -> float:
        return (end.at - self.at) * 1000.0


class FakeCuda:
    gpu_time = 0.0
    done = False
    Event = FakeEvent

    @staticmethod
    def current_stream(device=None):
        return None


def test_on_a_gpu_the_span_is_read_from_cuda_events_once_their_work_finished():
    clock = Clock()
    t = ComputeTimer(clock)
    t._use_cuda = lambda tensor: setattr(t, "cuda", FakeCuda)   # torch.cuda, without a GPU here
    t.ready()
    t.backward(types.SimpleNamespace(is_cuda=True))   # the first on a GPU: its CPU span is dropped
    assert t.cuda is FakeCuda
    for _ in range(3):
        t.ready()
        FakeCuda.gpu_time += 0.2
        t.backward(object())
    assert t.take(3) is None                 # the GPU has not finished: nothing read, no wait
    FakeCuda.done = True
    assert t.take(3) == pytest.approx(0.2)   # read at the next event
    assert len(t._pool) == 6                 # events are reused


# --------------------------------------------------------------------------- the judgement
def steps(rank, host, compute_s, n=8, every=5, step_s=0.1):
    return [{"event": "step", "time": 1000.0 + i * every * step_s, "step": 1 + i * every, "rank": rank,
             "host": host, "compute_s": compute_s} for i in range(n)]


def hosts(n):
    return {r: f"n{r // 2 + 1}" for r in range(n)}


def test_a_rank_that_computes_slower_is_named_with_the_others_wait():
    per_rank = {r: steps(r, f"n{r // 2 + 1}", 0.05) for r in range(8)}
    per_rank[5] = steps(5, "n3", 0.07)
    out = compute_stragglers(per_rank, hosts(8))
    assert out.slow_ranks == [5] and out.slow_nodes == []
    assert out.lines == ["rank 5 on n3 computes 1.4x slower than the median rank; "
                            "the others wait about 20% of each step for it"]
    assert out.ranks["5"]["wait_share"] == pytest.approx(0.2)


def test_a_node_whose_ranks_all_compute_slower_is_named_instead_of_them():
    per_rank = {r: steps(r, f"n{r // 2 + 1}", 0.07 if r in (4, 5) else 0.05) for r in range(8)}
    out = compute_stragglers(per_rank, hosts(8))
    assert out.slow_nodes == ["n3"] and out.slow_ranks == [4, 5]
    assert out.lines == ["n3 computes 1.4x slower than the median node (ranks 4-5); "
                            "the others wait about 20% of each step for it"]


def test_nothing_is_named_below_the_ratio_the_steps_or_the_share_of_a_step():
    even = {r: steps(r, "n1", 0.055 if r == 3 else 0.05) for r in range(4)}       # 1.1x
    assert compute_stragglers(even, hosts(4)).lines == []
    short = {r: steps(r, "n1", 0.1 if r == 3 else 0.05, n=4, every=6) for r in range(4)}   # 18 steps
    assert compute_stragglers(short, hosts(4)) is None
    assert compute.window(steps(0, "n1", 0.1, n=5, every=5)) == [0.1] * 4       # 20 steps
    tiny = {r: steps(r, "n1", 0.0003 if r == 3 else 0.0001) for r in range(4)}    # 3x, 0.2% of a step
    assert compute_stragglers(tiny, hosts(4)).lines == []


def test_the_compute_lines_come_first_among_the_stragglers():
    per_rank = {r: steps(r, "n1", 0.08 if r == 1 else 0.05) for r in range(3)}
    c = compute_stragglers(per_rank, hosts(3))
    slow_steps = Stragglers(ranks={}, nodes={}, slow_ranks=[0], slow_nodes=[],
                            lines=["rank 0 is 1.3x slower waiting for data"], measure="step event intervals",
                            ratio_threshold=1.25, min_intervals=5)
    merged = with_compute(slow_steps, c)
    assert merged.lines[0].startswith("rank 1 on n1 computes 1.6x slower") and merged.by_compute is c
    assert merged.lines[1] == "rank 0 is 1.3x slower waiting for data"
    assert merged.to_dict()["lines"] == merged.lines and merged.to_dict()["compute"] == c.to_dict()
    assert Timing.from_dict(json.loads(json.dumps(merged.to_dict()))) == merged
    alone = with_compute(None, c)   # no step times judged: the compute's keys and its lines
    assert alone.to_dict() == {"compute": c.to_dict(), "lines": c.lines}
    assert Timing.from_dict(json.loads(json.dumps(alone.to_dict()))) == alone
    assert with_compute(None, None) is None


# --------------------------------------------------------------------------- a real 1 x 3 job
ARGS = ("--steps", "50", "--step-sleep", "0.02")


@pytest.mark.timeout(180)
def test_a_plain_script_whose_rank_2_computes_slower_is_named(tmp_path):
    """``ddp-hpc submit`` of the plain script as a 1 x 3 local job, then ``ddp-hpc status``: the only
    real run in which the instrumentation's compute_s names a slow rank (rank 2 against the median
    of ranks 0 and 1)."""
    from tests.test_instrument import clean_env
    home = tmp_path / "home"
    env = clean_env(DDP_HPC_HOME=str(home))
    p = subprocess.run([DDP_HPC, "submit", "--backend", "local", "-N", "1", "-G", "3", "--wait", "--log-dir",
                        str(tmp_path / "runs"), str(SCRIPT), *ARGS, "--slow-rank", "2", "--slow-s", "0.04"],
                       env=env, capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    job = json.loads(next((home / "jobs").glob("*.json")).read_text())["id"]
    text = subprocess.run([DDP_HPC, "status", job], env=env, capture_output=True, text=True, timeout=60).stdout
    named = [ln for ln in text.splitlines() if "computes" in ln]
    assert len(named) == 1 and named[0].startswith("Stragglers: rank 2 on "), text
    assert "x slower than the median rank; the others wait about " in named[0], text


@pytest.mark.timeout(180)
def test_the_same_script_without_the_extra_work_names_no_rank(tmp_path):
    """The same 1 x 3 run (``ddp-hpc launch`` of it under ``ddp_hpc.exec``) without the extra
    work: every rank's compute is measured, none is named."""
    from ddp_hpc.status.collect import collect
    from ddp_hpc.status.targets import StatusTarget
    from ddp_hpc.status.view import render_detail
    from tests.test_instrument import EXEC, clean_env
    log_dir = tmp_path / "logs"
    p = subprocess.run([DDP_HPC, "launch", "--nodes", "1", "--procs-per-node", "3", "--log-dir", str(log_dir),
                        "--", *EXEC, "--", sys.executable, str(SCRIPT), *ARGS],
                       env=clean_env(), capture_output=True, text=True, timeout=170)
    assert p.returncode == 0, p.stdout + p.stderr
    st = collect([StatusTarget("local", None, str(log_dir))], None, only="logs")[0]
    c = st.timing.by_compute
    assert c.slow_ranks == [] and c.slow_nodes == [] and len(c.ranks) == 3, c
    assert "computes" not in render_detail(st)
