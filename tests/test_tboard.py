"""TensorBoard files from the run-log writer (ddp_hpc.runlogs.tboard), read back with TensorBoard's
own reader: rank 0 only, the tags, the switch, and a restart that continues the steps."""
from __future__ import annotations

import subprocess
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ddp_hpc.runlogs import tboard
from ddp_hpc.runlogs.writer import RunLog


def read_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


def test_rank0_events_become_scalars(tmp_path, monkeypatch):
    monkeypatch.delenv(tboard.ENV_SWITCH, raising=False)
    log, other = RunLog(tmp_path, 0, "7"), RunLog(tmp_path, 1, "7")
    for step in (1, 2, 3):
        log.event("step", epoch=0, step=step, total_steps=3, loss=1.0 / step, lr=0.1,
                  samples_per_s=100.0 * step, metrics={"acc": 0.5, "note": "text"})
        other.event("step", epoch=0, step=step, total_steps=3, loss=9.0)
    log.event("epoch", epoch=0, step=3, loss=0.5, samples_per_s=200.0)
    log.event("eval", epoch=0, step=3, metrics={"loss": 0.25, "accuracy": 0.75})
    log.event("start", world_size=2)
    log.event("step", loss=1.0)                       # no step: nothing for TensorBoard
    log.close()
    other.close()
    got = read_scalars(tmp_path)
    assert got["train/loss"] == [(1, 1.0), (2, 0.5), (3, round(1 / 3, 6))]
    assert got["train/lr"] == [(1, 0.1), (2, 0.1), (3, 0.1)]
    assert got["train/samples_per_s"] == [(1, 100.0), (2, 200.0), (3, 300.0)]
    assert got["acc"] == [(1, 0.5), (2, 0.5), (3, 0.5)]
    assert got["epoch/loss"] == [(3, 0.5)]
    assert got["eval/accuracy"] == [(3, 0.75)] and got["eval/loss"] == [(3, 0.25)]
    assert "note" not in got
    assert len(tboard.event_files(tmp_path)) == 1    # rank 1 wrote none


def test_switched_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(tboard.ENV_SWITCH, "0")
    log = RunLog(tmp_path, 0)
    log.event("step", step=1, loss=1.0)
    log.close()
    assert tboard.event_files(tmp_path) == []


def test_restart_continues_one_run(tmp_path, monkeypatch):
    """A second run (a requeue) resumes from a checkpoint at step 4 after the first wrote steps
    1-6: TensorBoard shows 1-4 from the first run and 5-8 from the second, one curve."""
    monkeypatch.delenv(tboard.ENV_SWITCH, raising=False)
    first = RunLog(tmp_path, 0, "7", restart=0)
    for step in range(1, 7):
        first.event("step", step=step, loss=float(step))
    first.close()
    second = RunLog(tmp_path, 0, "7", restart=1)
    for step in range(5, 9):
        second.event("step", step=step, loss=100.0 + step)
    second.close()
    assert read_scalars(tmp_path)["train/loss"] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 105.0), (6, 106.0), (7, 107.0), (8, 108.0)]
    assert len(tboard.event_files(tmp_path)) == 2


def test_nothing_heavy_imported_without_events(tmp_path, monkeypatch):
    """A run log that writes no step event imports neither TensorBoard nor torch; one that does
    imports TensorBoard's writer, still not torch."""
    monkeypatch.delenv(tboard.ENV_SWITCH, raising=False)
    code = ("import sys; from ddp_hpc.runlogs.writer import RunLog; "
            f"log = RunLog({str(tmp_path)!r}, 0); log.event('start', world_size=1); "
            "print(sorted(m for m in ('torch', 'tensorboard') if m in sys.modules)); "
            "log.event('step', step=1, loss=0.5); log.close(); "
            "print(sorted(m for m in ('torch', 'tensorboard') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "['tensorboard']"]
    assert read_scalars(tmp_path)["train/loss"] == [(1, 0.5)]
