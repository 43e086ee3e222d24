"""The staging of a job's data, per node, from the node leaders' ``stage`` events: what was copied
(``data.io=stage`` of a config job, ``submit --stage`` of a script), how many bytes, how long,
MB/s and how (copy | sbcast | reused)."""
from __future__ import annotations

from ddp_hpc.judge.reader import RunLogs

__all__ = ["stage_rows", "stage_lines"]

_FIELDS = ("node", "method", "src", "variable", "path", "bytes", "files", "seconds", "mb_per_s", "made_by")


def stage_rows(logs: RunLogs) -> list[dict]:
    """One row per node leader and source, from the current run (restart) of the logs."""
    restart = logs.current_restart()
    rows = [{k: ev.get(k) for k in _FIELDS} | {"rank": rank}
            for rank, stream in logs.ranks.items() for ev in stream.of_restart(restart)
            if ev.get("event") == "stage"]
    return sorted(rows, key=lambda r: (str(r["node"]), str(r["src"]), r["rank"]))


def _row_text(row: dict) -> str:
    size = f"{(row.get('bytes') or 0) / 1e6:.1f} MB"
    files = row.get("files") or 1
    if files > 1:
        size += f", {files} files"
    took = f"in {float(row.get('seconds') or 0):.2f} s"
    how = (f"{row['mb_per_s']:.0f} MB/s" if row.get("mb_per_s") is not None
           else f"made by attempt {row.get('made_by')}")
    var = f" -> ${row['variable']}" if row.get("variable") else ""
    return f"{row.get('node') or 'rank ' + str(row['rank'])}  {row.get('method') or '?':<6}  {row.get('src')}{var}  " \
           f"{size} {took} ({how})"


def stage_lines(rows: list[dict]) -> list[str]:
    """The detail view's ``Staging:`` lines (none when nothing was staged)."""
    return [("Staging:    " if i == 0 else "            ") + _row_text(r) for i, r in enumerate(rows)]
