"""A job of ours leaves its nodes within Slurm's KillWait, whatever it was doing: requeued by
``scontrol requeue`` while a checkpoint file is being written, then cancelled by ``scancel`` while
a memory snapshot is being written. Every process of the job (the supervisor, srun, the ranks,
their async writer and snapshot threads) is gone by KillWait (SIGTERM, then SIGKILL after
``KillWait`` seconds), so no slurmstepd reports "Kill task failed" and no node is drained: a step
that outlives SIGKILL by UnkillableStepTimeout drains its node on a real cluster too, and the next
job of every user waits for an admin.

The state is ~100 MB (an MLP of 2048 wide, SGD with momentum), written to a file every 2 steps in
the background and to /dev/shm every step, so a write is in flight almost all the time; the test
waits until it sees one (a temporary file in the checkpoint folder, in the snapshot folder)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from ddp_hpc.data.stagedir import private_root
from ddp_hpc.testcluster.health import node_states
from ddp_hpc.train.memsnap import user_prefix

from .script_helpers import wait_for
from .test_restart_cluster import FAST, REPO, _stepping, _submit

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("spare")]

BIG = ["model.kwargs.hidden=2048", "model.kwargs.depth=4", "checkpoint.every_steps=2",
       "checkpoint.memory_every_steps=1", "checkpoint.keep_last=2"]
KILL_WAIT_S = 10      # the test cluster's slurm.conf (ddp_hpc/testcluster/spec.py)
SIGKILL_GRACE_S = 15  # SIGKILL's delivery and the exit of processes of ~1 GB on a busy machine


def _job_pids(job: str) -> dict[int, str]:
    """The processes whose environment says they belong to ``job`` (every node of the test
    cluster is this machine, so /proc shows them all), with their command lines."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            if f"SLURM_JOB_ID={job}".encode() in env:
                found[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
        except OSError:          # gone meanwhile, or a kernel thread
            continue
    return found


def _gone_after(job: str, signalled_at: float) -> dict[int, tuple[str, float]]:
    """Poll until no process of ``job`` is left (or KillWait + the grace has passed); each process
    seen, with how long after the signal it was last seen."""
    seen: dict[int, tuple[str, float]] = {}
    while True:
        now = time.monotonic() - signalled_at
        alive = _job_pids(job)
        for pid, cmd in alive.items():
            seen[pid] = (cmd, now)
        if not alive or now > KILL_WAIT_S + SIGKILL_GRACE_S:
            return seen
        time.sleep(0.2)


def _drained(c) -> dict[str, str]:
    """Nodes of the job's partition that are drained or failing (other partitions' tests drain
    nodes of their own on purpose)."""
    return {n: s for n, s in node_states(c._spec).items()
            if n in c.spare_nodes and ("drain" in s or "fail" in s)}


def _stepd_gave_up(c, job: str) -> list[str]:
    lines = []
    for log in c.log_dir.glob("slurmd-*.log"):
        lines += [ln for ln in log.read_text(errors="replace").splitlines()
                  if "NOT ENDING WITH SIGNALS" in ln and re.search(rf"\b{job}\b", ln)]
    return lines


def _assert_left_in_time(c, job: str, what: str, signalled_at: float) -> None:
    seen = _gone_after(job, signalled_at)
    late = {pid: v for pid, v in seen.items() if v[1] > KILL_WAIT_S + 2}
    left = _job_pids(job)
    report = "\n".join(f"  pid {pid}: last seen {t:.1f} s after: {cmd}" for pid, (cmd, t) in sorted(seen.items()))
    print(f"job {job}, {what}: {len(seen)} process(es) of the job seen after the signal\n{report}")
    assert not left, f"{what}: processes of job {job} outlived KillWait and SIGKILL:\n{report}"
    assert not late, f"{what}: processes of job {job} needed SIGKILL (alive after KillWait):\n{report}"


def test_a_job_requeued_mid_save_and_cancelled_mid_snapshot_leaves_its_nodes_within_killwait(slurm_cluster):
    c = slurm_cluster
    d = c.shared_dir / f"kill-{time.monotonic_ns()}"
    d.mkdir()
    ckpt = d / "ckpt"
    job, _, env = _submit(c, d, "-G", "2", "-N", "2", "--max-restarts", "0", "-J", "killwait",
                          str(REPO / "jobs" / "demo.yaml"), "--", f"log.dir={d / 'runs'}",
                          f"checkpoint.dir={ckpt}", *FAST, *BIG)
    try:
        log_dir = wait_for("the log directory", lambda: next((d / "runs").glob("killwait-*"), None), 90)
        wait_for("steps of the first run", lambda: _stepping(log_dir, 0, 4, 3), 240)
        assert not _drained(c), _drained(c)

        # 1. scontrol requeue while a checkpoint file is being written (its temporary file exists)
        wait_for("a checkpoint being written", lambda: any(ckpt.glob(".*.tmp")), 120, every=0.05)
        t0 = time.monotonic()
        p = c.run(["scontrol", "requeue", job])
        assert p.returncode == 0, p.stderr
        _assert_left_in_time(c, job, "requeued mid-save", t0)

        # 2. the requeued job starts again; scancel while a memory snapshot is being written
        wait_for("steps of the requeued run", lambda: _stepping(log_dir, 0, 4, 3) and
                 _job_pids(job) and any(Path(private_root("/dev/shm")).glob(f"{user_prefix()}{job}*/*/.memsnap-tmp-*")),
                 300, every=0.05)
        t1 = time.monotonic()
        p = c.run(["scancel", job])
        assert p.returncode == 0, p.stderr
        _assert_left_in_time(c, job, "cancelled mid-snapshot", t1)
    finally:
        c.run(["scancel", job])

    time.sleep(2)   # a node is drained when its slurmd gives up on the step; give it the moment to say so
    assert not _stepd_gave_up(c, job), _stepd_gave_up(c, job)
    assert not _drained(c), f"nodes drained after the job: {_drained(c)}"
