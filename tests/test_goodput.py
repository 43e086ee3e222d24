"""Goodput per job (ddp_hpc.judge.goodput): over written event files (each part of the wall time
by itself: steps trained twice after a restart, checkpoints with and without ``blocking_s``,
restarts by phase, data wait, stalls, eval), and over a real 2-process job that resumes from its
checkpoint and trains some steps twice. Status shows it: tests/test_status_goodput.py."""

import json
from pathlib import Path

import pytest

from ddp_hpc.judge.goodput import goodput
from ddp_hpc.judge.nodefiles import rank_events
from ddp_hpc.judge.reader import RunLogs


def _write(d: Path, rank: int, events: list[dict]) -> None:
    with open(d / f"rank{rank}.events.jsonl", "a") as f:
        for e in events:
            f.write(json.dumps({"rank": rank, "job_id": "9", "host": "n1", **e}) + "\n")


def _steps(t0: float, first: int, last: int, restart: int = 0, every: float = 1.0, **extra) -> list[dict]:
    return [{"time": t0 + (s - first) * every, "event": "step", "step": s, "restart": restart, **extra}
            for s in range(first, last + 1)]


def _gp(d: Path, restarts=()):
    return goodput(RunLogs(d).ranks, list(restarts))


def test_no_steps_no_goodput(tmp_path):
    _write(tmp_path, 0, [{"time": 1.0, "event": "start", "restart": 0}])
    assert _gp(tmp_path) is None


def test_plain_run_is_all_useful(tmp_path):
    _write(tmp_path, 0, _steps(100.0, 1, 11))
    g = _gp(tmp_path)
    assert g.wall_s == 10.0 and g.useful_s == 10.0 and g.goodput == 1.0
    assert all(v == 0.0 for v in g.lost_s.values()) and g.step_s == 1.0


def test_restart_gap_and_steps_trained_twice(tmp_path):
    # run 0: steps 1..10 at 1 s each; dies; run 1 resumes from step 6 and trains 7..20
    _write(tmp_path, 0, _steps(100.0, 1, 10) + _steps(130.0, 7, 20, restart=1))
    g = _gp(tmp_path)
    assert g.wall_s == pytest.approx(43.0)                 # 100 .. 143
    assert g.lost_s["restarts"] == pytest.approx(21.0)     # 109 .. 130
    assert g.steps_redone == 3                             # 8, 9, 10 again (7 is the first event)
    assert g.lost_s["redone"] == pytest.approx(3.0)
    assert g.useful_s == pytest.approx(19.0) and g.goodput == pytest.approx(19 / 43)
    assert "restarts (no phases recorded)" in g.estimated
    # with the heal helper's phases recorded for restart 1
    phases = {"detect": 1.0, "stop": 2.0, "start": 1.5, "import": 4.0, "rendezvous": 0.5, "restore": 0.3}
    g = _gp(tmp_path, [{"restart": 1, "phases": phases}])
    assert g.restart_phases == phases and g.estimated == []
    assert g.to_dict()["lost_s"]["restarts"] == 21.0


def test_checkpoint_blocking_estimated_or_from_the_event(tmp_path):
    d1, d2 = tmp_path / "a", tmp_path / "b"
    d1.mkdir()
    d2.mkdir()
    # 10 steps at 1 s; the interval 5 -> 6 took 4 s with a checkpoint inside
    steps = _steps(0.0, 1, 5) + _steps(8.0, 6, 10)
    _write(d1, 0, steps + [{"time": 5.5, "event": "checkpoint", "step": 5, "restart": 0}])
    g = _gp(d1)
    assert g.lost_s["checkpoint"] == pytest.approx(3.0) and g.useful_s == pytest.approx(9.0)
    assert g.estimated == ["checkpoint (the time around the saves)"]
    _write(d2, 0, steps + [{"time": 5.5, "event": "checkpoint", "step": 5, "restart": 0, "blocking_s": 0.5}])
    g = _gp(d2)
    assert g.lost_s["checkpoint"] == pytest.approx(0.5) and g.estimated == []
    # what blocking_s does not explain of the slow interval (3.5 s for one step) is a stall
    assert g.lost_s["stalls"] == pytest.approx(2.5) and g.useful_s == pytest.approx(9.0)


