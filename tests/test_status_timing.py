"""Stalls while they happen and ranks or nodes slower than the rest, from the step events.

Log directories are written the way ranks write them (one ``step`` event per interval, with
``time``, ``step``, ``rank``, ``host``); the job's state comes from a scheduler that answers like
Slurm's squeue/sacct, and ``now`` is injected, so the thresholds are tested exactly.
"""
import json

import pytest

from ddp_hpc.judge import timing
from ddp_hpc.status.collect import collect
from ddp_hpc.status.targets import StatusTarget
from ddp_hpc.status.view import render_detail, render_table

T0 = 1_800_000_000.0


def steps(rank, last_step, every=1.0, first=1, host=None):
    return [{"time": T0 + s * every, "event": "step", "rank": rank, "job_id": "88", "restart": 0,
             "host": host or f"n{rank // 2 + 1}", "epoch": 0, "step": s, "total_steps": 1000,
             "loss": 0.5, "lr": 0.1, "samples_per_s": 10.0, "rss_mb": 1.0, "cpu_percent": 1.0}
            for s in range(first, last_step + 1)]


def write(d, rank, events):
    d.mkdir(parents=True, exist_ok=True)
    with open(d / f"rank{rank}.events.jsonl", "a") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")


class Squeue:
    """A scheduler whose squeue lists job 88 in ``state`` (rows as SlurmCLI returns them)."""

    def __init__(self, state="RUNNING"):
        self.state = state

    def cluster_name(self):
        return "test"

    def squeue(self, job_ids=None, **kw):
        return [{"JobID": "88", "JobArrayID": "88", "State": self.state, "Reason": "None",
                 "TimeUsed": "5:00", "TimeLimit": "1:00:00", "NumNodes": "2", "RestartCnt": "0",
                 "NodeList": "n[1-2]", "Name": "demo"}]

    def sacct(self, job_ids, **kw):
        return []


def status(d, now, state="RUNNING"):
    st = collect([StatusTarget("88", None, str(d))], Squeue(state), now=now)[0]
    return st, render_detail(st, now=now).splitlines()


def test_one_silent_rank_while_the_others_write(tmp_path):
    for r in range(3):
        write(tmp_path, r, steps(r, 200))
    write(tmp_path, 3, steps(3, 70))
    st, lines = status(tmp_path, now=T0 + 203)
    # threshold max(10 x 1 s, 30 s) = 30 s; rank 3 silent since t=70
    assert st.stall.ranks == [3] and st.stall.silent_for_s == 133 and st.stall.threshold_s == 30
    assert lines[1] == "State:      RUNNING, STALLED 00:02:13   [source: squeue]"
    assert lines[2] == "Stalled:    rank 3 silent for 00:02:13; the others last wrote 00:00:03 ago"
    assert lines[3] == ("            (no event for > 00:00:30: max(10 x the median interval between "
                        "step events, 1 s, 30 s))")
    row = render_table([st]).splitlines()[1]
    assert "STALLED 00:02:13" in row
    assert st.to_dict()["stall"]["ranks"] == [3]


def test_every_rank_silent_names_the_one_that_stopped_first(tmp_path):
    """A frozen rank holds the others in the collective: all go silent, it stopped a step earlier."""
    for r in range(3):
        write(tmp_path, r, steps(r, 41))
    write(tmp_path, 3, steps(3, 40))
    st, lines = status(tmp_path, now=T0 + 41 + 130)
    assert lines[2] == ("Stalled:    ranks 0-3 silent for 00:02:10; rank 3 stopped first (last step 40, "
                        "the others' 41)")
    assert st.stall.behind == [3] and st.stall.others_last_s is None


