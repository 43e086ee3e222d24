"""Issue 38 ("Do no harm"), the checkpoints of users' scripts and of the training core:

- bug 3: two runs of one job (one job id, one node) keep their memory snapshots apart: a run's
  `load` of its own empty directory never restores the other run's snapshot, and its
  `discard_snapshots` never removes the other run's (the public API only, in real processes);
- bug 7: the end of training waits for the last checkpoint write before the snapshots go and the
  signal handlers are given back; a failed last write fails the run (an ``error`` event, a line
  in the rank log) and keeps the snapshots; a script whose last background save failed exits 1;
- bug 1, `ddp_hpc.checkpoint.save`'s part: rank 0's save writes a ``progress`` event of phase
  ``checkpoint`` before its file and the ``checkpoint`` event after it (nothing without a log).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch
from test_exec import DROP, EXEC, clean_env, events

from ddp_hpc import checkpoint, progress
from ddp_hpc.judge.nodefiles import rank_events
from ddp_hpc.launch import launch_distributed
from ddp_hpc.train.memsnap import job_folder

ROOT = Path(__file__).resolve().parents[1]
FAST = "forkserver"  # ranks fork from one server that imported torch (tests/conftest.py)


@pytest.fixture
def job():
    """A job id of this test's own: its snapshot folders (every key) are removed afterwards."""
    name = f"dnh-ckpt-{uuid.uuid4().hex[:8]}"
    yield name
    for folder in job_folder(name).parent.glob(f"{job_folder(name).name}*"):
        shutil.rmtree(folder, ignore_errors=True)


