"""Cost as the job grows: ddp_hpc's own per-rank work at 8, 64, 512 and 8,192 ranks, without processes.

Every section simulates a job of N ranks laid out as N/8 nodes x 8 ranks (up to 1,024 nodes) in this
one process, and times ddp_hpc's code on real-shaped inputs:

- ``env``:      `ddp_hpc.env.detect` for every rank, from the variables srun sets for that task
                (SLURM_STEP_NODELIST=gpu[0001-1024], SLURM_STEP_TASKS_PER_NODE=8(x1024), ...);
- ``hostlist``: expand and compress of the job's node list;
- ``groups``:   the rank lists of node, leader and strided groups (`ddp_hpc.dist`) and the group
                broadcast's plan (`ddp_hpc.data.broadcast.build_plan`, modes node / strided /
                two_level) as one rank builds them, torch.distributed replaced by a stand-in;
- ``status``:   ``python -m ddp_hpc.status JOBID`` (detail view) and ``--json``, in-process through
                `ddp_hpc.status.cli.main`, on a job record pointing at synthetic run logs: every
                rank's ``rank<R>.events.jsonl`` in the writer's format (a first run that was
                preempted and requeued, a second run in which one rank raised and the others lost
                their peer), ``rank<R>.out`` and the batch output with srun's reports;
                The same job's page, ``status JOBID --html`` (its time and ratio to the detail
                view), and the page alone: drawn and written once its logs are read (HTML_GOAL_S);
- ``table``:    ``python -m ddp_hpc.status`` (the table of the 20 newest jobs) and ``--limit 0``
                (every job) over 8 ... 10,000 job records: a refresh, and the first view (before
                the table's cache of ended jobs, ``ddp_hpc.status.rowcache``, holds their rows),
                over records without and with the table's facts of the logs kept in their final
                state (``ddp_hpc.judge.kept``);
- ``scheduler``: ``status --limit 0`` over 10,000 Slurm jobs and over one array of 1,000 tasks,
                with a stand-in scheduler (`ddp_hpc.slurm.cli.SlurmCLI` with a runner that answers
                squeue / sacct / scontrol as Slurm does: one job in 5 (or in 50) running, the rest
                completed) that counts the Slurm commands each refresh runs.

Outside the ``scheduler`` section the scheduler is not asked (status runs as on a machine without
Slurm's commands): this measures ddp_hpc's costs, not slurmctld's. Times are the best of a few
repetitions (the machine may be shared) in CPU seconds of this process, which other work on a
shared machine does not stretch (the status goals show the wall clock too); the event files are
in the page cache, having just been written.

Each line shows the cost per unit (per rank, per host, per record) at every size and the growth
factor: the cost per unit at the largest size over the lowest cost per unit at any size (fixed
costs make the smallest sizes dear per unit). Linear or better means the cost per unit does not
grow (factor <= GROWTH_OK, which allows for noise). Two sections have
an inherent factor: every rank's DistEnv holds all the job's host names (O(nodes) per rank, so the
``env`` line is judged per rank per node), and every rank builds every group's rank list (torch
needs all ranks to create all groups, so ``groups`` is one rank's cost per rank of the world).
Goal: linear or better everywhere, and the status of an 8,192-rank job in under STATUS_GOAL_S.

    python bench/scale.py                  # 8, 64, 512 and 8,192 ranks (a few minutes, ~5 GB of logs)
    python bench/scale.py --quick          # 8 and 64 ranks only: a smoke run
    python bench/scale.py --json out.json --events 2000 --workdir /tmp/scale
    python bench/scale.py --only table,scheduler   # the job table over many records and Slurm jobs only

The supervisor's reading of a run's events (``bench/pollcost.py``, which these flags hand over to):

    python bench/scale.py --make-run DIR --ranks 8192 --nodes 1024   # a synthetic run directory
    python bench/scale.py --poll DIR --polls 20 [--step] [--count]    # the supervisor's reader over it
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from ddp_hpc import records  # noqa: E402
from ddp_hpc.env import detect  # noqa: E402
from ddp_hpc.slurm import hostlist  # noqa: E402
from ddp_hpc.status import cli as status_cli  # noqa: E402

SIZES = (8, 64, 512, 8192)
QUICK_SIZES = (8, 64)
TABLE_SIZES = (8, 64, 512, 10000)
PER_NODE = 8
JOB_ID = "900001"
STATUS_GOAL_S = 5.0
HTML_GOAL_S = 2.0   # the page of a job (--html) drawn and written, its logs read
GROWTH_OK = 2.0
#: the layout of the synthetic jobs' event files: ``node`` (this version's writer) or ``rank`` (`--layout`)
LAYOUT = ["node"]
#: the table over many records, Slurm jobs and array tasks: the first view (no row kept yet) and a
#: refresh within SCHED_GOAL_S (CPU seconds), one squeue and one sacct call however many
#: (what, how many, one in how many runs): a running job's row is worked out on every refresh
SCHED_SIZES = (("jobs", 10000, 5), ("jobs", 10000, 50), ("array tasks", 1000, 5))
QUICK_SCHED = (("jobs", 50, 5), ("array tasks", 40, 5))
SCHED_GOAL_S = 5.0
#: the parts `--only` picks: the per-rank sections (env ... status --json), the table over many
#: records, the table against the stand-in scheduler
PARTS = ("ranks", "table", "scheduler")
SECTIONS = ("env", "hostlist expand", "hostlist compress", "groups: node/leader/strided lists",
            "groups: build_plan two_level", "status detail", "status --json", "table (20 newest)",
            "table --limit 0")


#: wall-clock seconds of the last `best_of` (its best repetition): the CPU time is what the
#: tables show, as other work on a shared machine stretches the wall clock but not this
#: process's CPU time; the status goal is shown in both
LAST_WALL = [0.0]


def best_of(fn, reps: int) -> float:
    """The least CPU time (user + system, seconds) of ``reps`` calls of ``fn()``."""
    best, wall = float("inf"), 0.0
    for _ in range(max(1, reps)):
        t0, w0 = time.process_time(), time.perf_counter()
        fn()
        cpu = time.process_time() - t0
        if cpu < best:
            best, wall = cpu, time.perf_counter() - w0
    LAST_WALL[0] = wall
    return best


def nodelist(nodes: int) -> str:
    return f"gpu[0001-{nodes:04d}]" if nodes > 1 else "gpu0001"


def host(node: int) -> str:
    return f"gpu{node + 1:04d}"


def slurm_environ(rank: int, ranks: int) -> dict[str, str]:
    """What srun sets for task ``rank`` of a --nodes=N --ntasks-per-node=8 --gpus-per-node=8 job."""
    nodes, node = ranks // PER_NODE, rank // PER_NODE
    nl, tpn = nodelist(nodes), f"{PER_NODE}(x{nodes})" if nodes > 1 else str(PER_NODE)
    return {
        "SLURM_JOB_ID": JOB_ID, "SLURM_JOBID": JOB_ID, "SLURM_JOB_NAME": "train", "SLURM_CLUSTER_NAME": "big",
        "SLURM_JOB_NODELIST": nl, "SLURM_NODELIST": nl, "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_NNODES": str(nodes), "SLURM_TASKS_PER_NODE": tpn, "SLURM_NTASKS": str(ranks),
        "SLURM_NTASKS_PER_NODE": str(PER_NODE), "SLURM_NPROCS": str(ranks), "SLURM_STEP_ID": "0",
        "SLURM_STEPID": "0", "SLURM_STEP_NODELIST": nl, "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_STEP_NUM_TASKS": str(ranks), "SLURM_STEP_TASKS_PER_NODE": tpn, "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank % PER_NODE), "SLURM_NODEID": str(node), "SLURMD_NODENAME": host(node),
        "SLURM_TASK_PID": "4242", "SLURM_GPUS_ON_NODE": str(PER_NODE), "SLURM_GPUS_PER_NODE": f"h100:{PER_NODE}",
        "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(PER_NODE))), "SLURM_RESTART_COUNT": "1",
        "SLURM_SUBMIT_DIR": "/home/user/project", "PATH": "/usr/bin:/bin", "HOME": "/home/user",
    }


# --- env, hostlist
def bench_env(ranks: int, reps: int) -> float:
    """Seconds to derive every rank's DistEnv (``ancestors`` stands in for psutil's process tree)."""
    environs = [slurm_environ(r, ranks) for r in range(ranks)]
    ancestors = lambda: [4242, 1]  # noqa: E731  (the task pid srun recorded is this process's parent)

    def run():
        for e in environs:
            env = detect(e, ancestors=ancestors)
        assert env.world_size == ranks and len(env.hostnames) == ranks // PER_NODE
    return best_of(run, reps)


def bench_hostlist(nodes: int, reps: int) -> tuple[float, float]:
    """(seconds per expand, per compress) of a ``nodes``-host list."""
    expr = nodelist(nodes)
    hosts = hostlist.expand(expr)
    assert hostlist.compress(hosts) == expr
    n = max(1, 4096 // nodes)
    t_exp = best_of(lambda: [hostlist.expand(expr) for _ in range(n)], reps) / n
    t_comp = best_of(lambda: [hostlist.compress(hosts) for _ in range(n)], reps) / n
    return t_exp, t_comp


# --- groups
def bench_groups(ranks: int, reps: int) -> tuple[float, float]:
    """(seconds for one rank to build the node, leader and strided rank lists; seconds for one rank
    to build the two_level broadcast plan), averaged over a few ranks (a leader, others)."""
    import ddp_hpc.dist as ddp_dist
    from ddp_hpc.data import broadcast

    env = detect(slurm_environ(0, ranks), ancestors=lambda: [4242])
    layout = ddp_dist.block_layout([PER_NODE] * (ranks // PER_NODE))
    sample = sorted({0, 1, ranks // 2 + 3, ranks - 1})

    def lists():
        assert len(ddp_dist.node_rank_lists(env)) == ranks // PER_NODE
        ddp_dist.strided_rank_lists(env)
        ddp_dist.leader_ranks(env)
    t_lists = best_of(lists, reps)
    fake = SimpleNamespace(get_world_size=lambda: ranks, get_rank=None,
                           new_subgroups_by_enumeration=lambda lists, timeout=None: (None, []))
    t_plan = 0.0
    with mock.patch.object(ddp_dist, "dist", fake), mock.patch.object(broadcast, "dist", fake), \
            mock.patch.object(broadcast, "gather_layout", lambda env: layout):
        for rank in sample:
            fake.get_rank = lambda rank=rank: rank
            t_plan += best_of(lambda: broadcast.build_plan(env, "two_level"), reps)
            for mode in ("node", "strided"):  # the other modes work too (not timed separately)
                broadcast.build_plan(env, mode)
    return t_lists, t_plan / len(sample)


# --- synthetic run logs, in the writer's format (ddp_hpc.runlogs.schema / writer)
RANK, LOCAL, HOST = -111111, -222222, "@HOST@"  # placeholders replaced per rank
STEP_S = 2.0  # seconds between step events
TRACEBACK = ('Traceback (most recent call last):\n  File "train.py", line 88, in <module>\n    main()\n'
             '  File "train.py", line 61, in main\n    batch = next(loader)\n'
             'ValueError: bad batch 4711\n')
PEER_LOST = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.1.0.7]:41233"


def _line(t: float, name: str, restart: int, **fields) -> str:
    rec = {"time": t, "event": name, "rank": RANK, "job_id": JOB_ID, "restart": restart, "host": HOST}
    return json.dumps({**rec, **fields}) + "\n"


def _run_lines(restart: int, t0: float, n_events: int, total: int, first_step: int,
               slow: bool) -> tuple[list[str], float, int]:
    """One run's events of one rank: start, steps (an epoch event every 50), eval and checkpoint
    lines are rank 0's in real runs but cost the same here. Returns (lines, last time, last step)."""
    out = [_line(t0, "start", restart, world_size=0, num_nodes=0, local_rank=LOCAL, pid=4242,
                 total_steps=total, epochs=10, launcher="slurm", device="cuda:0")]
    t, step = t0, first_step
    for i in range(n_events - 1):
        t += STEP_S
        step += 10
        if i % 50 == 49:
            out.append(_line(t, "epoch", restart, epoch=step // 1000, step=step, loss=2.0 / (1 + step / 1e4),
                             samples_per_s=51234.5))
            continue
        out.append(_line(t, "step", restart, epoch=step // 1000, step=step, total_steps=total,
                         loss=2.0 / (1 + step / 1e4), lr=3e-4, samples_per_s=51234.5 + i % 7,
                         data_s=(0.09 if slow else 0.012) + (i % 5) * 1e-4, rss_mb=30512.3, cpu_percent=101.5))
    return out, t, step


