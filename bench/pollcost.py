"""What the supervisor's reading of a run's events costs at scale: a synthetic run directory of N
ranks on M nodes, and the supervisor's own reader (``ddp_hpc.supervise.watch.EventTail``) polling it.

    python bench/scale.py --make-run DIR --ranks 8192 --nodes 1024   # the run directory, current layout
    python bench/scale.py --make-run DIR --ranks 8192 --nodes 1024 --layout rank   # a file per rank, as before
    python bench/scale.py --poll DIR --polls 20                       # a first poll, then 20 idle ones
    python bench/scale.py --poll DIR --polls 20 --count               # the same under strace: file ops
    python bench/pollcost.py --sweep [--json OUT]   # 64, 512, 8,192 ranks, both layouts: the table

``--poll`` prints the CPU seconds of the first poll (every file read from its start) and of one idle
poll (nothing new: what the supervisor pays every second for as long as the job runs), and of a
poll after one step's events (every rank appended one ``step`` line). Anyone can count the file
operations with a counter of their own (``strace -f -c``, an LD_PRELOAD shim) around ``--poll``;
``--count`` does it with strace where there is one: it runs ``--poll`` twice under strace, with no
idle poll and with K, and divides the difference by K, so the interpreter's start and the first poll
cancel out. Metadata operations are opens and stats (``openat``, ``stat``, ``newfstatat``,
``statx``, ``fstat``, ``lstat``) and directory reads (``getdents64``).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from ddp_hpc.runlogs.schema import events_file, node_events_file, rank_out, text_log  # noqa: E402
from ddp_hpc.supervise.watch import EventTail  # noqa: E402

JOB_ID = "900002"
#: the step events each rank has written before the polls (a run some minutes in)
STEPS = 50
#: the system calls `--count` counts, by kind
META_CALLS = ("openat", "open", "stat", "newfstatat", "statx", "fstat", "lstat", "getdents64")
DATA_CALLS = ("read", "pread64", "lseek", "write")


def host(node: int) -> str:
    return f"gpu{node + 1:04d}"


def _event(t: float, name: str, rank: int, node: int, **fields) -> str:
    rec = {"time": round(t, 3), "event": name, "rank": rank, "job_id": JOB_ID, "restart": 0, "host": host(node)}
    return json.dumps({**rec, **fields}) + "\n"


def step_line(rank: int, node: int, step: int, t: float, data_s: float = 0.012) -> str:
    return _event(t, "step", rank, node, epoch=0, step=step, total_steps=100000, loss=1.25, lr=3e-4,
                  samples_per_s=51234.5, data_s=data_s, rss_mb=30512.3, cpu_percent=101.5)


def make_run(log_dir: Path, ranks: int, nodes: int, steps: int = STEPS, layout: str = "node",
             slow: int | None = None, silent_s: float = 1.0) -> dict:
    """A run directory as a job of ``ranks`` ranks on ``nodes`` nodes leaves it some minutes in: each
    rank's event stream (start, rendezvous, ``steps`` step events) in the writer's layout (``node``:
    one file per node, as ``runlogs.nodelog`` writes it: a second's lines of the node's ranks
    together; ``rank``: one file per rank, as versions before it did), its ``rank{R}.out`` and its
    ``rank{R}.log``. ``slow``: that rank waits 0.5 s a step for its data, the others 0.012 s (a
    straggler status must name). ``silent_s``: how long ago the newest step was (a second: a
    job that runs; minutes: one that hangs, and status reads every rank's output for its
    cause). Returns what it wrote."""
    if ranks % nodes:
        raise SystemExit(f"--ranks {ranks} is not a multiple of --nodes {nodes}")
    per_node = ranks // nodes
    log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time() - 10 - steps - silent_s
    by_node: dict[int, list[list[str]]] = {}
    for r in range(ranks):
        node = r // per_node
        lines = [_event(t0, "start", r, node, world_size=ranks, num_nodes=nodes, local_rank=r % per_node, pid=4242,
                        total_steps=100000, epochs=1, launcher="slurm", device=f"cuda:{r % per_node}"),
                 _event(t0 + 5, "rendezvous", r, node, proc_start=t0 - 4, called_at=t0 + 1, up_at=t0 + 5,
                        step_id=f"{JOB_ID}.0", warm=False)]
        lines += [step_line(r, node, s, t0 + 10 + s, data_s=0.5 if r == slow else 0.012)
                  for s in range(1, steps + 1)]
        if layout == "rank":
            (log_dir / events_file(r)).write_text("".join(lines))
        else:
            by_node.setdefault(node, []).append(lines)
        (log_dir / rank_out(r)).write_text("UserWarning: TF32 is enabled\n")
        (log_dir / text_log(r)).write_text(f"2026-01-01 00:00:00 [rank {r}] start\n")
    for node, streams in by_node.items():   # the ranks' lines of each second, together
        (log_dir / node_events_file(node)).write_text("".join(line for group in zip(*streams) for line in group))
    return {"dir": str(log_dir), "ranks": ranks, "nodes": nodes, "files": len(os.listdir(log_dir)), "layout": layout}


def append_step(log_dir: Path, ranks: int, nodes: int, step: int) -> int:
    """One step's events as the layout's writer appends them: every rank its ``step`` line to its
    own file, or each node's forwarder the node's lines in one append. Returns the appends."""
    per_node = max(1, ranks // nodes)
    t = time.time()
    if (log_dir / events_file(0)).exists():
        for r in range(ranks):
            with open(log_dir / events_file(r), "a", encoding="utf-8") as f:
                f.write(step_line(r, r // per_node, step, t))
        return ranks
    for node in range(nodes):
        with open(log_dir / node_events_file(node), "a", encoding="utf-8") as f:
            f.write("".join(step_line(r, node, step, t) for r in range(node * per_node, (node + 1) * per_node)))
    return nodes


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def poll(log_dir: Path, polls: int, step: bool = False) -> dict:
    """The supervisor's reader over ``log_dir``: a first poll, ``polls`` idle polls, and (``step``)
    one more after every rank appended a step event. CPU seconds of each kind of poll."""
    tail = EventTail(log_dir, 0)
    c = _cpu()
    first = len(tail.poll())
    out = {"first_s": _cpu() - c, "first_events": first, "polls": polls}
    if polls:
        c = _cpu()
        idle = sum(len(tail.poll()) for _ in range(polls))
        out.update(idle_s=(_cpu() - c) / polls, idle_events=idle)
    if step:
        start = _start_event(log_dir)
        appends = append_step(log_dir, start["world_size"], start["num_nodes"], STEPS + 1)
        c = _cpu()
        n = len(tail.poll())
        out.update(step_s=_cpu() - c, step_events=n, step_appends=appends)
    return out


def _start_event(log_dir: Path) -> dict:
    """Rank 0's start event (the job's size), from `make_run`'s files."""
    own = log_dir / events_file(0)
    with open(own if own.exists() else log_dir / node_events_file(0), encoding="utf-8") as f:
        return json.loads(f.readline())


