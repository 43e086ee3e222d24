"""What the wrapper adds to the child's environment beyond the torchrun variables, and what it
reads back when the child ends (docs/scripts.md, "What status sees without changes").

- torchrun's other variables, where the user has not set them: ``TORCHELASTIC_RESTART_COUNT``
  (this run's restart number), ``TORCHELASTIC_MAX_RESTARTS`` (0; under the
  in-allocation supervisor its ``--max-restarts``, which it sets for the step), ``TORCHELASTIC_ERROR_FILE``
  (``rank<R>.error.json`` in the run directory: what ``torch.distributed.elastic``'s ``@record``
  writes; read back as the rank's error) and ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (1, as torchrun);
- PyTorch's flight recorder where NCCL can be used (the rank sees a GPU) and the user has not
  chosen: a trace buffer, a dump on a collective timeout, the dump files in the run directory
  (``ddp_hpc.judge.flightrec`` reads them);
- for a Python command, unless turned off (``DDP_HPC_INSTRUMENT=0``, ``submit --no-instrument``):
  ``ddp_hpc/instrument/site`` first on PYTHONPATH and ``DDP_HPC_INSTRUMENT_BOOT`` (the exit-record
  pipe, the faulthandler file), so the script's interpreter starts ``ddp_hpc.instrument``.
  An installation without that folder's ``sitecustomize.py`` (a wheel built without its package
  data) is refused before the script starts (``check_installed``), never run blind.
"""
from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from ddp_hpc.errors import HintError
from ddp_hpc.fsutil import file_size
from ddp_hpc.judge.stacks import stack_excerpt
from ddp_hpc.runlogs.schema import error_file, fault_file, flight_prefix

#: the opt-out: DDP_HPC_INSTRUMENT=0 (or false / no / off)
INSTRUMENT_VAR = "DDP_HPC_INSTRUMENT"
#: the wrapper's configuration for the child (JSON: ``ddp_hpc.instrument.boot.start``); the child's
#: ``sitecustomize`` removes it from the environment at start-up
BOOT_VAR = "DDP_HPC_INSTRUMENT_BOOT"
SITE_DIR = Path(__file__).resolve().parents[1] / "instrument" / "site"
#: flight recorder entries kept per process group (PyTorch's docs suggest 2000)
TRACE_BUFFER = "2000"
_PYTHON = re.compile(r"python[0-9.]*")