def _bodies(ranks: int, n_events: int, t0: float) -> dict[bool, str]:
    """The text every rank shares (placeholders for rank and host), for a normal and a slow
    node: run 0 (preempted, requeued), then run 1 up to the failure."""
    half, total = n_events // 2, n_events * 10
    out = {}
    for slow in (False, True):
        run0, t, step = _run_lines(0, t0, half - 2, total, 0, slow)
        run0 += [_line(t + 1, "preempt", 0, signal="USR2", reason="time limit", step=step),
                 _line(t + 2, "end", 0, status="preempted", step=step, exit_code=0, signal=None, duration_s=t - t0)]
        run1, _, _ = _run_lines(1, t + 600, n_events - half - 2, total, step, slow)
        out[slow] = "".join(run0 + run1).replace('"world_size": 0, "num_nodes": 0',
                                                 f'"world_size": {ranks}, "num_nodes": {ranks // PER_NODE}')
    return out


def write_logs(log_dir: Path, ranks: int, n_events: int) -> int:
    """Every rank's files of a 2-run job whose second run failed: rank ``ranks // 2 + 3`` raised,
    the others lost their peer; its events in the `LAYOUT` of event files (``node``: a file per
    node, its ranks' lines of each moment together, as ``runlogs.nodelog`` appends them; ``rank``:
    a file per rank, as earlier versions wrote them). Returns the failing rank."""
    log_dir.mkdir(parents=True)
    now = time.time()
    t_fail = now - 3600
    t0 = t_fail - 600 - STEP_S * n_events
    bodies = _bodies(ranks, n_events, t0)
    bad, slow_node = ranks // 2 + 3 if ranks > 8 else ranks - 1, 1 if ranks > 16 else -1
    per_node: list[list[str]] = []
    for r in range(ranks):
        node = r // PER_NODE
        if r == bad:
            tail = [_line(t_fail, "error", 1, exc_type="ValueError", message="bad batch 4711", traceback=TRACEBACK,
                          exit_code=1, signal=None),
                    _line(t_fail + 0.1, "end", 1, status="failed", step=None, exit_code=1, signal=None, duration_s=1.0)]
            out = TRACEBACK
        else:
            tail = [_line(t_fail + 30, "error", 1, exc_type="RuntimeError", message=PEER_LOST, traceback=None,
                          exit_code=1, signal=None),
                    _line(t_fail + 30.1, "end", 1, status="failed", step=None, exit_code=1, signal=None,
                          duration_s=1.0)]
            out = f"[rank{r}]: RuntimeError: {PEER_LOST}\n"
        text = (bodies[node == slow_node] + "".join(tail)).replace(str(LOCAL), str(r % PER_NODE))
        text = text.replace(str(RANK), str(r)).replace(HOST, host(node))
        if LAYOUT[0] == "rank":
            (log_dir / f"rank{r}.events.jsonl").write_text(text)
        else:
            per_node.append(text.splitlines(keepends=True))
            if len(per_node) == PER_NODE:
                (log_dir / f"node{node}.events.jsonl").write_text("".join(x for g in zip(*per_node) for x in g))
                per_node = []
        (log_dir / f"rank{r}.out").write_text("UserWarning: TF32 is enabled\n" + out)
        (log_dir / f"rank{r}.log").write_text(f"2026-01-01 00:00:00 [rank {r}] start\n")
    nodes = ranks // PER_NODE
    lines = [f"srun: error: {host(bad // PER_NODE)}: task {bad}: Exited with exit code 1",
             f"srun: Terminating StepId={JOB_ID}.0"]
    for node in range(nodes):
        tasks = [t for t in range(node * PER_NODE, (node + 1) * PER_NODE) if t != bad]
        ids = f"{tasks[0]}-{tasks[-1]}" if len(tasks) == PER_NODE else ",".join(map(str, tasks))
        lines.append(f"srun: error: {host(node)}: tasks {ids}: Terminated")
    (log_dir / f"slurm-{JOB_ID}.out").write_text("\n".join(lines) + "\n")
    return bad