@pytest.mark.parametrize("every,after,stalled", [
    (1.0, 29, False), (1.0, 31, True),      # fast steps: the 30 s floor
    (10.0, 99, False), (10.0, 101, True),   # slow steps: 10 x the median interval
])
def test_the_threshold(tmp_path, every, after, stalled):
    for r in range(2):
        write(tmp_path, r, steps(r, 20, every=every))
    got = timing.stall({r: steps(r, 20, every=every) for r in range(2)}, now=T0 + 20 * every + after)
    assert (got is not None) == stalled
    st, _ = status(tmp_path, now=T0 + 20 * every + after)
    assert (st.stall is not None) == stalled


def test_no_stall_before_two_steps_nor_once_the_job_ended(tmp_path):
    write(tmp_path, 0, steps(0, 1))
    assert timing.stall({0: steps(0, 1)}, now=T0 + 10_000) is None
    for r in range(2):
        write(tmp_path, r, steps(r, 20, first=2))
    st, _ = status(tmp_path, now=T0 + 1000, state="COMPLETED")
    assert st.stall is None


def test_the_constants_are_module_level(monkeypatch):
    evs = {0: steps(0, 20)}
    assert timing.stall(evs, now=T0 + 20 + 61) is not None
    monkeypatch.setattr(timing, "STALL_MIN_S", 120.0)
    assert timing.stall(evs, now=T0 + 20 + 61) is None


def test_a_slow_node_is_named_with_its_ranks(tmp_path):
    for r in (0, 1):
        write(tmp_path, r, steps(r, 12, every=1.0))
    for r in (2, 3):
        write(tmp_path, r, steps(r, 12, every=1.8))
    st, lines = status(tmp_path, now=T0 + 30)
    assert "Stragglers: n2 is 1.8x slower than the median node (ranks 2, 3)" in lines
    t = st.to_dict()["timing"]
    assert t["slow_nodes"] == ["n2"] and t["slow_ranks"] == [2, 3]
    assert t["nodes"]["n2"]["step_s"] == pytest.approx(1.8)
    assert t["nodes"]["n1"]["ratio"] == pytest.approx(1 / 1.8, abs=1e-3)
    assert t["ranks"]["3"] == {"host": "n2", "step_s": pytest.approx(1.8), "intervals": 11,
                               "ratio": pytest.approx(1.8), "slow": True}


def test_a_slow_rank_is_named_alone_when_its_node_mate_is_not(tmp_path):
    for r in range(3):
        write(tmp_path, r, steps(r, 12, every=1.0))
    write(tmp_path, 3, steps(3, 12, every=1.5))
    st, lines = status(tmp_path, now=T0 + 20)
    assert [ln for ln in lines if ln.startswith("Stragglers:")] == [
        "Stragglers: rank 3 on n2 is 1.5x slower than the median rank (1.5 s per step)"]
    assert st.timing.by_step_time.slow_nodes == []


def test_no_straggler_below_the_threshold_or_with_too_few_intervals(tmp_path):
    even = {r: steps(r, 12, every=1.2 if r == 3 else 1.0) for r in range(4)}
    assert timing.stragglers(even, {r: f"n{r // 2 + 1}" for r in range(4)}).lines == []
    short = {r: steps(r, 5, every=3.0 if r == 3 else 1.0) for r in range(4)}  # 4 intervals
    assert timing.stragglers(short, {r: f"n{r // 2 + 1}" for r in range(4)}) is None


