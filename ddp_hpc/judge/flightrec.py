"""PyTorch's flight recorder dumps in a run directory, summarised: the last collective each rank
entered and which ranks are missing from the newest one.

``ddp_hpc.exec`` turns the recorder on where NCCL can be used (``TORCH_NCCL_TRACE_BUFFER_SIZE``,
``TORCH_NCCL_DUMP_ON_TIMEOUT``) and points its dumps into the run directory
(``TORCH_FR_DUMP_TEMP_FILE=<run dir>/flight_recorder_rank``; PyTorch appends the rank). A dump is
PyTorch's own format (``torch/distributed/flight_recorder``): a pickle (or JSON) of ``version``,
``pg_config`` and ``entries``, each entry with ``process_group`` (id, description),
``collective_seq_id``, ``profiling_name`` ("nccl:all_reduce"), ``state`` ("scheduled" | "started"
| "completed"), ``is_p2p`` and the Python ``frames`` that issued it. The pickle is read with an
unpickler that builds only plain values (no class is ever loaded), so a dump cannot run code.
"""
from __future__ import annotations

import io
import json
import pickle
from pathlib import Path
from typing import Any, Callable

from ddp_hpc.runlogs.schema import flight_prefix

__all__ = ["read_dump", "dumps", "summary"]

MAX_BYTES = 64 << 20


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a flight recorder dump holds plain values, not {module}.{name}")


def read_dump(path: Path) -> dict | None:
    """One dump file as a dict, or None when it is not a readable dump."""
    try:
        data = path.read_bytes()[:MAX_BYTES]
        dump = json.loads(data) if data.lstrip()[:1] == b"{" else _PlainUnpickler(io.BytesIO(data)).load()
    except Exception:  # bytes from disk: a truncated or crafted pickle can make the unpickler raise
        return None    # nearly anything (TypeError, AttributeError, RecursionError, MemoryError, ...)
    return dump if isinstance(dump, dict) and isinstance(dump.get("entries"), list) else None


def dumps(log_dir: Path, since: float | None = None) -> dict[int, dict | None]:
    """rank -> its dump in ``log_dir`` (only files written at or after ``since``); None for a file
    that is there but no readable dump (truncated, or not PyTorch's format)."""
    out: dict[int, dict | None] = {}
    prefix = flight_prefix()
    for path in sorted(Path(log_dir).glob(prefix + "*")):
        rank = path.name[len(prefix):]
        try:
            if not rank.isdigit() or (since is not None and path.stat().st_mtime < since):
                continue
        except OSError:
            continue
        out[int(rank)] = read_dump(path)
    return out


def _last_collectives(dump: dict) -> dict[str, dict]:
    """process group -> the newest collective this rank entered in it."""
    last: dict[str, dict] = {}
    for e in dump["entries"]:
        if not isinstance(e, dict) or e.get("is_p2p") or not isinstance(e.get("collective_seq_id"), int):
            continue
        pg = e.get("process_group")
        name = str(pg[1] if isinstance(pg, (list, tuple)) and len(pg) > 1 else pg or "default_pg")
        if name not in last or e["collective_seq_id"] >= last[name]["collective_seq_id"]:
            last[name] = e
    return last


def _op(e: dict) -> str:
    return f"{str(e.get('profiling_name') or '?').split(':')[-1]} #{e['collective_seq_id']}"


def summary(per_rank: dict[int, dict | None], ranks_text: Callable[[list[int]], str]) -> list[str]:
    """Lines for status: per process group, the last collective the ranks entered, and the ranks
    missing from the newest (behind it: the ranks the others wait for); then the ranks whose dump
    could not be read."""
    lines = []
    lasts = {r: _last_collectives(d) for r, d in sorted(per_rank.items()) if d is not None}
    for pg in sorted({pg for by_pg in lasts.values() for pg in by_pg}):
        entered = {r: by_pg[pg] for r, by_pg in lasts.items() if pg in by_pg}
        newest = max(e["collective_seq_id"] for e in entered.values())
        groups: dict[str, list[int]] = {}
        for r, e in entered.items():
            groups.setdefault(f"{_op(e)} ({e.get('state') or '?'})", []).append(r)
        said = "; ".join(f"{ranks_text(rs)} last entered {what}" for what, rs in groups.items())
        behind = sorted(r for r, e in entered.items() if e["collective_seq_id"] < newest)
        if behind:
            said += f": {ranks_text(behind)} missing from #{newest}"
        lines.append(f"{pg}: {said}")
    if unreadable := sorted(r for r, d in per_rank.items() if d is None):
        names = ", ".join(f"{flight_prefix()}{r}" for r in unreadable)
        lines.append(f"unreadable: {names} (cut short, or not PyTorch's dump format)")
    return lines