def write_record(home: Path, rec_id: str, log_dir: Path, nodes: int, submitted_at: float,
                 final: dict | None = None) -> None:
    """A job record as ddp_hpc.submit writes it (written directly: no fsync per record); ``final``:
    as status keeps it once the scheduler reported the end."""
    rec = records.JobRecord(id=rec_id, cluster="big", name="train", backend="sbatch", nodes=nodes,
                            gpus_per_node=PER_NODE, time_limit="2-00:00:00", log_dir=str(log_dir), config=None,
                            overrides=[], submitted_at=submitted_at, cwd="/home/user/project",
                            command=["python", "train.py"], final=final)
    (home / "jobs").mkdir(parents=True, exist_ok=True)
    (home / "jobs" / f"{rec_id}.json").write_text(json.dumps(rec.to_dict()))


# --- status, in-process
@contextlib.contextmanager
def status_home(home: Path):
    """``ddp-hpc status`` with $DDP_HPC_HOME=home and without asking a scheduler."""
    no_slurm = (None, "bench: the scheduler is not asked")
    with mock.patch.dict(os.environ, {"DDP_HPC_HOME": str(home)}), \
            mock.patch.object(status_cli, "slurm_cli", lambda: no_slurm):
        yield


def table_lines(text: str) -> int:
    """The table's lines (header and rows), without the notes under it (the columns left out to
    fit, the mark of jobs from another directory)."""
    return sum(1 for ln in text.splitlines() if not ln.startswith(("more with --wide:", "* submitted from")))