def test_data_wait_stall_eval_and_the_tail(tmp_path):
    steps = _steps(0.0, 1, 5, data_s=0.25) + _steps(20.0, 6, 8, data_s=0.25) + _steps(30.0, 9, 10, data_s=0.25)
    _write(tmp_path, 0, steps + [{"time": 25.0, "event": "eval", "step": 8, "restart": 0},
                                 {"time": 35.0, "event": "end", "status": "completed", "restart": 0}])
    g = _gp(tmp_path)
    assert g.wall_s == pytest.approx(35.0)
    assert g.lost_s["stalls"] == pytest.approx(15.0)     # 5 -> 6 took 16 s for one step
    assert g.lost_s["eval"] == pytest.approx(7.0)        # 8 -> 9 took 8 s for one step, an eval inside
    assert g.lost_s["other"] == pytest.approx(4.0)       # the last step (31) to the end event (35)
    assert g.lost_s["data"] == pytest.approx(9 * 0.25)   # each of the 9 intervals' one step
    assert g.useful_s + sum(g.lost_s.values()) == pytest.approx(g.wall_s)


def _newest_step(log_dir: Path) -> int:
    steps = [e.get("step") for e in rank_events(log_dir, 0).events if e.get("event") == "step"]
    return max(steps, default=0)


@pytest.mark.slow
def test_goodput_of_a_real_2_process_job_killed_and_resumed(tmp_path):
    """examples/preemptible.py on 2 gloo ranks, a checkpoint every 6 steps, SIGKILLed once rank 0
    reported step 9..11, then run again (restart number 1): it resumes from step 6, so the steps
    past 6 that the first run reached are trained twice, and the wait between the runs is a restart."""
    import os
    import signal
    import sys
    import time

    from ddp_hpc.launch.local import run_local, start_local

    repo = Path(__file__).resolve().parents[1]
    log_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": str(repo), "DDP_HPC_LOG_DIR": str(log_dir)}
    argv = [sys.executable, str(repo / "examples" / "preemptible.py"), "--steps", "12", "--sleep", "0.8",
            "--ckpt-every", "6", "--ckpt-dir", str(ckpt)]
    run = start_local(argv, nodes=1, procs_per_node=2, log_dir=log_dir, env=env)
    try:
        deadline = time.monotonic() + 180
        while (seen := _newest_step(log_dir)) < 9 and time.monotonic() < deadline and run.procs[0].poll() is None:
            time.sleep(0.05)
    finally:
        run.kill(first=signal.SIGKILL)
    # at most 1 step event a second, in the file within a second (the node's writer), and >= 0.8 s
    # a step: one of 9, 10, 11 is seen before 12's checkpoint
    assert 9 <= seen <= 11, seen
    done = run_local(argv, nodes=1, procs_per_node=2, log_dir=log_dir, env={**env, "DDP_HPC_RESTART_BASE": "1"})
    assert done.ok, (log_dir / "rank0.out").read_text()[-2000:]
    g = goodput(RunLogs(log_dir).ranks)
    # the resumed run's first step event is step 7 or later; every step from there to `seen` is redone
    assert 2 <= g.steps_redone <= seen - 6, g
    assert g.lost_s["redone"] > 0 and g.lost_s["restarts"] > 0, g
    assert 0 < g.goodput < 1 and g.useful_s + sum(g.lost_s.values()) == pytest.approx(g.wall_s)


