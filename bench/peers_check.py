"""The two yes/no checks of bench/peers.py, computed from what the ranks actually delivered.

A sample is known by the xxh3 hash of its decoded tensor and label (peers_pack.sample_hash);
``expected`` maps every file's hash to its index, so a wrong or corrupted sample shows up as
"unknown" rather than passing as some other one.
"""
from __future__ import annotations

from collections import Counter


def _cover_one(lists: list[list[int]], expected: dict, world: int) -> dict:
    """DistributedSampler(drop_last=False)'s guarantee for one epoch: every sample at least once,
    the only repeats are its padding (``-n % world`` of them), every rank the same count."""
    n = len(expected)
    seen = Counter(h for hashes in lists for h in hashes)
    pad = -n % world
    missing = sum(1 for h in expected if h not in seen)
    unknown = sum(c for h, c in seen.items() if h not in expected)
    repeats = sum(c - 1 for h, c in seen.items() if h in expected and c > 1)
    per_rank = [len(hashes) for hashes in lists]
    ok = missing == 0 and unknown == 0 and repeats <= pad and len(set(per_rank)) == 1
    return {"ok": ok, "missing": missing, "repeats": repeats, "padding_allowed": pad, "unknown": unknown,
            "per_rank": per_rank}


def coverage(per_rank: list[dict], label: str, expected: dict, world: int) -> dict:
    """The check for every epoch of ``label`` (each scenario, each round); yes only when all pass."""
    scenarios = {}
    for cell in per_rank[0]["cells"]:
        if cell["technique"] != label:
            continue
        key = (cell["scenario"], cell["round"])
        lists = [next(c["hashes"] for c in r["cells"] if c["technique"] == label
                      and (c["scenario"], c["round"]) == key) for r in per_rank]
        scenarios[f"{key[0]} round {key[1]}"] = _cover_one(lists, expected, world)
    first = next(iter(scenarios.values()))
    return {"ok": all(s["ok"] for s in scenarios.values()), "by_scenario": scenarios,
            "detail": (f"missing {first['missing']}, repeats {first['repeats']} (padding allows "
                       f"{first['padding_allowed']}), per rank {'/'.join(map(str, first['per_rank']))}")}


def resume_check(per_rank: list[dict], label: str) -> dict:
    """Resumed after k batches, the rest must be exactly the samples the uninterrupted epoch
    (the warm cell's) still had to give: first part + resumed part == the whole epoch, all ranks
    together (a multiset: padding repeats count).  The reference is the first warm round's epoch."""
    full = Counter(h for r in per_rank for c in r["cells"] if c["technique"] == label and c["scenario"] == "warm"
                   and c["round"] == 0 for h in c["hashes"])
    res = [r["resume"][label] for r in per_rank]
    first = Counter(h for x in res for h in x["first"])
    rest = Counter(h for x in res for h in x["rest"])
    errors = [x["error"] for x in res if x["error"]]
    missing_after = full - first
    ok = not errors and res[0]["has_state"] and rest == missing_after
    over = sum((rest - missing_after).values())
    under = sum((missing_after - rest).values())
    detail = (f"stopped after {res[0]['k']} batches/rank ({sum(first.values())} samples); resumed part "
              f"{sum(rest.values())} samples: {under} of the missing ones not given, {over} given that were "
              f"not missing")
    if not res[0]["has_state"]:
        detail = "no loader state to checkpoint; a restarted loader starts the epoch over: " + detail
    if errors:
        detail = "resume failed: " + errors[0]
    return {"ok": ok, "detail": detail, "k": res[0]["k"], "not_given": under, "given_twice": over}
