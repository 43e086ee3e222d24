"""Memory snapshots left by jobs that ended without a clean end are freed when a later run's
snapshots start on the node (train/memsweep.py): real folders, real processes carrying a local
job's id, a real MemSnapshots. The Slurm side (squeue's answer) runs on the test cluster:
tests/cluster/test_memsnap_cluster.py."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch

from ddp_hpc.train.memsnap import MemSnapshots, NodeStore, user_prefix
from ddp_hpc.train.memsweep import JOB_FILE, LOCAL_IDLE_S, job_file_text, stale, sweep

PREFIX = "ddp_hpc-memsnap-u-"


def _job(root: Path, name: str, key: str | None = None, cluster: str = "c1", age_s: float = 0.0,
         prefix: str = PREFIX) -> Path:
    """A job folder with one node's snapshot file, written ``age_s`` ago."""
    folder = root / f"{prefix}{name}"
    (folder / "n1").mkdir(parents=True)
    (folder / "n1" / "ckpt-000000007.pt").write_bytes(b"x" * 4096)
    if key is not None:
        (folder / JOB_FILE).write_text(job_file_text(key, cluster))
    if age_s:
        then = time.time() - age_s
        for p in (folder, *folder.rglob("*")):
            os.utime(p, (then, then))
    return folder


def test_only_ended_jobs_of_this_cluster_are_stale(tmp_path):
    old = LOCAL_IDLE_S + 60
    by_name = _job(tmp_path, "12-0123456789")                    # no .job: its name is a Slurm key
    running = _job(tmp_path, "13", "13")
    other_cluster = _job(tmp_path, "14", "14", cluster="c2")
    ended = _job(tmp_path, "15_3", "15_3")
    # local job ids of their own: any process on the machine that carries one keeps its folder
    # (tests/test_integrations.py runs a process with DDP_HPC_JOB_ID=local-a beside this one)
    a, b, c = (f"local-{uuid.uuid4().hex[:8]}" for _ in range(3))
    local_ended = _job(tmp_path, a, a, cluster="", age_s=old)
    local_running = _job(tmp_path, b, b, cluster="", age_s=old)
    local_recent = _job(tmp_path, c, c, cluster="")
    unknown = _job(tmp_path, "whatever")                         # no .job, not a Slurm key
    folders = [by_name, running, other_cluster, ended, local_ended, local_running, local_recent, unknown]
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, "DDP_HPC_JOB_ID": b})
    try:
        asked = []

        def live():
            asked.append(1)
            return {"13", "99"}
        assert sorted(stale(folders, PREFIX, live, "c1")) == sorted([by_name, ended, local_ended])
        assert asked == [1]                                      # squeue asked once
        # squeue did not answer: no Slurm job is called ended; local ones are judged as before
        assert stale(folders, PREFIX, lambda: None, "c1") == [local_ended]
    finally:
        proc.kill()
        proc.wait()
    assert stale(folders, PREFIX, live, "c1") == sorted([by_name, ended, local_ended, local_running],
                                                        key=folders.index)


def test_sweep_removes_the_stale_folders_names_what_it_freed_and_keeps_its_own(tmp_path):
    own = _job(tmp_path, "local-own", "local-own", cluster="", age_s=LOCAL_IDLE_S + 60)
    gone = _job(tmp_path, "local-gone", "local-gone", cluster="", age_s=LOCAL_IDLE_S + 60)
    kept = _job(tmp_path, "local-fresh", "local-fresh", cluster="")
    stranger = _job(tmp_path, "x", "local-x", cluster="", age_s=LOCAL_IDLE_S + 60, prefix="someone-else-")
    notes = []
    assert sweep(tmp_path, PREFIX, own, "u", note=notes.append) == [gone]
    assert not gone.exists() and own.exists() and kept.exists() and stranger.exists()
    assert notes == [f"memory snapshots: freed 0.0 MiB in {tmp_path} left by ended jobs (local-gone)"]