def _strace_counts(argv: list[str]) -> dict[str, int]:
    """System calls of ``argv`` (and its threads) by name, as ``strace -f -c`` counts them."""
    with tempfile.NamedTemporaryFile("r", suffix=".strace") as out:
        subprocess.run(["strace", "-f", "-qq", "-c", "-o", out.name, *argv], check=True, stdout=subprocess.DEVNULL)
        counts: dict[str, int] = {}
        for line in out.read().splitlines():
            parts = line.split()
            if len(parts) >= 5 and parts[-1] not in ("syscall", "total") and parts[3].isdigit():
                counts[parts[-1]] = int(parts[3])
        return counts


def count(log_dir: Path, polls: int) -> dict:
    """File operations per idle poll: ``--poll`` under strace with ``polls`` idle polls minus with
    none, over ``polls``."""
    if shutil.which("strace") is None:
        raise SystemExit("--count needs strace (apt install strace); or count around --poll with your own tool")
    me = [sys.executable, os.path.abspath(__file__), "--poll", str(log_dir)]
    base = _strace_counts(me + ["--polls", "0", "--quiet"])
    many = _strace_counts(me + ["--polls", str(polls), "--quiet"])
    per = {k: (many.get(k, 0) - base.get(k, 0)) / polls for k in set(base) | set(many)}
    meta = sum(per.get(k, 0) for k in META_CALLS)
    return {"polls": polls, "metadata_ops_per_poll": meta,
            "per_poll": {k: round(v, 1) for k, v in sorted(per.items()) if k in META_CALLS + DATA_CALLS and v}}


#: the sizes of `sweep`: (ranks, nodes), 8 ranks a node
SWEEP = ((64, 8), (512, 64), (8192, 1024))


