"""Restarts inside the allocation (ddp_hpc.supervise) on the real test cluster: the three faults
(a dead node, a SIGKILLed rank, a SIGSTOPped rank) healed inside one job id, with a spare node and
without, for ddp_hpc's own loop and for a plain script, which goes on with fewer nodes
(--min-nodes) and resumes from its own checkpoint. Each test checks the job completed without a
requeue (Slurm's restart count stays 0), what restarts.jsonl says and what status shows.

Both jobs run in the test cluster's partition ``spare`` (3 nodes of its own), like the node
failure test: the node they kill runs nothing of the other tests. So does the job whose node an
admin drains: a drain is no fault, the job trains on, on the same nodes, with no restart.

Every job is 2 nodes x 1 task: each rank process pays ~2 s of CPU to import torch before it does
anything, and none of these assertions needs two ranks on one node (a killed rank, a hang and a
lost node are the same faults with one rank a node)."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from ddp_hpc import records
from ddp_hpc.judge.nodefiles import rank_events
from ddp_hpc.judge.restarts import read_restarts, read_stops
from ddp_hpc.supervise.watch import FAILED_GRACE_S

from .script_helpers import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("spare2")]

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
FAST = ["data.dataset=tests.cluster.status_helpers:slow_synthetic", "data.kwargs.delay=0.004",
        "data.kwargs.size=8192", "log.every_n_steps=1", "train.epochs=1", "data.eval_split=0.0",
        "checkpoint.every_steps=3", "train.collective_timeout_s=20", "schedule.warmup_steps=0"]


def _events(log_dir: Path, rank: int, restart: int) -> list[dict]:
    return [e for e in rank_events(log_dir, rank).events if e.get("restart") == restart]


def _stepping(log_dir: Path, restart: int, ranks: int, steps: int = 2) -> dict[int, dict] | None:
    """Each rank's start event of run ``restart`` once every rank reported ``steps`` steps."""
    starts = {}
    for r in range(ranks):
        evs = _events(log_dir, r, restart)
        if sum(e["event"] == "step" for e in evs) < steps:
            return None
        starts[r] = next(e for e in evs if e["event"] == "start")
    return starts


def _submit(c, d: Path, *args: str, **more_env: str) -> tuple[str, Path, dict]:
    env = dict(c.env, DDP_HPC_HOME=str(d / "home"), PYTHONPATH=str(REPO), **more_env)
    p = c.run([PY, "-m", "ddp_hpc.submit", "--backend", "sbatch", "-p", c.spare_partition, "-t", "10",
               *args], cwd=str(d), env=env)
    assert p.returncode == 0, p.stderr
    return p.stdout.split()[-1], d, env


def _finish(c, job: str, env: dict) -> tuple[str, str, str]:
    state = c.wait(job, timeout=300)
    status = c.run([PY, "-m", "ddp_hpc.status", job], cwd="/", env=env, timeout=120).stdout
    shown = c.run(["scontrol", "show", "job", "-o", job], timeout=30).stdout
    return state, status, shown


