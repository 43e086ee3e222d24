"""A rank's run logs: ``rank{R}.log`` (text) and its events in its node's ``node{K}.events.jsonl``
(one JSON per line, each with its rank).

Why: these files are the contract with ``ddp_hpc.status`` (docs/architecture.md, "Run logs"),
which names the failing rank and the last step from them; their names and the keys every event
carries (`EVENT_KEYS`) are spelled in ``ddp_hpc.runlogs.schema``.  Files are appended to, so a
requeued job's second run continues the same stream. Events go through the node's one writer
(``runlogs.nodelog``: at most one append per second per node, at once for the evidence of a
failure or an end, so a killed process leaves its error and its end); text lines are flushed at
once.  Console lines go through
``tqdm.write``, which clears rank 0's progress bar first and redraws it below, so a log line never
lands on the bar's line.  Writes hold a lock: a background checkpoint writer's thread writes
its ``checkpoint`` event beside the training thread's (train/asyncsave.py).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from tqdm import tqdm

from ddp_hpc.env import job_facts
from ddp_hpc.env.sources import node_index
from ddp_hpc.runlogs import tboard
from ddp_hpc.runlogs.nodelog import URGENT_EVENTS, node_log
from ddp_hpc.runlogs.schema import EVENT_KEYS, node_events_file, text_log


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
                 restart: int = 0, console: bool | None = None, node: int | None = None,
                 start_first: bool = False) -> None:
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.job_id, self.restart = rank, job_id, restart
        self.host = socket.gethostname()
        self.node = node_index(os.environ) if node is None else node
        self._events = node_log(str(self.dir / node_events_file(self.node)))
        self._text = open(self.dir / text_log(rank), "a", encoding="utf-8")
        self.console = (rank == 0) if console is None else console
        self._tb = tboard.sink_for(self.dir, rank)   # rank 0: step/epoch/eval also to TensorBoard
        self._lock = threading.Lock()
        #: ``start_first``: the events written before the run's ``start`` (the training core's
        #: set-up: a sweep of snapshots ended jobs left), held and written right after it, at their
        #: time then, so a run's first event is its start; an ``error`` or ``end`` first lets them go
        self._held: list[tuple[str, dict]] | None = [] if start_first else None

    def event(self, name: str, **fields: Any) -> dict:
        with self._lock:
            if self._held is not None and name not in ("start", "error", "end"):
                self._held.append((name, fields))
                return {"event": name, **fields}
            held, self._held = self._held or [], None
            rec = self._write(name, fields)
            for n, f in held:
                self._write(n, f)
        return rec

    def _write(self, name: str, fields: dict) -> dict:
        # the keys every event carries, in the order the schema lists them
        rec = dict(zip(EVENT_KEYS, (time.time(), name, self.rank, self.job_id, self.restart,
                                    self.host), strict=True))
        rec.update(fields)
        self._events.write(json.dumps(rec, default=_jsonable) + "\n", urgent=name in URGENT_EVENTS)
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

    def flush(self, wait: bool = False) -> bool:
        """Have the node's events so far appended now (its writer batches them); ``wait``: until
        they are (`nodelog.NodeLog.flush`)."""
        return self._events.flush(wait)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        self._events.flush()    # the node's file stays open for the process's other run logs
        try:
            self._text.close()
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
