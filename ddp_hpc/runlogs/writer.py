"""Per-rank run logs: ``rank{R}.log`` (text) and ``rank{R}.events.jsonl`` (one JSON per line).

Why: these files are the contract with ``ddp_hpc.status`` (docs/architecture.md, "Run logs"),
which names the failing rank and the last step from them; their names and the keys every event
carries (`EVENT_KEYS`) are spelled in ``ddp_hpc.runlogs.schema``.  Files are opened in append mode
so a requeued job's second run continues the same stream, and every line is flushed at once so a
killed process leaves a complete record up to its last event.  Console lines go through
``tqdm.write``, which clears rank 0's progress bar first and redraws it below, so a log line never
lands on the bar's line.  Writes hold a lock: a background checkpoint writer's thread writes
its ``checkpoint`` event beside the training thread's (train/asyncsave.py).
"""
from __future__ import annotations

import json
import logging
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from tqdm import tqdm

from ddp_hpc.env import job_facts
from ddp_hpc.runlogs import tboard
from ddp_hpc.runlogs.schema import EVENT_KEYS, events_file, text_log


def resolve_log_dir(log_dir_cfg: str, run_id: str, environ: Mapping[str, str] | None = None) -> Path:
    """``$DDP_HPC_LOG_DIR`` when set (the submit backends set it), else ``<log.dir>/<run id>``."""
    override = job_facts(environ).log_dir
    return Path(override) if override else Path(log_dir_cfg) / run_id


def echo(line: str) -> None:
    """One line to stderr, above a progress bar when one is shown (never glued onto it)."""
    tqdm.write(line, file=sys.stderr)
    sys.stderr.flush()


class RunLog:
    """Writes one rank's text log and event stream; the rank-0 console gets the text lines too."""

    def __init__(self, log_dir: str | Path, rank: int, job_id: str | None = None,
                 restart: int = 0, console: bool | None = None) -> None:
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.job_id, self.restart = rank, job_id, restart
        self.host = socket.gethostname()
        self._events = open(self.dir / events_file(rank), "a", encoding="utf-8")
        self._text = open(self.dir / text_log(rank), "a", encoding="utf-8")
        self.console = (rank == 0) if console is None else console
        self._tb = tboard.sink_for(self.dir, rank)   # rank 0: step/epoch/eval also to TensorBoard
        self._lock = threading.Lock()

    def event(self, name: str, **fields: Any) -> dict:
        # the keys every event carries, in the order the schema lists them
        rec = dict(zip(EVENT_KEYS, (time.time(), name, self.rank, self.job_id, self.restart,
                                    self.host), strict=True))
        rec.update(fields)
        line = json.dumps(rec, default=_jsonable) + "\n"
        with self._lock:
            self._events.write(line)
            self._events.flush()
            if self._tb is not None:
                self._tb.write(rec)
        return rec

    def info(self, msg: str, *, console: bool = True) -> None:
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} [rank {self.rank}] {msg}"
        with self._lock:
            self._text.write(line + "\n")
            self._text.flush()
        if console and self.console:
            echo(line)

    def warning(self, msg: str) -> None:
        self.info(f"WARNING: {msg}", console=False)
        # warnings reach the console on every rank: they usually need action
        echo(f"[rank {self.rank}] WARNING: {msg}")
        logging.getLogger("ddp_hpc.train").debug(msg)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        for f in (self._events, self._text):
            try:
                f.close()
            except OSError:
                pass


def _jsonable(obj: Any) -> Any:
    try:
        return float(obj)
    except (TypeError, ValueError):
        return str(obj)


class StepBar:
    """A tqdm bar on rank 0 when stderr is a terminal (a disabled one elsewhere: updates cost
    nothing); without a bar rank 0 logs one line per interval instead (`lines`).  `mode` is
    log.progress: auto | bar | lines | off."""

    def __init__(self, rank: int, total: int, initial: int, mode: str = "auto") -> None:
        show = rank == 0 and (mode == "bar" or (mode == "auto" and sys.stderr.isatty()))
        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                        disable=not show)
        self.lines = rank == 0 and not show and mode != "off"

    def update(self, n: int = 1) -> None:
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()