def test_dead_node_and_hang_are_healed_in_one_job_on_a_spare(slurm_cluster):
    """Only test of two different faults healed one after the other in one job id, the first
    on the spare node, with the restart rows, the record and status agreeing. With one rank a
    node srun's report of the stopped rank's kill ("task 1: Killed", the supervisor's own
    ``scancel --signal=KILL``) can come first: the frozen rank must still be called stuck."""
    c = slurm_cluster
    c.need_node_failure()
    d = c.shared_dir / f"restart-spare-{time.monotonic_ns()}"
    d.mkdir()
    job, _, env = _submit(c, d, "-G", "1", "-N", "2", "--spare-nodes", "1", "--max-restarts", "2",
                          "-J", "rs-spare", str(REPO / "jobs" / "demo.yaml"), "--",
                          f"log.dir={d / 'runs'}", *FAST)
    log_dir = wait_for("the log directory", lambda: next((d / "runs").glob("rs-spare-*"), None), 60)
    starts0 = wait_for("steps of the first run", lambda: _stepping(log_dir, 0, 2, 4), 180)
    dead = starts0[1]["host"]
    t0 = time.time()
    try:
        c.fail_node(dead)
        starts1 = wait_for("steps after the restart on the spare", lambda: _stepping(log_dir, 1, 2), 120)
    finally:
        c.revive_node(dead)
    t1 = time.time()
    os.kill(int(starts1[1]["pid"]), signal.SIGSTOP)          # rank 1 hangs; its peer times out
    starts2 = wait_for("steps after the hang", lambda: _stepping(log_dir, 2, 2), 150)
    state, status, shown = _finish(c, job, env)
    rows = read_restarts(log_dir)
    print(f"node {dead} killed at {t0:.0f}, rank 1 stopped at {t1:.0f}\n{json.dumps(rows, indent=1)}\n{status}")
    assert state == "COMPLETED", status
    assert re.search(r"\bRestarts=0\b", shown), shown                       # no requeue: one job
    assert [r["restart"] for r in rows] == [1, 2] and {r["job_id"] for r in rows} == {job}
    assert rows[0]["excluded"] == [dead] and dead not in {s["host"] for s in starts1.values()}
    assert rows[0]["world_before"] == rows[0]["world_after"] == 2 and rows[0]["node"] == dead
    # the SIGSTOPped rank went silent while its peers timed out waiting for it: stuck, its peers victims
    assert rows[1]["rank"] == 1 and rows[1]["kind"] == "stuck", rows[1]
    assert rows[1]["trigger"] in ("rank failed", "exited") and rows[1]["stop"] == (
        None if rows[1]["trigger"] == "exited" else
        f"a rank lost a peer and srun had not ended the step {FAILED_GRACE_S:g} s later"), rows[1]
    assert len({s["host"] for s in starts2.values()}) == 2
    assert re.search(r"resumed from \S+ckpt-\d+\.pt at step [1-9]", (log_dir / "rank0.log").read_text())
    assert "Restarts inside the allocation: 2" in status and f"excluded {dead}" in status, status
    rec = records.load_record(job, environ={"DDP_HPC_HOME": env["DDP_HPC_HOME"]})
    assert [r["restart"] for r in rec.alloc_restarts] == [1, 2]          # the record keeps them


def test_plain_script_killed_rank_then_dead_node_goes_on_with_fewer_nodes(slurm_cluster):
    """Only test of a plain script (its own checkpoints) restarted in place, then going on with
    fewer nodes (--min-nodes) and a smaller world after a node is lost with no spare."""
    c = slurm_cluster
    c.need_node_failure()
    d = c.shared_dir / f"restart-script-{time.monotonic_ns()}"
    d.mkdir()
    ckpt = d / "ckpt"
    job, _, env = _submit(c, d, "-G", "1", "-N", "2", "--max-restarts", "2", "--min-nodes", "1", "-J", "rs-script",
                          str(REPO / "examples" / "preemptible.py"), "--steps", "100", "--sleep", "0.1",
                          "--ckpt-every", "5", "--ckpt-dir", str(ckpt))
    log_dir = wait_for("the log directory", lambda: next((d / "runs").glob("rs-script-*"), None), 60)
    starts0 = wait_for("steps of the first run", lambda: _stepping(log_dir, 0, 2), 180)
    os.kill(int(starts0[1]["pid"]), signal.SIGKILL)          # rank 1's script dies
    starts1 = wait_for("steps after the first restart", lambda: _stepping(log_dir, 1, 2), 120)
    dead = starts1[1]["host"]
    try:
        c.fail_node(dead)
        wait_for("steps on one node", lambda: _stepping(log_dir, 2, 1), 120)
    finally:
        c.revive_node(dead)
    state, status, shown = _finish(c, job, env)
    rows = read_restarts(log_dir)
    out0 = (log_dir / "rank0.out").read_text()
    print(f"{json.dumps(rows, indent=1)}\n{status}\n{out0[-800:]}")
    assert state == "COMPLETED", status
    assert re.search(r"\bRestarts=0\b", shown), shown
    assert [(r["world_before"], r["world_after"]) for r in rows] == [(2, 2), (2, 1)], rows
    assert rows[0]["rank"] == 1 and rows[0]["kind"] == "killed" and rows[0]["excluded"] == []
    assert rows[1]["excluded"] == [dead]
    m = re.search(r"preemptible: 1 ranks, 100 steps \(resumed from step (\d+)\)", out0)
    assert m and int(m.group(1)) >= 5, out0[-800:]
    assert "Restarts inside the allocation: 2" in status, status