def _rank0_env(job: str, **extra: str) -> dict[str, str]:
    """One process as rank 0 of 1 of job ``job`` (torchrun's variables): two such processes are two
    runs of one job on one node, as two tasks of a Slurm job are."""
    return clean_env(PYTHONPATH=str(ROOT), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", DDP_HPC_JOB_ID=job, **extra)


# ----------------------------------------------------------------------------- bug 3
RUN = textwrap.dedent("""
    import json, sys, torch
    from ddp_hpc import checkpoint
    run, ckpt = sys.argv[1], sys.argv[2]
    torch.manual_seed({"A": 1, "B": 2, "A-again": 3}[run])
    model = torch.nn.Linear(4, 2)
    out = {}
    if run == "A":                       # saves, then keeps a newer step in memory, and fails
        checkpoint.save(ckpt, model, step=500)
        checkpoint.snapshot(model, step=501)
    elif run == "B":                     # another run of the same job: its own, empty directory
        out["loaded"] = checkpoint.load(ckpt, model)
        checkpoint.snapshot(model, step=7)
        checkpoint.discard_snapshots()   # its clean end
    else:                                # A's restart inside the allocation
        out["loaded"] = checkpoint.load(ckpt, model)
    out["weight"] = model.weight.flatten().tolist()
    print(json.dumps(out))
""")


def _run(tmp_path: Path, job: str, run: str, ckpt: Path) -> dict:
    p = subprocess.run([sys.executable, "-c", RUN, run, str(ckpt)], env=_rank0_env(job), cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.splitlines()[-1])


@pytest.mark.timeout(300)
def test_two_runs_of_one_job_never_take_or_remove_each_others_snapshots(tmp_path, job):
    ck_a, ck_b = tmp_path / "ckA", tmp_path / "ckB"
    ck_b.mkdir()
    a = _run(tmp_path, job, "A", ck_a)
    b = _run(tmp_path, job, "B", ck_b)
    torch.manual_seed(2)
    assert b["loaded"] is None, "B restored A's snapshot from B's empty checkpoint directory"
    assert b["weight"] == torch.nn.Linear(4, 2).weight.flatten().tolist()    # B's model untouched
    again = _run(tmp_path, job, "A-again", ck_a)      # after B discarded its snapshots
    assert again["loaded"] == {"step": 501}, "B's discard_snapshots removed A's snapshot"
    assert again["weight"] == a["weight"]
    assert job_folder(job, key=str(ck_a)).is_dir()    # keyed by A's directory, as the loop keys
    assert not job_folder(job, key=str(ck_b)).exists()


def test_a_snapshot_before_any_directory_is_known_is_none_and_says_why(tmp_path, job, monkeypatch, capsys):
    """Which directory would a restart's `load` read? Unknown before `load` or `save` named one:
    no snapshot then (a snapshot nobody could find would only hold node memory), told once."""
    for k in [k for k in os.environ if DROP.match(k)]:
        monkeypatch.delenv(k)
    for k, v in _rank0_env(job).items():
        if DROP.match(k):
            monkeypatch.setenv(k, v)
    monkeypatch.setattr(checkpoint, "_dirs", {})
    monkeypatch.setattr(checkpoint, "_told", set())
    monkeypatch.setattr(checkpoint, "_snaps", [])
    monkeypatch.setattr(progress, "_state", progress._State())   # no log directory: stderr
    model = torch.nn.Linear(2, 2)
    checkpoint.snapshot(model, step=1)
    checkpoint.snapshot(model, step=2)
    assert checkpoint._snaps == []
    assert not list(job_folder(job).parent.glob(job_folder(job).name + "*"))
    assert capsys.readouterr().err.count("call checkpoint.load(ckpt_dir, ...) before the first snapshot") == 1


# ----------------------------------------------------------------------------- bug 1 (the script API's save)
def test_a_blocking_save_tells_the_supervisor_it_is_saving_then_that_the_file_is_complete(tmp_path, monkeypatch):
    for k in [k for k in os.environ if DROP.match(k)]:
        monkeypatch.delenv(k)
    monkeypatch.setattr(checkpoint, "_dirs", {})
    monkeypatch.setattr(progress, "_state", progress._State())
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(4, 4)
    checkpoint.save(tmp_path / "quiet", model, step=2)          # no log directory: no event, no file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quiet"]
    monkeypatch.setenv("DDP_HPC_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.setattr(progress, "_state", progress._State())    # the run log is looked up again
    try:
        path = checkpoint.save(tmp_path / "ckpt", model, step=3)
        checkpoint.save(tmp_path / "ckpt", model, step=4, blocking=False).wait()
    finally:
        progress.close()
    seen = [(e["event"], e.get("phase"), e.get("step")) for e in events(tmp_path / "logs", 0)]
    assert seen == [("progress", "checkpoint", 3), ("checkpoint", None, 3),
                    ("progress", "checkpoint", 4), ("checkpoint", None, 4)]
    assert path == tmp_path / "ckpt" / "ckpt-000000003.pt"


# ----------------------------------------------------------------------------- bug 7, scripts
LAST_SAVE = textwrap.dedent("""
    import sys, torch
    from ddp_hpc import checkpoint
    model = torch.nn.Linear(8, 8)
    checkpoint.save(sys.argv[1], model, step=5, blocking=False)     # the last line: nobody waits
""")


@pytest.mark.timeout(400)   # 3 interpreters one after another: 100 s in a loaded fresh-clone run
def test_a_script_whose_last_background_save_failed_exits_1_with_an_error_event(tmp_path):
    """A background save on a script's last line still fails the script (exit 1; under ddp_hpc.exec
    with an error event) or writes its file: three real interpreters, each importing torch."""
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the checkpoint directory should be\n")
    target = blocked / "ckpt"
    plain = subprocess.run([sys.executable, "-c", LAST_SAVE, str(target)], cwd=tmp_path, timeout=120,
                           env=clean_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True)
    assert plain.returncode == 1, plain.stderr
    assert "Traceback (most recent call last):" in plain.stderr and "CheckpointError" in plain.stderr
    assert f"{target}/ckpt-000000005.pt" in plain.stderr
    ok = subprocess.run([sys.executable, "-c", LAST_SAVE, str(tmp_path / "ok")], cwd=tmp_path, timeout=120,
                        env=clean_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True)
    assert ok.returncode == 0 and (tmp_path / "ok" / "ckpt-000000005.pt").exists(), ok.stderr

    logs = tmp_path / "logs"                # under ddp_hpc.exec, as `ddp-hpc submit` runs a script
    logs.mkdir()
    with open(logs / "rank0.out", "wb") as out:
        wrapped = subprocess.run([*EXEC, "--log-dir", str(logs), "--", sys.executable, "-c", LAST_SAVE,
                                  str(target)], cwd=tmp_path, env=clean_env(PYTHONPATH=str(ROOT)),
                                 stdout=out, stderr=subprocess.STDOUT, timeout=120)
    assert wrapped.returncode == 1, (logs / "rank0.out").read_text()
    ev = {e["event"]: e for e in events(logs, 0)}
    assert ev["end"]["status"] == "failed" and ev["end"]["exit_code"] == 1
    assert ev["error"]["exc_type"].endswith("CheckpointError")
    assert "the checkpoint of step 5 was not written" in ev["error"]["message"]
    assert "last checkpoint is missing" in (logs / "rank0.log").read_text()


# ----------------------------------------------------------------------------- bug 7, the training core
def _loop_worker(rank: int, world: int, tmp: str, job: str, fail: bool) -> dict:
    """A 4-step run with memory snapshots every step and async checkpoints; the write of the last
    checkpoint (step 4) is slow (and fails with ``fail``) and notes what held while it ran."""
    os.environ["DDP_HPC_JOB_ID"] = job
    import time

    from ddp_hpc.examples.models import MLP
    from ddp_hpc.examples.synthetic import SyntheticClassification
    from ddp_hpc.train import asyncsave, fit
    folder = job_folder(job, key=os.path.abspath(f"{tmp}/ckpt"))
    seen: dict = {}
    real = asyncsave.save_checkpoint

    def slow_last(directory, step, state, keep_last=3):
        if step == 4:
            time.sleep(1.0)      # the end of training goes on meanwhile, unless it waits for this
            seen.update(snapshots=any(folder.glob("*/ckpt-*.pt")),
                        sigterm_caught=signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL)
            if fail:
                raise OSError(28, "No space left on device")
        return real(directory, step, state, keep_last=keep_last)

    asyncsave.save_checkpoint = slow_last
    overrides = [f"log.dir={tmp}/logs", f"checkpoint.dir={tmp}/ckpt", "log.progress=off",
                 "train.eval_every_epochs=0", "train.batch_size=8", "train.epochs=1", "checkpoint.async=true",
                 "checkpoint.memory_every_steps=1"]
    try:
        res = fit(MLP(in_dim=8, hidden=16, num_classes=3), SyntheticClassification(size=32, in_dim=8, num_classes=3),
                  config=None, overrides=overrides)
        out = {"status": res.status, "step": res.step, "error": None}
    except Exception as exc:  # noqa: BLE001 - the failure is what the test looks at
        out = {"status": None, "error": f"{type(exc).__name__}: {exc}"}
    return {**out, **seen, "snapshots_after": any(folder.glob("*/ckpt-*.pt"))}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fail", [False, True], ids=["written", "failed"])
def test_the_end_of_training_waits_for_the_last_write_before_it_cleans_up(tmp_path, job, fail):
    (out,) = launch_distributed(_loop_worker, 1, args=(str(tmp_path), job, fail), start_method=FAST, timeout=200)
    assert out["snapshots"] is True, "the snapshots were removed while the last checkpoint was written"
    assert out["sigterm_caught"] is True, "the signal handlers were given back while the last checkpoint was written"
    log = "".join(p.read_text() for p in (tmp_path / "logs").rglob("rank0.log"))
    evs = [e for d in {p.parent for p in (tmp_path / "logs").rglob("*.events.jsonl")} for e in rank_events(d, 0).events]
    if not fail:
        assert (out["status"], out["step"]) == ("completed", 4) and out["snapshots_after"] is False
        assert (tmp_path / "ckpt" / "ckpt-000000004.pt").exists()
        return
    assert out["error"].startswith("CheckpointError: the checkpoint of step 4 was not written"), out
    assert out["snapshots_after"] is True        # the newest state is kept for the restart
    (err,) = [e for e in evs if e["event"] == "error"]
    assert err["exc_type"] == "CheckpointError" and "ckpt-000000004.pt" in err["message"]
    assert [e["status"] for e in evs if e["event"] == "end"] == ["failed"]
    assert "WARNING: the checkpoint of step 4 was not written" in log      # told when it failed
    assert not (tmp_path / "ckpt" / "ckpt-000000004.pt").exists()