def sweep(work: Path, polls: int = 10) -> list[dict]:
    """Both layouts at every size of `SWEEP`: CPU of an idle poll and of one after a step, the
    appends of a step, and (with strace) the metadata operations of an idle poll."""
    rows = []
    for ranks, nodes in SWEEP:
        for layout in ("rank", "node"):
            d = work / f"{layout}-{ranks}"
            make_run(d, ranks, nodes, layout=layout)
            r = poll(d, polls, step=True)
            c = count(d, polls)["metadata_ops_per_poll"] if shutil.which("strace") else None
            rows.append({"ranks": ranks, "nodes": nodes, "layout": layout, "idle_s": r["idle_s"],
                         "step_s": r["step_s"], "step_appends": r["step_appends"], "metadata_ops": c})
            shutil.rmtree(d, ignore_errors=True)
    return rows


def render(rows: list[dict]) -> str:
    out = [f"{'ranks':>6} {'nodes':>6} {'files':>6}  {'idle poll: metadata ops':>24} {'CPU s':>8}  "
           f"{'one step: appends':>18} {'poll CPU s':>10}"]
    for r in rows:
        ops = f"{r['metadata_ops']:.0f}" if r["metadata_ops"] is not None else "(no strace)"
        out.append(f"{r['ranks']:>6} {r['nodes']:>6} {('rank' if r['layout'] == 'rank' else 'node'):>6}  "
                   f"{ops:>24} {r['idle_s']:>8.4f}  {r['step_appends']:>18} {r['step_s']:>10.3f}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None, status_cost=None) -> int:
    """The command line; ``status_cost`` (bench/scale.py's, which hands these flags over): times
    ``status JOB`` of a run directory for ``--status``."""
    import argparse
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--make-run", metavar="DIR", help="write a synthetic run directory there")
    p.add_argument("--ranks", type=int, default=8192)
    p.add_argument("--nodes", type=int, default=1024)
    p.add_argument("--slow", type=int, metavar="RANK", help="with --make-run: that rank a straggler (slow data)")
    p.add_argument("--silent", type=float, default=1.0, metavar="S",
                   help="with --make-run: the newest step S seconds ago (default 1: a job that runs; 600: hung)")
    p.add_argument("--layout", choices=("node", "rank"), default="node",
                   help="event files per node (this version's writer, default) or per rank (earlier versions)")
    p.add_argument("--poll", metavar="DIR", help="run the supervisor's reader over that run directory")
    p.add_argument("--polls", type=int, default=20, help="idle polls after the first (default 20)")
    p.add_argument("--step", action="store_true", help="then append one step's events and poll once more")
    p.add_argument("--count", action="store_true", help="count the file operations per idle poll (strace)")
    p.add_argument("--status", action="store_true", help="time `ddp-hpc status JOB` of the run instead")
    p.add_argument("--sweep", action="store_true", help="both layouts at 64, 512 and 8,192 ranks: the table")
    p.add_argument("--json", metavar="PATH", help="with --sweep: also write the rows as JSON")
    p.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.sweep:
        work = Path(tempfile.mkdtemp(prefix="ddp_hpc_pollcost-"))
        try:
            rows = sweep(work, args.polls)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        sys.stdout.write(render(rows))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        return 0
    if args.make_run:
        made = make_run(Path(args.make_run), args.ranks, args.nodes, layout=args.layout, slow=args.slow,
                        silent_s=args.silent)
        print(f"bench: {made['files']} files for {made['ranks']} ranks on {made['nodes']} nodes in {made['dir']} "
              f"(event files per {made['layout']})")
        return 0
    if not args.poll:
        p.error("give --make-run DIR or --poll DIR")
    if args.status:
        if status_cost is None:
            p.error("--status: run it as bench/scale.py --poll DIR --status (the status timing is there)")
        st = status_cost(Path(args.poll))
        print(f"bench: status JOB (detail view, {st['lines']} lines): {st['cpu_s']:.2f} s CPU, "
              f"{st['wall_s']:.2f} s wall (the least of 3)")
        return 0
    if args.count:
        c = count(Path(args.poll), max(1, args.polls))
        print(f"bench: {c['metadata_ops_per_poll']:.0f} metadata operations per idle poll "
              f"(opens, stats, directory reads), over {c['polls']} polls; per poll: {c['per_poll']}")
        return 0
    r = poll(Path(args.poll), args.polls, args.step)
    if not args.quiet:
        line = f"bench: first poll {r['first_s']:.3f} s CPU ({r['first_events']} events)"
        if args.polls:
            line += f"; idle poll {r['idle_s']:.4f} s CPU ({args.polls} polls, {r['idle_events']} events)"
        if args.step:
            line += (f"; poll after one step {r['step_s']:.3f} s CPU ({r['step_events']} events, written in "
                     f"{r['step_appends']} appends)")
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
