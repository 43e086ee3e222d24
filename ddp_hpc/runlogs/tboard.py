"""TensorBoard event files beside a run's logs, written by rank 0 from its run-log events.

Every ``step``, ``epoch`` and ``eval`` event that rank 0 writes through `RunLog.event` (the
training core's loop, ``ddp_hpc.report`` and the automatic instrumentation of script jobs alike)
is also written as TensorBoard scalars at the event's step, into the run directory itself, so
``tensorboard --logdir RUN_DIR`` shows the run and ``--logdir LOG_ROOT`` compares runs.  Tags:
``train/loss``, ``train/lr``, ``train/samples_per_s``, ``train/epoch`` (step events), any other
number in a step event's ``metrics`` under its own name (a Lightning ``self.log`` name),
``epoch/loss`` and ``epoch/samples_per_s`` (epoch events), ``eval/<name>`` (eval metrics).

One run across requeues and restarts: each process that writes opens a new event file in the same
directory, starting with TensorBoard's restart marker at its first step (``purge_step``), so a
run that resumes from a checkpoint at step 100 continues the curve and the first run's points past
its checkpoint are dropped by TensorBoard's readers.

``tensorboard`` is an optional extra (``pip install ddp_hpc[tensorboard]``): without it, or with
``DDP_HPC_TENSORBOARD=0``, nothing is written and nothing is imported; TensorBoard's own event-file
writer is imported at the first event that has something to write (not torch), and each event is
flushed to the file at once, as the run log's lines are, so a killed process keeps its points
(about 0.1 ms an event).  A failed write is
reported once on stderr and turns TensorBoard off for the process, never the run.
"""
from __future__ import annotations

import atexit
import importlib.util
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping

from ddp_hpc.runlogs.schema import TBOARD_GLOB

__all__ = ["ENV_SWITCH", "TensorBoardSink", "enabled", "event_files", "scalars", "sink_for"]

#: set to 0 / false / no / off to write no TensorBoard files
ENV_SWITCH = "DDP_HPC_TENSORBOARD"
#: the run-log events that become TensorBoard scalars
TB_EVENTS = ("step", "epoch", "eval")
_OFF = ("0", "false", "no", "off")
_STEP_TAGS = {"loss": "train/loss", "lr": "train/lr", "samples_per_s": "train/samples_per_s",
              "epoch": "train/epoch"}
_EPOCH_TAGS = {"loss": "epoch/loss", "samples_per_s": "epoch/samples_per_s"}


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """True when tensorboard is installed and ``$DDP_HPC_TENSORBOARD`` does not turn it off."""
    env = os.environ if environ is None else environ
    if env.get(ENV_SWITCH, "").strip().lower() in _OFF:
        return False
    return importlib.util.find_spec("tensorboard") is not None


def _number(value: Any) -> float | None:
    if value is None or isinstance(value, (bool, str)):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError, RuntimeError):   # a tensor of many elements: RuntimeError
        return None
    return number if math.isfinite(number) else None


def scalars(rec: Mapping[str, Any]) -> list[tuple[str, float]]:
    """The (tag, value) pairs one run-log event gives TensorBoard (none for other events)."""
    name, out = rec.get("event"), []
    if name == "step":
        pairs = [(tag, rec.get(key)) for key, tag in _STEP_TAGS.items()]
        pairs += list((rec.get("metrics") or {}).items())
    elif name == "epoch":
        pairs = [(tag, rec.get(key)) for key, tag in _EPOCH_TAGS.items()]
    elif name == "eval":
        pairs = [(f"eval/{k}", v) for k, v in (rec.get("metrics") or {}).items()]
    else:
        return []
    for tag, value in pairs:
        number = _number(value)
        if number is not None:
            out.append((str(tag), number))
    return out


def _step(rec: Mapping[str, Any]) -> int | None:
    step = rec.get("step")
    return int(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else None


def _open_writer(log_dir: Path, step: int) -> Any:
    """A new event file (TensorBoard's own writer) that starts with the restart marker at ``step``:
    the points of an earlier run from this step on are dropped, the curve continues (what
    PyTorch's ``SummaryWriter(purge_step=step)`` writes)."""
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog  # heavy: only when used
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(str(log_dir))
    writer.add_event(Event(step=step, wall_time=time.time(), session_log=SessionLog(status=SessionLog.START)))
    return writer


def _event(step: int, wall_time: float | None, values: list[tuple[str, float]]) -> Any:
    """One TensorBoard event with every scalar of one run-log event."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary

    summary = Summary(value=[Summary.Value(tag=tag, simple_value=value) for tag, value in values])
    return Event(step=step, wall_time=wall_time or time.time(), summary=summary)


class TensorBoardSink:
    """Rank 0's TensorBoard writer for one run directory, opened at the first event to write."""

    def __init__(self, log_dir: str | Path) -> None:
        self.dir = Path(log_dir)
        self._writer: Any = None
        self._failed = False

    def write(self, rec: Mapping[str, Any]) -> None:
        step = _step(rec)
        values = scalars(rec) if step is not None and not self._failed else []
        if not values:
            return
        try:
            if self._writer is None:
                self._writer = _open_writer(self.dir, step)
            self._writer.add_event(_event(step, rec.get("time"), values))
            self._writer.flush()
        except Exception as exc:  # noqa: BLE001 - metrics must not cost the run
            self._failed = True
            print(f"ddp_hpc: cannot write TensorBoard events in {self.dir}: {type(exc).__name__}: "
                  f"{exc}; the run goes on without them", file=sys.stderr, flush=True)

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception:  # noqa: BLE001 - closing at exit must not raise
                pass


_sinks: dict[tuple[int, str], TensorBoardSink] = {}


def sink_for(log_dir: str | Path, rank: int) -> TensorBoardSink | None:
    """The process's sink for ``log_dir`` on rank 0 when TensorBoard is on; None otherwise.  One per
    process and directory, so several run logs of one process write one event file."""
    if rank != 0 or not enabled():
        return None
    key = (os.getpid(), str(Path(log_dir).resolve()))
    if key not in _sinks:
        if not _sinks:
            atexit.register(_close_all)
        _sinks[key] = TensorBoardSink(log_dir)
    return _sinks[key]


def _close_all() -> None:
    for sink in list(_sinks.values()):
        sink.close()


def event_files(log_dir: str | Path) -> list[Path]:
    """The TensorBoard event files in a run directory (none when it is gone)."""
    try:
        return sorted(Path(log_dir).glob(TBOARD_GLOB))
    except OSError:
        return []
