"""One rank's run log for the script helpers: a `RunLog` that never raises.

The wrapper must hand back its child's exit status whatever happens to the log directory (full
disk, deleted directory, read-only mount), and ``ddp_hpc.report`` must never stop a training
script; so every write goes through `SafeLog`, which reports the first failure once on stderr and
then stops writing.  Without a log directory it writes nothing.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ddp_hpc.runlogs.writer import RunLog


class SafeLog:
    """`RunLog`'s event / info / warning for one rank; a failed write is reported once, then the
    log is off.  ``log_dir=None`` gives a log that only prints warnings."""

    def __init__(self, log_dir: str | Path | None, rank: int, job_id: str | None = None,
                 restart: int = 0, who: str = "ddp_hpc") -> None:
        self.who, self.rank = who, rank
        self.dir = Path(log_dir) if log_dir else None
        self._log: RunLog | None = None
        if self.dir is not None:
            try:
                self._log = RunLog(self.dir, rank, job_id=job_id, restart=restart, console=False)
            except Exception as exc:  # noqa: BLE001 - logging must not cost the run
                self._failed(exc)

    @property
    def active(self) -> bool:
        return self._log is not None

    @property
    def node(self) -> int:
        """The node whose event file this log writes (0 without a log)."""
        return self._log.node if self._log is not None else 0

    def flush(self, wait: bool = False) -> None:
        self._call("flush", wait)

    def event(self, name: str, **fields: Any) -> dict | None:
        return self._call("event", name, **fields)

    def info(self, msg: str) -> None:
        self._call("info", msg, console=False)

    def warning(self, msg: str) -> None:
        if self._log is None:
            print(f"[rank {self.rank}] WARNING: {msg}", file=sys.stderr, flush=True)
        else:
            self._call("warning", msg)

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def _call(self, _method: str, /, *args: Any, **kwargs: Any) -> Any:
        if self._log is None:
            return None
        try:
            return getattr(self._log, _method)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - logging must not cost the run
            self._failed(exc)
            return None

    def _failed(self, exc: BaseException) -> None:
        print(f"{self.who}: cannot write rank {self.rank}'s run log in {self.dir}: "
              f"{type(exc).__name__}: {exc}; the run goes on without it", file=sys.stderr, flush=True)
        log, self._log = self._log, None
        if log is not None:
            log.close()
