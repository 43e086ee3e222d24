"""Per-rank run logs: ``rank{R}.log`` (text) and ``rank{R}.events.jsonl`` (one JSON per line).

Why: these files are the contract with ``ddp_hpc.status`` (docs/architecture.md, "Run logs"),
which names the failing rank and the last step from them.  Every event carries the same six keys
(time, event, rank, job_id, restart, host); files are opened in append mode so a requeued job's
second run continues the same stream, and every line is flushed at once so a killed process
leaves a complete record up to its last event.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

EVENT_KEYS = ("time", "event", "rank", "job_id", "restart", "host")


def resolve_log_dir(log_dir_cfg: str, run_id: str, environ: dict | None = None) -> Path:
    """``$DDP_HPC_LOG_DIR`` when set (the submit backends set it), else ``<log.dir>/<run id>``."""
    environ = os.environ if environ is None else environ
    override = environ.get("DDP_HPC_LOG_DIR")
    return Path(override) if override else Path(log_dir_cfg) / run_id


class RunLog:
    """Writes one rank's text log and event stream; the rank-0 console gets the text lines too."""

    def __init__(self, log_dir: str | Path, rank: int, job_id: str | None = None,
                 restart: int = 0, console: bool | None = None) -> None:
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.job_id, self.restart = rank, job_id, restart
        self.host = socket.gethostname()
        self._events = open(self.dir / f"rank{rank}.events.jsonl", "a", encoding="utf-8")
        self._text = open(self.dir / f"rank{rank}.log", "a", encoding="utf-8")
        self.console = (rank == 0) if console is None else console

    def event(self, name: str, **fields: Any) -> dict:
        rec = {"time": time.time(), "event": name, "rank": self.rank, "job_id": self.job_id,
               "restart": self.restart, "host": self.host}
        rec.update(fields)
        self._events.write(json.dumps(rec, default=_jsonable) + "\n")
        self._events.flush()
        return rec

    def info(self, msg: str, *, console: bool = True) -> None:
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} [rank {self.rank}] {msg}"
        self._text.write(line + "\n")
        self._text.flush()
        if console and self.console:
            print(line, file=sys.stderr, flush=True)

    def warning(self, msg: str) -> None:
        self.info(f"WARNING: {msg}", console=False)
        # warnings reach the console on every rank: they usually need action
        print(f"[rank {self.rank}] WARNING: {msg}", file=sys.stderr, flush=True)
        logging.getLogger("ddp_hpc.train").debug(msg)

    def close(self) -> None:
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


class Progress:
    """A tqdm bar on rank 0 when stderr is a terminal; otherwise nothing (the caller logs one
    line per interval instead).  `mode` is log.progress: auto | bar | lines | off."""

    def __init__(self, rank: int, total: int, initial: int, mode: str = "auto") -> None:
        self.bar = None
        use_bar = mode == "bar" or (mode == "auto" and sys.stderr.isatty())
        if rank == 0 and use_bar:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
        self.lines = rank == 0 and self.bar is None and mode != "off"

    def update(self, n: int = 1, **postfix: Any) -> None:
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
