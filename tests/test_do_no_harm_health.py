"""Issue 38, bug 5: the health check excludes a node only for what this job will really put on it.
Which folders apply to a job is a pure decision (`nodecheck.path_checks`), tested here directly;
then the check as a process, on real folders, for a job without snapshots or staged data whose
scratch looks full; then the supervisor's rule for a volatile ECC counter (only growth between two
checks excludes). The whole chain through a stand-in srun: tests/test_supervise_health.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

from ddp_hpc.supervise import nodecheck
from ddp_hpc.supervise.health import ecc_problems, job_needs
from ddp_hpc.supervise.nodecheck import PathCheck

REPO = Path(__file__).resolve().parents[1]


# -- which folders apply to this job -------------------------------------------------------------

def test_a_job_that_writes_nothing_node_local_has_no_folder_checked(tmp_path):
    """Neither scratch nor /dev/shm is checked for a job that does not use them: a diskless node
    or a 1 MB tmpfs /tmp is no reason to exclude a node of such a job."""
    env = {"TMPDIR": str(tmp_path), "SLURM_TMPDIR": str(tmp_path)}
    assert nodecheck.path_checks(env) == []


def test_the_checkpoint_folder_is_shared_a_snapshot_store_a_note_staged_data_the_nodes(tmp_path):
    env = {"TMPDIR": str(tmp_path / "scratch")}
    (tmp_path / "scratch").mkdir()
    # the checkpoint folder is on the shared filesystem: its problem is nobody's node's fault
    assert nodecheck.path_checks(env, ckpt_dirs=["/shared/ck"], ckpt_bytes=500) == [
        PathCheck("/shared/ck", 500, "a checkpoint", "shared")]
    # memory snapshots go where memsnap puts them; one that does not fit steps back: a note
    [snap] = nodecheck.path_checks(env, snapshot_bytes=700)
    assert snap == PathCheck(nodecheck.snapshot_base(env), 700, "a memory snapshot", "note")
    from ddp_hpc.train.memsnap import job_folder
    assert str(job_folder("7", env)).startswith(snap.path + os.sep)
    # staged data that is not on this node yet needs room in the nearest folder that exists
    mine = tmp_path / "scratch" / f"ddp_hpc-{os.getuid()}"
    stage = [(300, str(mine / "ddp_hpc-stage-7-a")), (400, str(mine / "ddp_hpc-stage-7-b"))]
    assert nodecheck.path_checks(env, stage=stage) == [
        PathCheck(str(tmp_path / "scratch"), 700, "the staged data", "node")]
    # already staged here (a restart on the same node): nothing more to hold
    (mine / "ddp_hpc-stage-7-a").mkdir(parents=True)
    assert nodecheck.path_checks(env, stage=stage) == [PathCheck(str(mine), 400, "the staged data", "node")]


# -- the check as a process ----------------------------------------------------------------------

def _task_env(tmpdir: str) -> dict:
    return {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), "SLURM_JOB_ID": "7", "SLURM_PROCID": "0",
            "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NNODES": "1",
            "SLURM_JOB_NODELIST": "n4", "SLURM_STEP_NODELIST": "n4", "SLURMD_NODENAME": "n4",
            "MASTER_ADDR": "127.0.0.1", "TMPDIR": tmpdir}


def _check(env: dict, *args: str) -> dict:
    p = subprocess.run([sys.executable, "-m", "ddp_hpc.supervise.nodecheck", *args], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_a_job_without_snapshots_or_staging_passes_on_a_full_looking_scratch(tmp_path):
    scratch, ck = tmp_path / "scratch", tmp_path / "ck"
    scratch.mkdir()
    ck.mkdir()
    huge = str(10**16)          # no folder here has room for it: scratch and the checkpoint folder look full
    rec = _check(_task_env(str(scratch)), "--dir", str(ck), "--need-bytes", huge)
    assert rec["ok"] and rec["problems"] == [], rec
    [why] = rec["shared"]       # said, and nobody's node's fault
    assert why.startswith(f"checkpoint folder {ck} full (") and "a checkpoint needs 10000000.0 GB" in why
    # a scratch that takes no file at all (a diskless node) is no problem either
    (tmp_path / "nodisk").write_text("")
    assert _check(_task_env(str(tmp_path / "nodisk")), "--dir", str(ck), "--need-bytes", "10")["ok"]


def test_a_node_that_cannot_hold_the_staged_data_fails(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    rec = _check(_task_env(str(scratch)), f"--stage={10**16}:{scratch / 'ddp_hpc-stage-7-x'}")
    assert not rec["ok"] and len(rec["problems"]) == 1, rec
    [why] = rec["problems"]
    assert why.startswith(f"{scratch} full (") and "the staged data needs 10000000.0 GB" in why


# -- the volatile ECC counter --------------------------------------------------------------------

def test_only_an_ecc_count_that_grows_between_two_checks_excludes():
    # first seen: a count left from an earlier job (volatile: since the driver loaded) is said, not held against it
    problems, notes = ecc_problems("n1", None, {"0": 0, "2": 3})
    assert problems == [] and notes == ["n1: GPU 2 had 3 uncorrected ECC error(s) since the driver loaded "
                                        "(excluded only if the count grows)"]
    assert ecc_problems("n1", {"0": 0, "2": 3}, {"0": 0, "2": 3}) == ([], [])
    assert ecc_problems("n1", {"0": 0, "2": 3}, {"0": 1, "2": 3}) == (
        ["GPU 0: uncorrected ECC errors grew from 0 to 1 since the last health check"], [])
    assert ecc_problems("n1", {"2": 3}, {"2": 0}) == ([], [])      # the driver reloaded: a new count


# -- what the supervisor reads of the job --------------------------------------------------------

def test_job_needs_reads_snapshots_and_staging_from_the_run_logs(tmp_path):
    assert job_needs(tmp_path) == ([], 0, None, [])     # nothing known: nothing to check
    (tmp_path / "config.yaml").write_text("checkpoint:\n  dir: ck\n  memory_every_steps: 0\n  resume: true\n")
    assert job_needs(tmp_path).snapshot_bytes == 0     # a config job keeps snapshots by default
    (tmp_path / "config.yaml").write_text("checkpoint:\n  memory_every_steps: -1\n")
    assert job_needs(tmp_path).snapshot_bytes is None
    (tmp_path / "config.yaml").unlink()                  # a script job: the run logs tell
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "step4.pt").write_bytes(b"x" * 500)
    events = [{"event": "stage", "rank": 0, "src": "/d/a", "path": "/s/x", "bytes": 30},
              {"event": "stage", "rank": 0, "src": "/d/a", "path": "/s/x", "bytes": 40},     # restaged: the newest
              {"event": "stage", "rank": 0, "src": "/d/b", "path": "/s/y", "bytes": 5},
              {"event": "checkpoint", "rank": 0, "step": 4, "path": str(ck / "step4.pt")},
              {"event": "restored", "rank": 0, "step": 4, "source": "peer"}]    # a script's snapshots
    (tmp_path / "rank0.events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert job_needs(tmp_path) == ([str(ck)], 500, 500, [(40, "/s/x"), (5, "/s/y")])
