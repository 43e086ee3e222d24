"""The detail view's GPU lines: each rank's GPU as its newest sample tells it, and the GPUs that
idle while their rank trains (`ddp_hpc.judge.gpu`)."""
from __future__ import annotations

from ddp_hpc.judge.gpu import GpuReport

__all__ = ["MAX_ROWS", "gpu_lines"]

#: ranks shown one a line; beyond, the ranks with the least busy GPUs (``--json`` has them all)
MAX_ROWS = 16


def _row(rank: str, g: dict) -> str:
    parts = [f"rank {rank:<3} {str(g.get('host') or '-'):<10}"]
    if g.get("util_percent") is not None:
        parts.append(f"{g['util_percent']:>3}% busy")
    if g.get("mem_used_mb") is not None and g.get("mem_total_mb"):
        parts.append(f"memory {g['mem_used_mb'] / 1024:.1f}/{g['mem_total_mb'] / 1024:.1f} GiB")
    if g.get("temp_c") is not None:
        parts.append(f"{g['temp_c']} C")
    if g.get("power_w") is not None:
        parts.append(f"{g['power_w']:.0f} W")
    if g.get("ecc_errors"):
        parts.append(f"ECC errors {g['ecc_errors']}")
    if g.get("xid_errors"):
        parts.append("XID " + ", ".join(map(str, g["xid_errors"])))
    return "  ".join(parts)


def gpu_lines(gpus: GpuReport | None) -> list[str]:
    """``GPUs:`` then one line per rank (at most `MAX_ROWS`: the least busy), then ``GPU idle:``
    lines; nothing without samples."""
    if gpus is None or not gpus.ranks:
        return []
    ranks = gpus.ranks
    shown = sorted(ranks, key=int)
    if len(shown) > MAX_ROWS:
        shown = sorted(sorted(shown, key=lambda r: ranks[r].get("util_percent", 101))[:MAX_ROWS], key=int)
    out = ["GPUs:"] + [f"  {_row(r, ranks[r])}" for r in shown]
    if len(ranks) > len(shown):
        out.append(f"  ({len(ranks) - len(shown)} more ranks, busier; --json has them all)")
    return out + [("GPU idle:   " if i == 0 else "            ") + ln for i, ln in enumerate(gpus.lines)]