def torch_environ(log_dir: Path | None, rank: int, restart: int, gpus: bool) -> dict[str, str]:
    """The variables torchrun (and the flight recorder) would set, for variables not set yet."""
    out = {"TORCHELASTIC_RESTART_COUNT": str(restart), "TORCHELASTIC_MAX_RESTARTS": "0",
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    if log_dir is not None:
        out["TORCHELASTIC_ERROR_FILE"] = str(log_dir / error_file(rank))
    if gpus:
        out.update(TORCH_NCCL_TRACE_BUFFER_SIZE=TRACE_BUFFER, TORCH_NCCL_DUMP_ON_TIMEOUT="1")
        if log_dir is not None:
            prefix = str(log_dir / flight_prefix())
            out.update(TORCH_FR_DUMP_TEMP_FILE=prefix, TORCH_NCCL_DEBUG_INFO_TEMP_FILE=prefix)
    return out


def is_python(cmd: Sequence[str]) -> bool:
    """A Python command: ``python``, ``python3.11``, any path to one, this interpreter, or a
    script whose ``#!`` line names python."""
    first = cmd[0]
    if _PYTHON.fullmatch(os.path.basename(first)) or os.path.realpath(first) == os.path.realpath(sys.executable):
        return True
    try:
        with open(first, "rb") as f:
            line = f.readline(200)
    except OSError:
        return False
    return line.startswith(b"#!") and b"python" in line


def wanted(environ: Mapping[str, str]) -> bool:
    return environ.get(INSTRUMENT_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


class InstrumentError(HintError):
    """The command is to be instrumented, but this installation of ddp_hpc cannot."""


def check_installed(cmd: Sequence[str], environ: Mapping[str, str]) -> None:
    """Raise InstrumentError when ``cmd`` is to be instrumented and the start-up hook is missing
    from this installation: the script would run with nothing for status to see."""
    hook = SITE_DIR / "sitecustomize.py"
    if wanted(environ) and is_python(cmd) and not hook.is_file():
        raise InstrumentError(
            f"cannot instrument {cmd[0]!r}: {hook} is missing from this installation of ddp_hpc "
            "(a wheel built without ddp_hpc/instrument/site/)",
            "reinstall ddp_hpc from a release or a source tree (pip install --force-reinstall); to run "
            f"the script uninstrumented meanwhile: ddp-hpc submit --no-instrument, or {INSTRUMENT_VAR}=0")


@dataclass
class Instrumentation:
    """The child's instrumentation: the exit-record pipe and the rank's fault file."""

    fault: Path | None = None
    fault_start: int = 0
    read_fd: int | None = None
    write_fd: int | None = None
    pass_fds: tuple[int, ...] = field(default=())

    @classmethod
    def prepare(cls, cmd: Sequence[str], child_env: dict[str, str], log_dir: Path | None,
                rank: int) -> "Instrumentation":
        """Set up ``child_env`` for an instrumented Python command (nothing for others)."""
        if not (wanted(child_env) and is_python(cmd)):
            return cls()
        fault = log_dir / fault_file(rank) if log_dir is not None else None
        r, w = os.pipe()
        os.set_blocking(r, False)
        config = {"exit_fd": w, "fault": str(fault) if fault else None,
                  "pythonpath": child_env.get("PYTHONPATH")}
        child_env["PYTHONPATH"] = os.pathsep.join([str(SITE_DIR), *filter(None, [child_env.get("PYTHONPATH")])])
        child_env[BOOT_VAR] = json.dumps(config)
        return cls(fault, file_size(fault), r, w, (w,))

    def started(self) -> None:
        """The child has the pipe's write end (or failed to start): close ours."""
        if self.write_fd is not None:
            os.close(self.write_fd)
            self.write_fd = None

    def ending(self) -> dict | None:
        """The child's exit record (``{"code": 0, "how": "end"}``), None when it wrote none."""
        if self.read_fd is None:
            return None
        self.started()
        try:
            data = os.read(self.read_fd, 4096)
        except OSError:
            data = b""
        finally:
            os.close(self.read_fd)
            self.read_fd = None
        for line in reversed(data.decode("utf-8", "replace").splitlines()):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("code"), int):
                return rec
        return None

    def fault_stack(self) -> str | None:
        """What faulthandler wrote for this run: its first line ("Fatal Python error:
        Segmentation fault") and the crashing thread's innermost frames; None when nothing."""
        if self.fault is None:
            return None
        try:
            with open(self.fault, "rb") as f:
                f.seek(self.fault_start)
                text = f.read(1 << 20).decode("utf-8", "replace")
        except OSError:
            return None
        first = next((ln for ln in text.splitlines() if ln.strip()), None)
        if first is None:
            return None
        lines = [first] + [ln for ln in stack_excerpt(text) if ln != first]
        return "\n".join(lines) + "\n"


def read_error_file(path: Path | None, since: float) -> dict | None:
    """The error ``torch.distributed.elastic``'s ``@record`` wrote to ``path`` after ``since``
    (``{"message": {"message": "ValueError: ...", "extraInfo": {"py_callstack": ...}}}``), as
    ``exc_type``, ``message``, ``traceback``; None when there is none."""
    try:
        if path is None or path.stat().st_mtime < since:
            return None
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
        msg = data["message"]
        text = msg["message"] if isinstance(msg, dict) else str(msg)
        tb = (msg.get("extraInfo") or {}).get("py_callstack") if isinstance(msg, dict) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    exc_type, _, message = str(text).partition(": ")
    return {"exc_type": exc_type or "Error", "message": message, "traceback": tb}