def _node_list(c, job: str) -> str:
    shown = c.run(["scontrol", "show", "job", "-o", job], timeout=30).stdout
    m = re.search(r"\bNodeList=(\S+)", shown)
    return m.group(1) if m else ""


def _newest_steps(log_dir: Path, ranks: int) -> dict[int, int]:
    return {r: max([e["step"] for e in _events(log_dir, r, 0) if e["event"] == "step"], default=0)
            for r in range(ranks)}


def test_a_drained_node_does_not_stop_a_supervised_job(slurm_cluster):
    """An admin drains the node of rank 1 under a running 2x1 job (supervised by default,
    --max-restarts 2, no spare): Slurm lets the job run on, and so does the supervisor. 40 s later
    (the default hang limit's 30 s floor and a dozen of the supervisor's node polls, 3 s apart)
    the same run still trains on the same nodes, with no restart and no stop. Only test that a
    drain (no fault) is left alone."""
    c = slurm_cluster
    d = c.shared_dir / f"restart-drain-{time.monotonic_ns()}"
    d.mkdir()
    slow = [o.replace("data.kwargs.delay=0.004", "data.kwargs.delay=0.01").replace("train.epochs=1", "train.epochs=20")
            for o in FAST]
    job, _, env = _submit(c, d, "-G", "1", "-N", "2", "-J", "rs-drain", str(REPO / "jobs" / "demo.yaml"), "--",
                          f"log.dir={d / 'runs'}", *slow)
    log_dir = wait_for("the log directory", lambda: next((d / "runs").glob("rs-drain-*"), None), 60)
    drained = None
    try:
        starts = wait_for("steps of the first run", lambda: _stepping(log_dir, 0, 2, 3), 180)
        drained = starts[1]["host"]
        nodes = _node_list(c, job)
        p = c.run(["scontrol", "update", f"nodename={drained}", "state=drain", "reason=ddp_hpc drain test"])
        assert p.returncode == 0, p.stderr
        at_drain = _newest_steps(log_dir, 2)
        time.sleep(40)
        state = c.run(["squeue", "-h", "-j", job, "-o", "%T"], timeout=30).stdout.strip()
        sinfo = c.run(["sinfo", "-h", "-N", "-n", drained, "-o", "%T"], timeout=30).stdout.strip()
        status = c.run([PY, "-m", "ddp_hpc.status", job], cwd="/", env=env, timeout=120).stdout
        later = _newest_steps(log_dir, 2)
        print(f"drained {drained} ({sinfo}); steps {at_drain} -> {later}\n{status}")
        assert sinfo.startswith("drain"), sinfo                         # Slurm took the drain
        assert state == "RUNNING", (state, status)
        assert all(later[r] > at_drain[r] for r in range(2)), (at_drain, later)   # every rank trains on
        assert read_restarts(log_dir) == [] and read_stops(log_dir) == []
        assert not any(_events(log_dir, r, 1) for r in range(2))        # no second run
        assert _node_list(c, job) == nodes
        assert "Supervisor: stopped" not in status and "Restarts inside the allocation" not in status, status
    finally:
        if drained:
            c.run(["scontrol", "update", f"nodename={drained}", "state=resume"])
        c.run(["scancel", job])