def test_a_frozen_rank_is_the_one_that_wrote_no_stack(tmp_path):
    """SIGSTOP on rank 3: every rank stops writing steps at the same step (they wait for it in the
    collective); the others' watchdogs write their stacks, the frozen rank cannot."""
    stack = ('Current thread 0x00007f3b3a1c9740 "MainThread" (most recent call first):\n'
             '  File "/venv/lib/python3.11/site-packages/torch/autograd/graph.py", line 979 in _engine_run_backward\n'
             '  File "/src/ddp_hpc/train/step.py", line 56 in micro_batch\n')
    for r in range(4):
        write(tmp_path, r, steps(r, 41) + ([{"time": T0 + 41 + 480, "event": "stack", "rank": r, "job_id": "88",
                                              "restart": 0, "host": f"n{r // 2 + 1}", "step": 41,
                                              "reason": "collective timeout: no step for 480 s",
                                              "stack": stack}] if r != 3 else []))
    st, lines = status(tmp_path, now=T0 + 41 + 500)
    i = lines.index("Stalled:    ranks 0-3 silent for 00:08:20")
    assert lines[i + 2:i + 6] == [
        "            rank 0 was in graph.py:979 in _engine_run_backward, from step.py:56 in micro_batch",
        "            rank 1 was in graph.py:979 in _engine_run_backward, from step.py:56 in micro_batch",
        "            rank 2 was in graph.py:979 in _engine_run_backward, from step.py:56 in micro_batch",
        "            rank 3 wrote no stack while the others did: frozen (stopped, a hang in the kernel) or gone"]
    assert st.to_dict()["stall"]["no_stack"] == [3]


def test_a_rank_just_past_the_threshold_is_not_yet_called_frozen(tmp_path):
    """Seen on the cluster (with the 60 s floor of then): a second past the threshold of a
    SIGSTOP on rank 3, rank 2's watchdog had dumped and ranks 0-1's were a second behind; only the
    rank silent for STACK_GRACE_S past the stall threshold without a stack is named frozen."""
    stack = ('Current thread 0x00007f3b3a1c9740 "MainThread" (most recent call first):\n'
             '  File "/src/ddp_hpc/train/step.py", line 56 in micro_batch\n')
    for r in range(4):
        write(tmp_path, r, steps(r, 41) + ([{"time": T0 + 41 + 30, "event": "stack", "rank": r, "job_id": "88",
                                              "restart": 0, "host": f"n{r // 2 + 1}", "step": 41,
                                              "reason": "stalled: no step for 30 s", "stack": stack}]
                                            if r == 2 else []))
    st, _ = status(tmp_path, now=T0 + 41 + 31)
    assert st.to_dict()["stall"]["no_stack"] == []     # nobody is late yet
    st, lines = status(tmp_path, now=T0 + 41 + 30 + timing.STACK_GRACE_S + 1)
    assert st.to_dict()["stall"]["no_stack"] == [0, 1, 3]


def _data_events(rank, host, data_s, n=8, step_s=0.5):
    return [{"event": "step", "time": 1000.0 + i * step_s * 10, "step": i * 10, "rank": rank,
             "host": host, "data_s": data_s} for i in range(n)]


def test_the_training_cores_own_data_wait_names_a_slow_loader():
    """Training-core step events are written after a collective (same times on every rank);
    their data_s tells the rank with the slow loader apart."""
    from ddp_hpc.judge.timing import stragglers
    per_rank = {0: _data_events(0, "n1", 0.01), 1: _data_events(1, "n1", 0.012),
                2: _data_events(2, "n2", 0.011), 3: _data_events(3, "n2", 0.2)}
    out = stragglers(per_rank, {0: "n1", 1: "n1", 2: "n2", 3: "n2"})
    assert out.slow_ranks == [3] and out.measure.startswith("data_s")
    assert out.lines == ["rank 3 on n2 is 18.2x slower waiting for data than the median rank "
                            "(0.2 s per step)"]


def test_a_tiny_data_wait_is_not_a_straggler_however_large_the_ratio():
    from ddp_hpc.judge.timing import stragglers
    per_rank = {r: _data_events(r, "n1", 0.0001) for r in range(3)}
    per_rank[3] = _data_events(3, "n1", 0.0009)   # 9x, but 0.8 ms of a 0.5 s step
    out = stragglers(per_rank, {r: "n1" for r in range(4)})
    assert out.slow_ranks == [] and out.lines == []


C10D_WAIT = ('Current thread 0x00007f3b3a1c9740 "MainThread" (most recent call first):\n'
             '  File "/venv/lib/python3.11/site-packages/torch/autograd/graph.py", line 979 in _engine_run_backward\n'
             '  File "/w/hang.py", line 28 in main\n')