def test_a_new_runs_snapshots_free_an_ended_jobs_and_its_clean_end_leaves_nothing(tmp_path):
    prefix = user_prefix()
    ended = _job(tmp_path, "local-ended", "local-ended", cluster="", age_s=LOCAL_IDLE_S + 60, prefix=prefix)
    store = NodeStore(tmp_path / f"{prefix}local-now" / "n1", "n1", job="local-now")
    notes = []
    snaps = MemSnapshots(store, rank=0, local_rank=0, every=1, device=torch.device("cpu"),
                         distributed=False, warn=notes.append)
    store.sweep_ended_jobs(notes.append).join(30)      # what restore.node_store calls on local rank 0
    assert not ended.exists(), notes
    assert [n for n in notes if "local-ended" in n], notes
    assert (store.folder.parent / JOB_FILE).read_text() == job_file_text("local-now", "")
    model = torch.nn.Linear(3, 2)
    snaps.after_step(1, lambda: {"model": model.state_dict(), "optimizer": None})
    snaps.wait()
    assert store.newest()[0] == 1
    snaps.finish()
    assert list(tmp_path.iterdir()) == []          # the job folder went with its .job file


# a stand-in squeue as Slurm answers within MinJobAge of a `scontrol requeue`: the requeued job 21
# (pending again under its id) and the held or suspended ones are listed only with --states=all,
# as is job 22 that ended; 23 ended long ago (listed nowhere); 26's state is one this code does
# not know. FAKE_SQUEUE_FAIL makes it fail as a controller that does not answer.
SQUEUE = """
import os, sys
if os.environ.get("FAKE_SQUEUE_FAIL"):
    sys.exit("squeue: error: slurm_load_jobs error: Unable to contact slurm controller")
if "--states=all" not in sys.argv and "-t" not in sys.argv:
    sys.exit(0)
SEP = "\\x1f"
for job, state in (("21", "PENDING"), ("22", "COMPLETED"), ("24", "REQUEUE_HOLD"), ("25", "SUSPENDED"),
                   ("26", "SOME_NEW_STATE"), ("27", "REQUEUED")):
    row = [job, job, job, "N/A", state] + ["x"] * 12
    print(SEP.join(row) + SEP)
"""


def _fake_squeue(tmp_path, monkeypatch, fail: bool = False) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "squeue").write_text(f"#!{sys.executable}\n{SQUEUE}")
    (bindir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    if fail:
        monkeypatch.setenv("FAKE_SQUEUE_FAIL", "1")


def test_the_sweep_keeps_a_requeued_held_or_suspended_jobs_snapshots(tmp_path, monkeypatch):
    """Issue 38, bug 10: the default squeue leaves out a job requeued within MinJobAge; the sweep
    asks for every state and frees only a job in a final state or no longer listed."""
    _fake_squeue(tmp_path, monkeypatch)
    root = tmp_path / "shm"
    root.mkdir()
    folders = {j: _job(root, j, j, cluster="") for j in ("21", "22", "23", "24", "25", "26", "27")}
    own = _job(root, "30", "30", cluster="")
    notes = []
    gone = sweep(root, PREFIX, own, "u", note=notes.append)
    assert sorted(gone) == [folders["22"], folders["23"]], notes
    assert all(folders[j].exists() for j in ("21", "24", "25", "26", "27")) and own.exists()
    assert notes == [f"memory snapshots: freed 0.0 MiB in {root} left by ended jobs (22, 23)"]


def test_the_sweep_keeps_every_slurm_jobs_snapshots_when_squeue_does_not_answer(tmp_path, monkeypatch):
    _fake_squeue(tmp_path, monkeypatch, fail=True)
    root = tmp_path / "shm"
    root.mkdir()
    folders = [_job(root, j, j, cluster="") for j in ("22", "23")]
    assert sweep(root, PREFIX, root / "own", "u") == []
    assert all(f.exists() for f in folders)


def test_what_a_sweep_freed_is_a_status_line_of_the_run(tmp_path):
    """The sweep deletes files: what it freed is a ``memsnap`` event of status ``swept`` in the
    run log (next to the log line), and the detail view's notes say it in one line."""
    from ddp_hpc.judge.reader import RunLogs
    from ddp_hpc.runlogs.writer import RunLog
    from ddp_hpc.status.snapshots import snapshot_notes
    from ddp_hpc.train.restore import _told

    text = "memory snapshots: freed 0.1 MiB in /dev/shm/ddp_hpc-0 left by ended jobs (15_3)"
    heard = []
    log = RunLog(tmp_path, 0, job_id="77", restart=0, console=False)
    try:
        _told(heard.append, log.warning)(text)
    finally:
        log.close()
    assert heard == [text]
    assert snapshot_notes(RunLogs(tmp_path)) == [text]