def _ready(log_dir: Path) -> int:
    """How many standby ranks said they are ready (standby.out)."""
    try:
        return (log_dir / "standby.out").read_text().count(" ready in ")
    except OSError:
        return 0


def _rendezvous(log_dir: Path, restart: int, ranks: int) -> list[dict]:
    return [next(e for e in _events(log_dir, r, restart) if e["event"] == "rendezvous") for r in range(ranks)]


def test_killed_ranks_restart_from_the_warm_standby_and_srun_still_names_the_rank(slurm_cluster):
    """Two killed ranks in one job with a spare: each restart hands the warm standby (ranks that
    imported torch before the fault) the new step. The second kill hits a rank the standby knew
    as another task number (its task 2 on the spare became rank 1): srun's report, relayed by the
    supervisor, still names rank 1, and so does the judgement. Only test of the warm standby on
    real Slurm steps."""
    c = slurm_cluster
    d = c.shared_dir / f"restart-warm-{time.monotonic_ns()}"
    d.mkdir()
    job, _, env = _submit(c, d, "-G", "1", "-N", "2", "--spare-nodes", "1", "--max-restarts", "2",
                          "--warm-standby", "-J", "rs-warm", str(REPO / "jobs" / "demo.yaml"), "--",
                          f"log.dir={d / 'runs'}", *FAST, "data.kwargs.size=65536",
                          # slow until the test has seen both restarts: a loaded machine's standby
                          # took 25 s to be ready, and the job had ended before its second one was
                          f"data.kwargs.until={d / 'go'}",
                          # CI runs the unit tests beside: a standby at nice 19 would wait for them
                          DDP_HPC_STANDBY_NICE="0")
    log_dir = wait_for("the log directory", lambda: next((d / "runs").glob("rs-warm-*"), None), 60)
    try:
        starts0 = wait_for("steps of the first run", lambda: _stepping(log_dir, 0, 2, 4), 180)
        wait_for("the standby's 3 ranks", lambda: _ready(log_dir) >= 3, 240)
        os.kill(int(starts0[1]["pid"]), signal.SIGKILL)
        starts1 = wait_for("steps after the first restart", lambda: _stepping(log_dir, 1, 2), 120)
        wait_for("the second standby's 2 ranks", lambda: _ready(log_dir) >= 5, 240)
        os.kill(int(starts1[1]["pid"]), signal.SIGKILL)
        wait_for("steps after the second restart", lambda: _stepping(log_dir, 2, 2), 120)
        (d / "go").touch()
    except BaseException:
        # every rank's output and last events: which rank's report the supervisor blamed, and why
        for name in ("slurm-*.out", "standby.out", "restarts.jsonl", "rank*.out", "rank*.events.jsonl",
                     "node*.events.jsonl"):
            for p in sorted(log_dir.glob(name)):
                print(f"--- {p.name}\n{p.read_text()[-4000:]}")
        c.run(["scancel", job], timeout=30)     # not the partition held until its time limit
        raise
    state, status, shown = _finish(c, job, env)
    rows = read_restarts(log_dir)
    batch = "".join(p.read_text() for p in log_dir.glob("slurm-*.out"))
    print(f"{json.dumps(rows, indent=1)}\n{status}\n{batch[-3000:]}")
    assert state == "COMPLETED", status
    assert re.search(r"\bRestarts=0\b", shown), shown
    assert [r["restart"] for r in rows] == [1, 2]
    for row in rows:
        assert (row["rank"], row["kind"], row["basis"]) == (1, "killed", "srun exit report"), row
    spare = rows[0]["nodes_after"][1]
    assert starts1[1]["host"] == spare and spare not in rows[0]["nodes_before"]
    assert f"srun: error: {spare}: task 1: Killed" in batch      # the standby's task 2, renumbered
    for restart in (1, 2):
        assert all(e["warm"] for e in _rendezvous(log_dir, restart, 2)), restart
    assert "warm standby not used" not in batch
    assert re.search(r"restart 2: [\d.]+ s = detect", status), status