def test_an_async_saves_blocking_is_charged_where_training_blocked(tmp_path):
    """An async checkpoint's event comes when its file is complete, steps later; the training
    thread was blocked (copying the state) before the write began: ``time - write_s``. The 4 s
    land in the slow interval 5 -> 6, not in the interval where the file completed."""
    d1, d2 = tmp_path / "async", tmp_path / "blocking"
    d1.mkdir()
    d2.mkdir()
    steps = _steps(0.0, 1, 5) + _steps(9.0, 6, 10)     # 5 -> 6 took 5 s: 1 s of step, 4 s of copy
    # blocked 4.9 .. 8.9, then written 8.9 .. 11.5, the event at 11.5 (between steps 8 and 9)
    _write(d1, 0, steps + [{"time": 11.5, "event": "checkpoint", "step": 5, "restart": 0,
                            "blocking_s": 4.0, "write_s": 2.6}])
    g = _gp(d1)
    assert g.lost_s["checkpoint"] == pytest.approx(4.0) and g.lost_s["stalls"] == 0.0, g
    assert g.useful_s == pytest.approx(9.0) and g.estimated == []
    # a blocking save (blocking_s >= write_s, the event at its end) stays in its own interval
    _write(d2, 0, steps + [{"time": 8.9, "event": "checkpoint", "step": 5, "restart": 0,
                            "blocking_s": 4.0, "write_s": 3.9}])
    g = _gp(d2)
    assert g.lost_s["checkpoint"] == pytest.approx(4.0) and g.useful_s == pytest.approx(9.0), g


def test_memory_snapshot_seconds_count_as_checkpoint_when_recorded(tmp_path):
    """A step event's ``snapshot_s`` (the training thread's seconds in memory snapshots since the
    previous step event) is checkpoint time of the interval it ends, not useful time."""
    steps = _steps(0.0, 1, 5) + [{"time": 5.5, "event": "step", "step": 6, "restart": 0, "snapshot_s": 0.5}]
    _write(tmp_path, 0, steps + _steps(6.5, 7, 10))
    g = _gp(tmp_path)
    assert g.lost_s["checkpoint"] == pytest.approx(0.5) and g.useful_s == pytest.approx(9.0), g
    assert g.useful_s + sum(g.lost_s.values()) == pytest.approx(g.wall_s)


def test_a_silence_after_the_last_step_is_a_stall_by_the_run_s_own_step_interval(tmp_path):
    """0.16 s steps, a step event a second: 45 s without an event is a stall (STALL_FACTOR x the
    1 s interval, no 60 s floor), not 'other'; a save and an evaluation the events name keep
    their parts, and a completed run's teardown stays 'other'."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for d in (a, b, c):
        d.mkdir()
    _write(a, 0, _steps(100.0, 6, 600, every=1.0 / 6) [::6])
    g = goodput(RunLogs(a).ranks, [], end=100.0 + 99 + 45)   # a running job, asked at +45 s
    assert g.lost_s["stalls"] == pytest.approx(45.0) and g.lost_s["other"] == pytest.approx(0.0)
    # a hang that ended in the collective's timeout: the error event ends the silence
    _write(b, 0, _steps(100.0, 1, 20) + [{"time": 19 + 100.0 + 45, "event": "error", "restart": 0},
                                          {"time": 19 + 100.0 + 46, "event": "end", "status": "failed", "restart": 0}])
    g = _gp(b)
    assert g.lost_s["stalls"] == pytest.approx(45.0) and g.lost_s["other"] == pytest.approx(1.0)
    # the training core's final evaluation and save, then a completed end after a long teardown
    tail = [{"time": 119.0 + t, "event": "progress", "phase": "eval", "restart": 0} for t in (5, 10, 15)]
    tail += [{"time": 137.0, "event": "eval", "restart": 0},
             {"time": 140.0, "event": "progress", "phase": "checkpoint", "restart": 0},
             {"time": 160.0, "event": "checkpoint", "restart": 0, "blocking_s": 20.0},
             {"time": 175.0, "event": "end", "status": "completed", "restart": 0}]
    _write(c, 0, _steps(100.0, 1, 20) + tail)
    g = _gp(c)
    assert g.lost_s["eval"] == pytest.approx(18.0) and g.lost_s["checkpoint"] == pytest.approx(23.0)
    assert g.lost_s["stalls"] == 0.0 and g.lost_s["other"] == pytest.approx(15.0)
    assert g.useful_s + sum(g.lost_s.values()) == pytest.approx(g.wall_s)