OWN_SLEEP = ('Current thread 0x00007f3b3a1c9740 "MainThread" (most recent call first):\n'
             '  File "/w/hang.py", line 31 in main\n')


def _stack(rank, t, step, text):
    return {"time": t, "event": "stack", "rank": rank, "job_id": "88", "restart": 0, "host": f"n{rank // 2 + 1}",
            "step": step, "reason": "stalled: no step for 60 s", "stack": text}


def test_the_stall_line_agrees_with_the_stacks_and_progress_shows_the_newest_step(tmp_path):
    """Issue 30 item 14: rank 3 of a plain script sleeps at step 100. Step events are throttled to
    one a second, so ranks 1-2's last step event says 91 and the others' 92; every rank's stack
    event says step 100, rank 3 in its own code, ranks 0-2 in DDP's all-reduce. No rank that
    waits in a collective "stopped first", and progress is step 100."""
    last = {0: 92, 1: 91, 2: 91, 3: 92}
    for r in range(4):
        write(tmp_path, r, steps(r, last[r], first=last[r] - 10)
              + [_stack(r, T0 + 160, 100, OWN_SLEEP if r == 3 else C10D_WAIT)])
    st, lines = status(tmp_path, now=T0 + 92 + 74)
    assert lines[2] == "Stalled:    ranks 0-3 silent for 00:01:14", lines
    assert "            hang: rank 3 in main (hang.py:31); ranks 0-2 wait in DDP's all-reduce (backward)" in lines
    assert st.stall.behind == [] and st.stall.last_steps == {"0": 100, "1": 100, "2": 100, "3": 100}
    assert st.progress.step == 100
    assert not any("stopped first" in ln for ln in lines)


def test_a_rank_waiting_in_a_collective_never_stopped_first(tmp_path):
    """Whatever its step numbers say, a rank whose stack of the silence waits in a collective was
    held up by another: only the ranks outside a collective can have stopped first."""
    for r in range(4):
        write(tmp_path, r, steps(r, 40 if r in (1, 3) else 41)
              + [_stack(r, T0 + 110, None, OWN_SLEEP if r == 3 else C10D_WAIT)])
    st, lines = status(tmp_path, now=T0 + 41 + 130)
    assert st.stall.behind == [3]
    assert lines[2] == ("Stalled:    ranks 0-3 silent for 00:02:10; rank 3 stopped first (last step 40, "
                        "the others' 41)"), lines


def test_progress_takes_the_newest_readable_value_of_each_metric():
    """The newest step event's loss, samples/s and steps/s, where it holds a number; an
    unreadable value falls back to the step before; epoch events (epoch means) only where no step
    event has one; the epoch from the newest event that names one."""
    evs = steps(0, 3)
    evs[1]["loss"], evs[1]["steps_per_s"] = 0.25, 4.0
    evs[2]["loss"], evs[2]["samples_per_s"], evs[2]["epoch"] = "nan-ish", None, "x"
    epoch = {"time": T0 + 4, "event": "epoch", "rank": 0, "epoch": 1, "step": 3, "loss": 9.0,
             "samples_per_s": 99.0}
    p = timing.progress(evs + [epoch], evs + [epoch])
    assert (p.loss, p.samples_per_s, p.steps_per_s, p.epoch, p.step) == (0.25, 10.0, 4.0, 1, 3)
    only_epochs = timing.progress([epoch], [epoch])
    assert (only_epochs.loss, only_epochs.samples_per_s, only_epochs.steps_per_s) == (9.0, 99.0, None)