def run_status(argv: list[str]) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = status_cli.main(argv)
    assert rc == 0, (argv, buf.getvalue()[-2000:])
    return buf.getvalue()


def bench_status(work: Path, ranks: int, n_events: int, reps: int) -> tuple[float, float, float, float, dict]:
    """(seconds to write the logs, CPU seconds of ``status JOBID`` and of ``status JOBID --json``,
    wall-clock seconds of ``status JOBID``, the page's figures: `bench_html`) for one job."""
    home, log_dir = work / f"home-{ranks}", work / f"logs-{ranks}"
    t0 = time.perf_counter()
    bad = write_logs(log_dir, ranks, n_events)
    write_record(home, JOB_ID, log_dir, ranks // PER_NODE, time.time() - 4 * 86400)
    t_write = time.perf_counter() - t0
    with status_home(home):
        text = run_status([JOB_ID])
        assert f"First failure: rank {bad} " in text and "ValueError: bad batch 4711" in text, text[:3000]
        doc = json.loads(run_status([JOB_ID, "--json"]))
        assert doc["failure"]["rank"] == bad and len(doc["last_events"]) == ranks
        t_detail = best_of(lambda: run_status([JOB_ID]), reps)
        wall = LAST_WALL[0]
        t_json = best_of(lambda: run_status([JOB_ID, "--json"]), reps)
        html = bench_html(work / f"report-{ranks}.html", bad, reps)
    shutil.rmtree(log_dir, ignore_errors=True)
    return t_write, t_detail, t_json, wall, html


def bench_html(page: Path, bad: int, reps: int) -> dict:
    """``status JOBID --html PAGE`` (CPU and wall seconds), and the page alone: drawn and written
    from the job's status (`ddp_hpc.status.html.render_html`), the logs already read."""
    from ddp_hpc.fsutil import atomic_write
    from ddp_hpc.status.collect import collect
    from ddp_hpc.status.html import render_html
    from ddp_hpc.status.targets import job_targets
    run_status([JOB_ID, "--html", str(page)])
    assert f'data-kind="error" data-rank="{bad}"' in page.read_text(encoding="utf-8")
    t_cmd = best_of(lambda: run_status([JOB_ID, "--html", str(page)]), reps)
    wall = LAST_WALL[0]
    st = collect(job_targets(JOB_ID, None, None), None, None, history=True, lanes=True)[0]
    t_page = best_of(lambda: atomic_write(page, lambda f: f.write(render_html(st).encode("utf-8")), binary=True),
                     reps)
    out = {"html_s": t_cmd, "html_wall_s": wall, "page_s": t_page, "page_wall_s": LAST_WALL[0],
           "page_kib": page.stat().st_size >> 10, "lanes": len(st.picture.lanes)}
    page.unlink()
    return out


def small_dirs(work: Path) -> list[Path]:
    """16 small jobs' log directories (8 ranks, 40 events each) the table records point to."""
    dirs = []
    for i in range(16):
        d = work / "small" / f"job{i}"
        if not d.exists():
            write_logs(d, 8, 40)
        dirs.append(d)
    return dirs


def bench_table(work: Path, n_records: int, reps: int) -> tuple[float, float, float, float, float, float]:
    """(seconds for ``status`` (20 newest), for ``status --limit 0``, for the first
    ``status --limit 0``: no row kept yet, and its wall-clock seconds; the same first view over
    records that keep what the table shows of the logs, CPU and wall) over ``n_records`` records
    of 16 small jobs' logs."""
    from ddp_hpc.judge import kept
    from ddp_hpc.judge.reader import RunLogs
    from ddp_hpc.status import rowcache
    home = work / f"table-{n_records}"
    dirs = small_dirs(work)
    now = time.time()
    for i in range(n_records):
        write_record(home, str(100000 + i), dirs[i % 16], 1, now - 86400 + i)
    with status_home(home):
        t0, w0 = time.process_time(), time.perf_counter()
        text = run_status(["--limit", "0"])
        assert table_lines(text) == n_records + 1
        first, first_wall = time.process_time() - t0, time.perf_counter() - w0
        assert table_lines(run_status([])) == min(n_records, 20) + 1
        t20, t_all = best_of(lambda: run_status([]), reps), best_of(lambda: run_status(["--limit", "0"]), reps)
        # the same jobs as records keep them once status saw the scheduler report their end (or
        # the local driver saw them end): the final state with the table's facts of the logs
        finals = {str(d): {"state": "FAILED", "state_name": "FAILED", "source": "sacct", "seen_at": now,
                           "logs": kept.summarize(RunLogs(d, ends_only=True))} for d in dirs}
        for i in range(n_records):
            write_record(home, str(100000 + i), dirs[i % 16], 1, now - 86400 + i, finals[str(dirs[i % 16])])
        rowcache.cache_path().unlink(missing_ok=True)
        t0, w0 = time.process_time(), time.perf_counter()
        again = run_status(["--limit", "0"])
        first_kept, first_kept_wall = time.process_time() - t0, time.perf_counter() - w0
        assert table_lines(again) == n_records + 1 and again.count(" FAILED ") == text.count(" FAILED "), again[:2000]
        return t20, t_all, first, first_wall, first_kept, first_kept_wall


# --- the table against a stand-in scheduler that counts its calls
class StandInSlurm:
    """Answers squeue / sacct / scontrol argv as Slurm 22.05 does (``ddp_hpc.slurm.cli``'s
    separators and fields) for ``jobs`` (id or array task id -> state), counting each command."""

    def __init__(self, jobs: dict[str, str]):
        self.jobs, self.calls = jobs, {}

    def __call__(self, argv, *, input=None, cwd=None, env=None, timeout=None):
        from subprocess import CompletedProcess
        self.calls[argv[0]] = self.calls.get(argv[0], 0) + 1
        if argv[0] == "scontrol":
            return CompletedProcess(argv, 0, "ClusterName=big\n", "")
        asked = set(next(a for a in argv if a.startswith("--jobs=")).split("=", 1)[1].split(","))
        mine = [(j, st) for j, st in self.jobs.items() if j in asked or j.split("_", 1)[0] in asked]
        rows = [self._squeue(j) for j, st in mine if st == "RUNNING"] if argv[0] == "squeue" else \
            [r for j, st in mine if st != "RUNNING" for r in self._sacct(j, st)]
        return CompletedProcess(argv, 0, "".join(r + "\n" for r in rows), "")

    @staticmethod
    def _squeue(j: str) -> str:
        from ddp_hpc.slurm.cli import SEP, SQUEUE_FIELDS
        job, _, task = j.partition("_")
        row = dict(JobArrayID=j, JobID=job, ArrayJobID=job, ArrayTaskID=task or "N/A", State="RUNNING",
                   Reason="None", TimeUsed="1:00:05", TimeLimit="2-00:00:00", NumNodes="1", RestartCnt="0",
                   NodeList="gpu0001", Partition="gpu", UserName="user", SubmitTime="N/A", StartTime="N/A",
                   EndTime="N/A", Name="train")
        return "".join(f"{row[f]}{SEP}" for f in SQUEUE_FIELDS)

    @staticmethod
    def _sacct(j: str, state: str) -> list[str]:
        from ddp_hpc.slurm.cli import SACCT_FIELDS, SEP
        row = dict(JobID=j, JobIDRaw=j, State=state, ExitCode="0:0", Elapsed="01:02:03", Timelimit="2-00:00:00",
                   NNodes="1", NodeList="gpu0001", Partition="gpu", Submit="N/A", Start="N/A", End="N/A",
                   JobName="train")
        step = dict(row, JobID=f"{j}.0", JobIDRaw=f"{j}.0", JobName="python")
        return [SEP.join(r[f] for f in SACCT_FIELDS) for r in (row, step)]


def bench_scheduler(work: Path, n: int, array: bool, reps: int, every: int = 5) -> dict:
    """``status --limit 0`` over ``n`` Slurm jobs (or one array of ``n`` tasks) that a stand-in
    scheduler knows, one in ``every`` running: CPU and wall seconds of the first view and of a refresh,
    and the Slurm commands one refresh ran."""
    from ddp_hpc.slurm.cli import SlurmCLI
    home, dirs, now = work / f"sched-{n}-{array}", small_dirs(work), time.time()
    if array:
        ids = [f"700000_{i}" for i in range(n)]
        tasks = [{"task_id": i, "overrides": [f"train.lr={i}"], "log_dir": str(dirs[i % 16])} for i in range(n)]
        write_record(home, "700000", dirs[0], 1, now - 3600)
        path = home / "jobs" / "700000.json"
        path.write_text(json.dumps(dict(json.loads(path.read_text()), array=tasks)))
    else:
        ids = [str(200000 + i) for i in range(n)]
        for i, j in enumerate(ids):
            write_record(home, j, dirs[i % 16], 1, now - 86400 + i)
    sched = StandInSlurm({j: "RUNNING" if i % every == 0 else "COMPLETED" for i, j in enumerate(ids)})
    with mock.patch.dict(os.environ, {"DDP_HPC_HOME": str(home)}), \
            mock.patch.object(status_cli, "slurm_cli", lambda: (SlurmCLI(runner=sched), None)):
        t0, w0 = time.process_time(), time.perf_counter()
        text = run_status(["--limit", "0"])
        first, first_wall = time.process_time() - t0, time.perf_counter() - w0
        assert table_lines(text) == n + 1 and text.count(" RUNNING ") == len(ids[::every]), text[:2000]
        sched.calls.clear()
        refresh = best_of(lambda: run_status(["--limit", "0"]), reps)
        calls = {k: v // reps for k, v in sched.calls.items()}
    return {"first_s": first, "first_wall_s": first_wall, "refresh_s": refresh, "refresh_wall_s": LAST_WALL[0],
            "calls": calls}


# --- the report
def measure(sizes: tuple[int, ...], table_sizes: tuple[int, ...], n_events: int, work: Path,
            log=print, sched_sizes: tuple[tuple[str, int, int], ...] = (),
            only: frozenset[str] = frozenset(PARTS)) -> list[dict]:
    """One row per (section, size): the units it covered and its seconds; ``only``: which
    parts run (`PARTS`: ranks, table, scheduler)."""
    rows = []
    sizes = sizes if "ranks" in only else ()
    table_sizes = table_sizes if "table" in only else ()
    sched_sizes = sched_sizes if "scheduler" in only else ()

    def add(section: str, size: int, unit: str, units: int, seconds: float, **extra) -> None:
        rows.append({"section": section, "size": size, "unit": unit, "units": units, "seconds": seconds,
                     "per_unit_us": seconds / units * 1e6, **extra})

    for n in sizes:
        reps = 3 if n <= 512 else 1
        nodes = n // PER_NODE
        log(f"  {n} ranks ({nodes} x {PER_NODE}): env, host list, groups ...")
        t = bench_env(n, reps)
        add("env", n, "rank x node", n * nodes, t, per_rank_us=t / n * 1e6)
        t_exp, t_comp = bench_hostlist(nodes, reps)
        add("hostlist expand", n, "host", nodes, t_exp)
        add("hostlist compress", n, "host", nodes, t_comp)
        t_lists, t_plan = bench_groups(n, 5)  # one rank's build is cheap even at 8,192: more repetitions
        add("groups: node/leader/strided lists", n, "rank of the world", n, t_lists)
        add("groups: build_plan two_level", n, "rank of the world", n, t_plan)
        log(f"  {n} ranks: writing {n} x {n_events} events, then status ...")
        t_write, t_detail, t_json, wall, html = bench_status(work, n, n_events, 2 if n <= 512 else 1)
        add("status detail", n, "rank", n, t_detail, write_s=t_write, wall_s=wall, **html)
        add("status --json", n, "rank", n, t_json)
    for n in table_sizes:
        log(f"  {n} job records: status table ...")
        t20, t_all, first, first_wall, first_kept, first_kept_wall = bench_table(work, n, 3 if n <= 512 else 1)
        add("table (20 newest)", n, "record", n, t20)
        add("table --limit 0", n, "record", n, t_all, first_s=first, first_wall_s=first_wall,
            first_kept_s=first_kept, first_kept_wall_s=first_kept_wall)
    for what, n, every in sched_sizes:
        log(f"  {what}, 1 in {every} running: status --limit 0 against a stand-in scheduler ...")
        got = bench_scheduler(work, n, what.startswith("array"), 1, every)
        add(f"scheduler: {what}, 1 in {every} running", n, "job" if what == "jobs" else "task", n,
            got.pop("refresh_s"), **got)
    return rows


def summarize(rows: list[dict]) -> dict:
    """Growth factor per section and the verdict against the goals."""
    out = {"sections": {}, "goals": {}}
    for section in SECTIONS:
        mine = sorted((r for r in rows if r["section"] == section), key=lambda r: r["size"])
        if len(mine) < 2:
            continue
        # against the cheapest size, not the smallest: fixed costs make the smallest sizes dear
        # per unit and would hide a superlinear term that shows only between the larger ones
        growth = mine[-1]["per_unit_us"] / min(r["per_unit_us"] for r in mine)
        out["sections"][section] = {"growth": round(growth, 3), "linear": growth <= GROWTH_OK,
                                    "from": mine[0]["size"], "to": mine[-1]["size"]}
    status = [r for r in rows if r["section"] == "status detail"]
    biggest = max(status, key=lambda r: r["size"]) if status else None
    out["goals"]["linear or better"] = all(s["linear"] for s in out["sections"].values())
    if biggest is not None:
        out["goals"][f"status of {biggest['size']} ranks under {STATUS_GOAL_S:g} s"] = (
            biggest["seconds"] < STATUS_GOAL_S, round(biggest["seconds"], 3), round(biggest["wall_s"], 3))
    # the cold table (no row kept yet): the biggest record count, and every scheduler case
    tables = [r for r in rows if r["section"] == "table --limit 0"]
    cold = [max(tables, key=lambda r: r["size"])] if tables else []
    for r in cold + [r for r in rows if r["section"].startswith("scheduler: ")]:
        what = "records, no scheduler" if r in cold else r["section"][11:]
        out["goals"][f"first status --limit 0 over {r['size']:,} {what} within {SCHED_GOAL_S:g} s"] = (
            r["first_s"] <= SCHED_GOAL_S, round(r["first_s"], 3), round(r["first_wall_s"], 3))
    for r in cold:
        out["goals"][f"first status --limit 0 over {r['size']:,} records that keep the table's facts "
                     f"within {SCHED_GOAL_S:g} s"] = (r["first_kept_s"] <= SCHED_GOAL_S, round(r["first_kept_s"], 3),
                                                     round(r["first_kept_wall_s"], 3))
    return out


def render(rows: list[dict], summary: dict) -> str:
    sizes = sorted({r["size"] for r in rows if r["section"] == "env"})
    tsizes = sorted({r["size"] for r in rows if r["section"].startswith("table")})
    lines = []
    for title, names, cols in (("ranks", SECTIONS[:7], sizes), ("job records", SECTIONS[7:], tsizes)):
        head = f"{'section':<36}{'per':<18}" + "".join(f"{n:>11,}" for n in cols) + f"{'growth':>9}  verdict"
        lines += [f"cost per unit (us) by {title}:", head]
        for s in names:
            got = {r["size"]: r for r in rows if r["section"] == s}
            if not got:
                continue
            unit = next(iter(got.values()))["unit"]
            cells = "".join(f"{got[n]['per_unit_us']:>11.3f}" if n in got else f"{'-':>11}" for n in cols)
            g = summary["sections"].get(s)
            verdict = "-" if g is None else ("linear or better" if g["linear"] else "GROWS")
            growth = "-" if g is None else f"x{g['growth']:.2f}"
            lines.append(f"{s:<36}{unit:<18}{cells}{growth:>9}  {verdict}")
        lines.append("")
    lines.append("totals (CPU seconds):")
    for s in ("env", "status detail", "status --json", "table --limit 0"):
        got = sorted((r for r in rows if r["section"] == s), key=lambda r: r["size"])
        lines.append(f"  {s:<20}" + "  ".join(f"{r['size']:,}: {r['seconds']:.3f}" for r in got))
    env = sorted((r for r in rows if r["section"] == "env"), key=lambda r: r["size"])
    lines.append("  env per rank (us)   " + "  ".join(f"{r['size']:,}: {r['per_rank_us']:.1f}" for r in env))
    lines += scheduler_lines(rows) + html_lines(rows)
    lines.append("verdict:")
    for goal, ok in summary["goals"].items():
        if isinstance(ok, tuple):
            lines.append(f"  {goal}: {'yes' if ok[0] else 'NO'} ({ok[1]:.2f} s CPU, {ok[2]:.2f} s wall clock)")
        else:
            lines.append(f"  {goal}: {'yes' if ok else 'NO'}")
    return "\n".join(lines) + "\n"


def html_lines(rows: list[dict]) -> list[str]:
    """``status JOBID --html``: the command against the text detail view of the same job, and the
    page alone (drawn and written, the logs read) against the goal."""
    out = []
    for r in sorted((r for r in rows if r["section"] == "status detail" and "html_s" in r), key=lambda r: r["size"]):
        ok = "yes" if r["page_s"] < HTML_GOAL_S else "NO"
        out.append(f"  status --html, {r['size']:,} ranks ({r['lanes']} lanes, {r['page_kib']} KiB): "
                   f"{r['html_s']:.2f} s CPU ({r['html_wall_s']:.2f} s wall), x{r['html_s'] / r['seconds']:.2f} "
                   f"of the text detail view's {r['seconds']:.2f} s; the page alone {r['page_s']:.3f} s CPU "
                   f"({r['page_wall_s']:.3f} s wall), under {HTML_GOAL_S:g} s: {ok}")
    return (["status --html (the page of one job):"] + out) if out else []


def scheduler_lines(rows: list[dict]) -> list[str]:
    """The table's first view and refresh over many jobs and array tasks, with the Slurm commands
    one refresh ran, against the goal."""
    out = []
    for r in rows:
        if r["section"] == "table --limit 0" and r["size"] == max(TABLE_SIZES):
            out.append(f"  table --limit 0, {r['size']:,} records (no scheduler): first view {r['first_s']:.2f} s CPU "
                       f"({r['first_wall_s']:.2f} s wall), refresh {r['seconds']:.2f} s CPU; first view over "
                       f"records that keep the table's facts of the logs {r['first_kept_s']:.2f} s CPU "
                       f"({r['first_kept_wall_s']:.2f} s wall)")
    sched = [r for r in rows if r["section"].startswith("scheduler: ")]
    if sched:
        out.append("status --limit 0 against a stand-in scheduler (1 in N running, the rest completed):")
    for r in sched:
        calls = ", ".join(f"{k} {v}" for k, v in sorted(r["calls"].items())) or "none"
        ok = "yes" if r["seconds"] <= SCHED_GOAL_S else "NO"
        out.append(f"  {r['section'][11:]:<28} {r['size']:>7,}: first view {r['first_s']:.2f} s CPU "
                   f"({r['first_wall_s']:.2f} s wall), refresh {r['seconds']:.2f} s CPU "
                   f"({r['refresh_wall_s']:.2f} s wall); x{r['seconds'] / SCHED_GOAL_S:.2f} of the "
                   f"{SCHED_GOAL_S:g} s goal: {ok}; Slurm calls per refresh: {calls}")
    return out


def status_cost(log_dir: Path, reps: int = 3) -> dict:
    """``ddp-hpc status JOB`` (the detail view) of the run in ``log_dir``, in this process, as
    this bench times it (a job record pointing at the directory, no scheduler asked): the
    least CPU and wall seconds of ``reps`` runs after a first one."""
    import pollcost  # bench/pollcost.py, beside this file
    start = pollcost._start_event(log_dir)
    home = Path(tempfile.mkdtemp(prefix="ddp_hpc_pollcost-home-"))
    try:
        write_record(home, pollcost.JOB_ID, log_dir, start["num_nodes"], time.time() - 3600)
        with status_home(home):
            text = run_status([pollcost.JOB_ID])
            cpu, wall = [], []
            for _ in range(reps):
                c, w = _cpu_s(), time.perf_counter()
                run_status([pollcost.JOB_ID])
                cpu.append(_cpu_s() - c)
                wall.append(time.perf_counter() - w)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return {"cpu_s": min(cpu), "wall_s": min(wall), "lines": len(text.splitlines())}


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a.startswith(("--make-run", "--poll")) for a in argv):
        import pollcost  # bench/pollcost.py, beside this file
        return pollcost.main(argv, status_cost=status_cost)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES} only (a smoke run)")
    p.add_argument("--sizes", type=lambda s: tuple(int(x) for x in s.split(",")),
                   help=f"ranks per job, multiples of {PER_NODE} (default {','.join(map(str, SIZES))})")
    p.add_argument("--events", type=int, default=2000, help="events per rank in the status section")
    p.add_argument("--json", metavar="PATH", help="also write the rows and the verdict as JSON")
    p.add_argument("--only", type=lambda s: frozenset(s.split(",")), default=frozenset(PARTS),
                   help=f"run only these parts, comma-separated (of {','.join(PARTS)}; default all)")
    p.add_argument("--workdir", help="where the synthetic logs and records go (default: a temporary directory)")
    p.add_argument("--layout", choices=("node", "rank"), default="node",
                   help="the jobs' event files: one per node (this version, default) or one per rank (earlier)")
    args = p.parse_args(argv)
    LAYOUT[0] = args.layout
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    if args.only - set(PARTS):
        p.error(f"--only: {','.join(sorted(args.only - set(PARTS)))} is not one of {','.join(PARTS)}")
    if any(n % PER_NODE for n in sizes):
        p.error(f"--sizes: every size must be a multiple of {PER_NODE}")
    table_sizes = tuple(n for n in TABLE_SIZES if n <= 64) if args.quick else TABLE_SIZES
    events = min(args.events, 100) if args.quick else args.events
    work = Path(tempfile.mkdtemp(prefix="ddp_hpc_scale-", dir=args.workdir))
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        rows = measure(sizes, table_sizes, events, work, log, QUICK_SCHED if args.quick else SCHED_SIZES, args.only)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = summarize(rows)
    print(f"bench/scale.py: {PER_NODE} ranks per node, {events} events per rank, sizes {sizes}, "
          f"event files per {args.layout}")
    sys.stdout.write(render(rows, summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary, "events": events}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
