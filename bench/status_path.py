"""The status path's length: which ddp_hpc modules the detail view (`ddp-hpc status JOB`) and the
table cross for one failed 3-rank Slurm job (synthetic run logs; a scheduler stand-in answering
like sacct), how many distinct caller-module -> callee-module call edges (one climb back up each),
and how often `records.final_of` is read. docs/architecture.md, "The status path".

    python bench/status_path.py                          # this tree
    git archive 37f317e ddp_hpc | tar -x -C /tmp/before
    PYTHONPATH=/tmp/before python bench/status_path.py   # an older tree, to compare
"""
import json
import os
import sys
import tempfile
from pathlib import Path

T0 = 1_800_000_000.0


class Sacct:
    """squeue knows no job; sacct says every job asked for FAILED."""

    def cluster_name(self):
        return "c1"

    def squeue(self, job_ids=None, **kw):
        return []

    def sacct(self, job_ids, **kw):
        return [{"JobID": j, "JobIDRaw": j, "State": "FAILED", "ExitCode": "1:0", "Elapsed": "00:03:21",
                 "Timelimit": "01:00:00", "NNodes": "1", "NodeList": "n1", "JobName": "t"} for j in job_ids]


def ev(rank, name, t, **extra):
    return {"time": T0 + t, "event": name, "rank": rank, "job_id": "88", "restart": 0, "host": "n1", **extra}


def failed_job(tmp: Path, records) -> None:
    """Job 88: 3 ranks stepped 19 times, then rank 2 raised and the others lost it."""
    d = tmp / "run"
    d.mkdir()
    for r in range(3):
        evs = [ev(r, "start", 0, world_size=3, total_steps=1000, device="cpu")]
        evs += [ev(r, "step", s, step=s, loss=1.0, total_steps=1000) for s in range(1, 20)]
        msg = "ValueError: bad batch" if r == 2 else "Connection closed by peer"
        evs += [ev(r, "error", 30 + r, exc_type="RuntimeError", message=msg),
                ev(r, "end", 31 + r, status="failed", exit_code=1)]
        (d / f"rank{r}.events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))
    records.write_record(records.JobRecord(
        id="88", cluster="c1", name="t", backend="sbatch", nodes=1, gpus_per_node=3, time_limit="01:00:00",
        log_dir=str(d), config=None, overrides=[], submitted_at=T0, cwd="/", command=["python", "t.py"]))


def measure(fn) -> tuple[set, set, int]:
    """(modules entered, caller -> callee module edges, calls of final_of) while ``fn`` runs."""
    mods, edges, finals = set(), set(), [0]

    def prof(frame, event, arg):
        if event != "call":
            return
        m = frame.f_globals.get("__name__", "")
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
        finals[0] += frame.f_code.co_name == "final_of"
        if m.startswith("ddp_hpc"):
            mods.add(m)
            if caller.startswith("ddp_hpc") and caller != m:
                edges.add((caller, m))
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return mods, edges, finals[0]


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    os.environ["DDP_HPC_HOME"] = str(tmp / "home")
    from ddp_hpc import records
    from ddp_hpc.status import view
    from ddp_hpc.status.collect import collect
    from ddp_hpc.status.targets import recent_targets
    failed_job(tmp, records)
    now = T0 + 100
    views = {"detail": lambda: view.render_detail(collect(recent_targets(0), Sacct(), now=now)[0], now=now),
             "table": lambda: view.render_table(collect(recent_targets(0), Sacct(), now=now, brief=True))}
    for name, fn in views.items():
        mods, edges, finals = measure(fn)
        print(f"{name}: {len(mods)} modules, {len(edges)} distinct cross-module call edges; "
              f"records.final_of read {finals} times")
        print("   ", " ".join(sorted(m.removeprefix("ddp_hpc.") for m in mods)))


if __name__ == "__main__":
    main()