def test_the_detail_view_names_tensorboard_files_of_the_log_directory_it_read(tmp_path):
    d = tmp_path / "run"
    write(d, 0, steps(0, 5))
    assert not any(line.startswith("TensorBoard:") for line in status(d, T0 + 6)[1])
    (d / "events.out.tfevents.1800000000.n1.1.0").write_bytes(b"")
    st, lines = status(d, T0 + 6)
    assert st.tensorboard and f"TensorBoard: tensorboard --logdir {d}" in lines


def fast_steps(rank, seconds, per_event=6):
    """A script of 0.16 s steps: one step event a second (the throttle), 6 steps apart."""
    return [{**e, "step": e["step"] * per_event} for e in steps(rank, seconds)]


def test_a_fast_run_silent_for_45_s_is_stalled_and_its_goodput_counts_the_silence_as_stalls(tmp_path):
    """0.16 s steps, step events a second apart: the stall threshold is the floor, STALL_MIN_S
    (30 s), not the 60 s it was; goodput files the silence under stalls, not other."""
    stack = ('Current thread 0x00007f3b3a1c9740 "MainThread" (most recent call first):\n'
             '  File "/src/train.py", line 56 in main\n')
    for r in range(2):   # each rank's watchdog dumps its stacks at the threshold, 30 s
        write(tmp_path, r, fast_steps(r, 100) + [{"time": T0 + 130, "event": "stack", "rank": r, "job_id": "88",
                                                  "restart": 0, "host": "n1", "step": 600, "stack": stack}])
    st, lines = status(tmp_path, now=T0 + 100 + 45)
    assert st.stall is not None and st.stall.ranks == [0, 1] and st.stall.threshold_s == 30
    assert lines[1] == "State:      RUNNING, STALLED 00:00:45   [source: squeue]"
    # the wall ends at the newest event (the stacks); all of the silence in it is a stall
    assert st.goodput.lost_s["stalls"] >= 30.0 and st.goodput.lost_s["other"] == pytest.approx(0.0)
    assert not timing.stall({r: fast_steps(r, 100) for r in range(2)}, now=T0 + 100 + 25)   # an ordinary pause


def _busy(rank, phase, start, until, every=5.0):
    """The loop's signs of life in a save or evaluation: a ``progress`` event every ``every`` s."""
    n = int((until - start) // every) + 1
    return [{"time": T0 + start + i * every, "event": "progress", "phase": phase, "step": 600, "rank": rank,
             "job_id": "88", "restart": 0, "host": "n1"} for i in range(n)]


@pytest.mark.parametrize("phase", ["checkpoint", "eval"])
def test_the_others_waiting_for_rank_0s_save_or_eval_are_not_stalled(tmp_path, phase):
    """Rank 0 saves (or evaluates) for 90 s, writing progress events as the training core does;
    the others wait in a collective, silent: an ordinary pause, not a stall. Once rank 0's own
    signs of life stop as well, every rank is silent and the job stalled."""
    for r in range(4):
        write(tmp_path, r, fast_steps(r, 100) + (_busy(0, phase, 100.5, 190) if r == 0 else []))
    st, _ = status(tmp_path, now=T0 + 188)
    assert st.stall is None
    assert st.goodput.lost_s["stalls"] == pytest.approx(0.0)
    assert st.goodput.lost_s[phase] == pytest.approx(85.5)   # to rank 0's newest progress event
    per_rank = {r: fast_steps(r, 100) + (_busy(0, phase, 100.5, 140) if r == 0 else []) for r in range(4)}
    got = timing.stall(per_rank, now=T0 + 140.5 + 31)   # rank 0 silent past the floor itself
    assert got is not None and got.ranks == [0, 1, 2, 3]


def test_the_watchdogs_first_dump_comes_when_status_calls_the_stall():
    """The watchdog writes every thread's stack when status would call the rank stalled, so a
    stalled job shows where its ranks are: the same rule, the same constants."""
    from ddp_hpc.runlogs import watchdog
    assert (watchdog.STALL_FACTOR, watchdog.STALL_MIN_S) == (timing.STALL_FACTOR, timing.STALL_MIN_S)
