"""A restart inside the allocation restores from a surviving node's memory (train/memsnap.py,
train/restore.py) on the real test cluster: a 2x1 job with a spare node snapshots every step, the
node of rank 1 dies, and the restarted ranks go on from the newest snapshot (rank 0's node held it
in memory, the spare got it over the process group) with at most one step trained again; status
names where the state came from. One rank a node (each rank process costs ~2 s of CPU to import
torch): both sources, memory and peer, are still there. Runs in the partition ``spare`` like the other restart tests.
The job's snapshots also free those an ended job of this cluster left in /dev/shm (squeue asked
from inside the job: train/memsweep.py), and keep another cluster's."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest

from ddp_hpc.data.stagedir import private_root
from ddp_hpc.judge.restarts import read_restarts
from ddp_hpc.train.memsnap import user_prefix
from ddp_hpc.train.memsweep import JOB_FILE, job_file_text

from .script_helpers import wait_for
from .test_restart_cluster import FAST, REPO, _events, _finish, _stepping, _submit

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("spare")]


def test_a_dead_node_restores_from_a_surviving_nodes_memory_with_at_most_one_step_redone(slurm_cluster):
    """Only test of a restore from node memory after a real node loss, and of the snapshot sweep
    asking squeue from inside a job."""
    c = slurm_cluster
    c.need_node_failure()
    d = c.shared_dir / f"memsnap-{time.monotonic_ns()}"
    d.mkdir()
    files_every = [o.replace("checkpoint.every_steps=3", "checkpoint.every_steps=1000") for o in FAST]
    # left behind in /dev/shm: a job of this cluster that ended (id 1: below this cluster's first
    # id) and one of another cluster with the same id
    ended, other = (_left_behind(f"1-{tag}", c.cluster_name if tag == "ended" else "elsewhere")
                    for tag in ("ended", "other"))
    job, _, env = _submit(c, d, "-G", "1", "-N", "2", "--spare-nodes", "1", "--max-restarts", "1",
                          "-J", "memsnap", str(REPO / "jobs" / "demo.yaml"), "--", f"log.dir={d / 'runs'}",
                          *files_every, "checkpoint.memory_every_steps=1")
    log_dir = wait_for("the log directory", lambda: next((d / "runs").glob("memsnap-*"), None), 60)
    starts0 = wait_for("steps of the first run", lambda: _stepping(log_dir, 0, 2, 5), 180)
    dead, kept = starts0[1]["host"], starts0[0]["host"]
    try:
        c.fail_node(dead)
        wait_for("steps after the restart on the spare", lambda: _stepping(log_dir, 1, 2), 120)
    finally:
        c.revive_node(dead)
    state, status, _ = _finish(c, job, env)
    try:
        assert not ended.exists(), "the ended job's memory snapshots were not freed"
        assert other.exists(), "another cluster's job's memory snapshots were freed"
    finally:
        shutil.rmtree(ended, ignore_errors=True)
        shutil.rmtree(other, ignore_errors=True)
    # a step's event is written with the next step's (its numbers are all-reduced in the background),
    # so the last step trained before the fault is the newest step event, or one past it
    last = max(e["step"] for r in range(2) for e in _events(log_dir, r, 0) if e["event"] == "step")
    restored = {r: next(e for e in _events(log_dir, r, 1) if e["event"] == "restored") for r in range(2)}
    print(f"last step before the fault {last}; restored {restored}\n{status}")
    assert state == "COMPLETED", status
    assert read_restarts(log_dir)[0]["excluded"] == [dead]
    step = restored[0]["step"]
    assert {e["step"] for e in restored.values()} == {step} and {e["node"] for e in restored.values()} == {kept}
    assert [restored[r]["source"] for r in range(2)] == ["memory", "peer"], restored
    assert -1 <= last - step <= 1, (last, step)              # steps trained twice: 0 or 1
    line = f"restored step {step} from {kept}'s memory ({dead} was lost)"
    assert re.search(re.escape(line) + r", \d+\.\d s", (log_dir / "rank0.log").read_text())
    assert f"    state: {line}" in status, status


def _left_behind(name: str, cluster: str) -> Path:
    folder = Path(private_root("/dev/shm")) / f"{user_prefix()}{name}"
    (folder / "n1").mkdir(parents=True)
    (folder / "n1" / "ckpt-000000001.pt").write_bytes(b"0" * 1024)
    (folder / JOB_FILE).write_text(job_file_text("1", cluster))
    return folder
