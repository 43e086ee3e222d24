"""Rows and the markdown table of bench/peers.py."""
from __future__ import annotations

from peers_loaders import OURS, TECHNIQUES


def summarise(per_rank: list[dict], a: dict) -> list[dict]:
    """One row per (scenario, technique): samples/s averaged over the ranks, best of the rounds
    (all rounds and their median are kept too); opens and bytes of all ranks summed, the largest
    round's; the ratio to the faster of ddp_hpc's cures in the same scenario of the same run."""
    rows = []
    ranks = len(per_rank)
    for scen in dict.fromkeys(c["scenario"] for c in per_rank[0]["cells"]):
        scen_rows = []
        for label in TECHNIQUES:
            rounds = sorted({c["round"] for c in per_rank[0]["cells"]})
            by_round = [[next(c for c in r["cells"]
                              if (c["scenario"], c["technique"], c["round"]) == (scen, label, rnd))
                         for r in per_rank] for rnd in rounds]
            sps = [sum(c["samples"] / (c["open_s"] + c["epoch_s"]) for c in cells) / ranks for cells in by_round]
            best_round = max(range(len(rounds)), key=lambda i: sps[i])
            cells = by_round[best_round]
            ours = label in OURS
            opens = [c["opens_fsio"] if ours else c["opens_hook"] for c in cells]
            scen_rows.append({
                "scenario": scen, "technique": label, "ddp_hpc": ours, "rounds": len(rounds),
                "samples_per_s_rank": sps[best_round], "samples_per_s_rank_rounds": sps,
                "samples_per_s_rank_median": sorted(sps)[len(sps) // 2],
                "samples_per_s_rank_epoch_only": sum(c["samples"] / c["epoch_s"] for c in cells) / ranks,
                "samples_per_cpu_s_rank": max(sum(c["samples"] / c["cpu_s"] for c in cs) / ranks
                                              for cs in by_round) if ours and "cpu_s" in cells[0] else None,
                "samples": sum(c["samples"] for c in cells),
                "opens": max(sum((c["opens_fsio"] if ours else c["opens_hook"]) for c in cs) for cs in by_round),
                "opens_by": "ddp_hpc.data.fsio" if ours else "audit hook",
                "opens_audit_hook": sum(c["opens_hook"] for c in cells),
                "bytes": max(sum((c["bytes_fsio"] if ours else c["bytes_wrapped"]) for c in cs) for cs in by_round),
                "ranks_touching_shared": sum(1 for n in opens if n),
                "open_s_max": max(c["open_s"] for c in cells)})
        best = max(r["samples_per_s_rank"] for r in scen_rows if r["ddp_hpc"])
        best_label = next(r["technique"] for r in scen_rows if r["ddp_hpc"] and r["samples_per_s_rank"] == best)
        for r in scen_rows:
            r["vs_best_ddp_hpc"] = r["samples_per_s_rank"] / best
            r["best_ddp_hpc"] = best_label
        rows += scen_rows
    return rows


def _row(rows, scen, label):
    return next((r for r in rows if r["scenario"] == scen and r["technique"] == label), None)


def markdown(rows: list[dict], checks: dict, a: dict, vers: dict, cold: bool) -> str:
    scens = list(dict.fromkeys(r["scenario"] for r in rows))
    best = ", ".join(f"{s}: {_row(rows, s, OURS[0])['best_ddp_hpc']}" for s in scens)
    out = [f"{a['files']} PNG files, {a['nodes']} pretend nodes x {a['ppn']} ranks, batch {a['batch']}, 0 loader "
           f"workers; one epoch per cell, the first of a fresh job (open/stage + epoch; node-local caches empty); "
           f"samples/s per rank: best of {a['rounds']} interleaved rounds. "
           f"`simfs` = SIMULATED metadata-bound shared FS: +{a['delay_s'] * 1e3:g} ms per open of a shared file. "
           + ("Cold: page cache dropped before each cell." if cold else "Cold: SKIPPED (not root or --no-drop-caches).")
           + f" Ratios: samples/s over ddp_hpc's faster cure in the same scenario ({best}).", "",
           "| technique | shared opens / epoch (counted) | shared MB / epoch | " +
           " | ".join(f"{s} samples/s per rank | vs best ddp_hpc" for s in scens) +
           " | exact coverage (checked) | mid-epoch resume (checked) |",
           "|---|---:|---:|" + "---:|---:|" * len(scens) + "---|---|"]
    for label in TECHNIQUES:
        warm = _row(rows, scens[0], label)
        name = f"ddp_hpc {label}" if label in OURS else label
        cells = " | ".join(f"{_row(rows, s, label)['samples_per_s_rank']:.0f} | "
                           f"{_row(rows, s, label)['vs_best_ddp_hpc']:.2f}" for s in scens)
        chk = checks[label]
        out.append(f"| {name} | {warm['opens']} | {warm['bytes'] / 1e6:.1f} | {cells} | "
                   f"{'yes' if chk['coverage']['ok'] else 'no'} | {'yes' if chk['resume']['ok'] else 'no'} |")
    out += ["", "Checks, in detail:", ""]
    for label in TECHNIQUES:
        chk = checks[label]
        out.append(f"- {label}: coverage: {chk['coverage']['detail']}; resume: {chk['resume']['detail']}.")
    opens = "; ".join(f"{s}: " + ", ".join(f"{r['technique']} {r['opens']}" for r in rows if r["scenario"] == s)
                      for s in scens)
    out += ["", f"Counted opens per scenario ({opens}). Cross-check: the audit hook saw "
            + ", ".join(f"{label} {_row(rows, scens[0], label)['opens_audit_hook']}" for label in OURS)
            + " Python-level opens of ddp_hpc's cures in the warm cells (fsio also counts py-lmdb's C open).",
            "Versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()) + "."]
    return "\n".join(out)
