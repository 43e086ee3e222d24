"""The status command against a real Slurm: real jobs submitted with ``ddp_hpc.submit --backend
sbatch`` (2 nodes x 1 task, tiny training runs), status always run from another directory.
One task a node: status reads every rank's events the same way whatever their number, and each
rank process costs ~2 s of CPU to import torch.

- a running job shows RUNNING with advancing progress; a finished one COMPLETED;
- a job whose rank 1 raises ends FAILED within a minute, and status names rank 1 and the exception;
- a user's plain scancel ends a job CANCELLED (not requeued, by default); a requeued job shows its
  restart count and both runs' events;
- the same answers from every source (squeue, sacct with slurmdbd, sacct -c with jobcomp only,
  the logs), and with slurmdbd stopped.
"""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

# One worker under xdist: the last test compares the jobs of the others (JOBS), and it has the
# cluster alone (it switches accounting off), with the other exclusive tests of the suite.
pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("exclusive")]

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
# small and slow-ish: 2048 samples, 2 ranks, batch 64 -> 14 steps per epoch; each fetch sleeps so
# the job runs long enough to be watched without burning the 2 CPUs
TINY = ["data.kwargs.size=2048", "log.every_n_steps=2", "log.progress=lines"]
SLOW = ["data.dataset=tests.cluster.status_helpers:slow_synthetic", "data.kwargs.delay=0.008"]
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED")
JOBS: dict[str, dict] = {}  # name -> {"id", "state", "failure_rank"} for the cross-source test
FAILING = ["data.dataset=tests.cluster.status_helpers:failing_synthetic", "data.kwargs.fail_rank=1",
           "data.kwargs.after=400"]


@pytest.fixture(scope="module")
def env(slurm_cluster):
    home = slurm_cluster.shared_dir / "status-home"
    return dict(slurm_cluster.env, DDP_HPC_HOME=str(home), PYTHONPATH=str(REPO))


@pytest.fixture(scope="module")
def elsewhere(slurm_cluster):
    d = slurm_cluster.shared_dir / "status-elsewhere"
    d.mkdir(exist_ok=True)
    return d


def submit(c, env, name, overrides, epochs=2, time_limit="00:10:00"):
    runs = c.shared_dir / "status-runs"
    p = c.run([PY, "-m", "ddp_hpc.submit", "--backend", "sbatch", "--nodes", "2", "--gpus", "1",
               "--time", time_limit, "--job-name", name, str(REPO / "jobs" / "demo.yaml"), "--",
               f"log.dir={runs}", f"train.epochs={epochs}", *TINY, *overrides],
              cwd=str(REPO), env=env)
    assert p.returncode == 0, p.stderr + p.stdout
    return p.stdout.strip().splitlines()[-1]


def status(c, env, cwd, *args, ok=True):
    p = c.run([PY, "-m", "ddp_hpc.status", *args], cwd=str(cwd), env=env, timeout=120)
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def js(c, env, cwd, *args):
    return json.loads(status(c, env, cwd, *args, "--json").stdout)


def diag(c, env, cwd, job_id) -> str:
    """What a failing assertion should show: status's own detail page and the job's raw output."""
    out = [status(c, env, cwd, job_id, ok=False).stdout]
    st = js(c, env, cwd, job_id)
    d = Path(st.get("log_dir") or "/nonexistent")
    for name in sorted(p.name for p in d.glob("slurm-*.out")) + ["rank0.out", "rank1.out"]:
        f = d / name
        if f.exists():
            out.append(f"--- {name} (tail)\n" + "\n".join(f.read_text(errors="replace").splitlines()[-25:]))
    return "\n".join(out)


def poll(c, env, cwd, job_id, until, timeout=180, every=1.5):
    """Status snapshots until ``until(snapshot)`` holds; returns (last, all)."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = js(c, env, cwd, job_id)
        seen.append(st)
        if until(st):
            return st, seen
        time.sleep(every)
    raise AssertionError(f"job {job_id}: condition not met in {timeout} s; states seen "
                         f"{[s['state'] for s in seen]}; last:\n{json.dumps(seen[-1], indent=1)[:3000]}")


def squeue_agrees(c, env, cwd, job_id, state, failure_rank=None):
    """Asked right after the job ended, squeue still lists it (for MinJobAge, 300 s) and must give
    the state the other sources give later (test_same_answers_from_every_source compares those)."""
    st = js(c, env, cwd, job_id, "--source", "squeue")
    assert (st["source"], st["state_name"]) == ("squeue", state), (st["source"], st["state"], st["tried"])
    if failure_rank is not None:
        assert st["failure"]["rank"] == failure_rank, st["failure"]


def test_running_job_progresses_then_is_requeued_and_completed(slurm_cluster, env, elsewhere):
    """One job for what were two tests (a running job, a requeued one): it runs, with advancing
    progress; a USR2 makes it checkpoint and requeue itself; it resumes and completes, and status
    shows the restart count and both runs (their events, sacct -D, TensorBoard)."""
    c = slurm_cluster
    # batches four times slower than SLOW until the USR2 is sent (a loaded run once reached its
    # end before the signal came), then at full speed (``until``: sleeping, no CPU)
    go = c.shared_dir / f"st-ok-go-{time.monotonic_ns()}"
    job = submit(c, env, "st-ok", [*SLOW[:1], "data.kwargs.delay=0.03", f"data.kwargs.until={go}",
                                   "checkpoint.every_steps=2"])
    steps = []

    def advanced(st):
        if st["state_name"] == "RUNNING" and st["progress"] and st["progress"]["step"]:
            steps.append(st["progress"]["step"])
        return len(set(steps)) >= 2 or st["state_name"] in ENDED

    st, seen = poll(c, env, elsewhere, job, advanced)
    assert len(set(steps)) >= 2, [s["state"] for s in seen]
    assert steps == sorted(steps)
    running = [s for s in seen if s["state_name"] == "RUNNING"][-1]
    assert running["source"] == "squeue"
    # squeue prints "10:00" and "0:42": shown in the one format, like every other source's
    assert running["time_limit"] == "00:10:00" and re.fullmatch(r"\d\d:\d\d:\d\d", running["elapsed"]), running
    # the first of the two steps seen running is short of the total (the second may be the last
    # step, shown while the run saves its final checkpoint on a loaded machine)
    first = next(s for s in seen if s["state_name"] == "RUNNING" and s["progress"] and s["progress"]["step"])
    assert first["progress"]["total_steps"] and 0 < first["progress"]["percent"] < 100, first["progress"]
    assert 0 < running["progress"]["percent"] <= 100
    assert running["nodes"] == 2 and running["gpus_per_node"] == 1
    # preemption the way Slurm announces it: the training core checkpoints, rank 0 requeues the
    # job, the next run resumes (a bare `scontrol requeue` also SIGTERMs the ranks, which the
    # core takes for a preemption and answers with a second requeue of its own)
    p = c.run(["scancel", "--signal=USR2", job])   # at once: a loaded run may reach its end
    assert p.returncode == 0, p.stderr
    go.touch()
    # the table, from another directory, lists it too
    table = status(c, env, elsewhere, "--wide").stdout
    row = next(line for line in table.splitlines() if line.startswith(job + " "))
    assert "st-ok" in row and "sbatch" in row and "2x1" in row
    st, seen = poll(c, env, elsewhere, job, lambda s: s["state_name"] in ENDED, timeout=300, every=3)
    assert st["state_name"] == "COMPLETED", f"{[s['state'] for s in seen]}\n{diag(c, env, elsewhere, job)}"
    assert st["restarts"] == 1, st
    runs = {r["restart"]: r for r in st["runs"]}
    assert sorted(runs) == [0, 1]
    assert runs[0]["end_status"] == "preempted" and runs[0]["requeued"], runs[0]
    assert runs[0]["preempt_reason"] == "preemption" and runs[0]["last_step"], runs[0]
    assert runs[1]["end_status"] == "completed"
    assert c.wait(job, timeout=60) == "COMPLETED"
    squeue_agrees(c, env, elsewhere, job, "COMPLETED")
    st = js(c, env, elsewhere, job)
    assert st["state_name"] == "COMPLETED", st
    assert st["progress"]["percent"] == 100.0 and st["failure"] is None
    assert sorted(st["last_events"]) == ["0", "1"]
    assert {e["event"] for e in st["last_events"].values()} == {"end"}
    if c.accounting == "slurmdbd":
        assert st["history_source"] == "sacct -D", st
        assert [h["state"] for h in st["scheduler_history"]][-1] == "COMPLETED"
        assert len(st["scheduler_history"]) == 2
    text = status(c, env, elsewhere, job).stdout
    assert "restarts: 1" in text and "restart 0:" in text and "restart 1:" in text
    # TensorBoard: rank 0 of each run wrote an event file into the run dir; the second one goes on
    # from the checkpoint, and the two read as one run whose global step never goes back
    files = sorted(Path(st["log_dir"]).glob("events.out.tfevents.*"))
    assert len(files) == 2 and f"TensorBoard: tensorboard --logdir {st['log_dir']}" in text
    runs_tb = [EventAccumulator(str(f)) for f in (st["log_dir"], files[1])]
    for acc in runs_tb:
        acc.Reload()
    steps = [e.step for e in runs_tb[0].Scalars("train/loss")]
    assert steps == sorted(set(steps)) and steps[-1] == runs[1]["last_step"], (steps, runs[1])
    assert runs_tb[1].Scalars("train/loss")[0].step > 1
    JOBS["completed"] = {"id": job, "state": "COMPLETED"}      # requeued once, then completed


def test_rank1_raises_failed_within_a_minute_naming_rank1(slurm_cluster, env, elsewhere):
    """Only test that a job with a rank that raises ends FAILED at once (kill-on-bad-exit) and that
    status names the rank and its exception from every source."""
    c = slurm_cluster
    job = submit(c, env, "st-fail", FAILING)
    # wait for rank 1's error event, then for the job to end: kill-on-bad-exit, not the time limit
    st, _ = poll(c, env, elsewhere, job, lambda s: s["failure"] is not None
                 or s["state_name"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout=180)
    assert st["failure"] is not None, st
    t_error = st["failure"]["time"]
    st, _ = poll(c, env, elsewhere, job,
                 lambda s: s["state_name"] not in ("RUNNING", "COMPLETING", "PENDING"), timeout=120)
    ended_after = time.time() - t_error
    assert st["state_name"] == "FAILED", diag(c, env, elsewhere, job)
    assert ended_after < 60, f"job still ran {ended_after:.0f} s after rank 1 failed (limit 10 min)"
    f = st["failure"]
    assert f["rank"] == 1 and f["basis"] == "error event", f
    assert f["exc_type"].endswith("InjectedFailure") and "rank 1" in f["message"]
    assert any("InjectedFailure" in ln for ln in f["traceback_tail"])
    text = status(c, env, elsewhere, job).stdout
    assert "First failure: rank 1" in text and "InjectedFailure" in text
    assert c.wait(job, timeout=120) == "FAILED"
    squeue_agrees(c, env, elsewhere, job, "FAILED", failure_rank=1)
    st = js(c, env, elsewhere, job)
    assert st["rank_exit_codes"].get("1") == 1, st["rank_exit_codes"]
    assert st["exit_code"] and st["exit_code"] != "0:0", st
    JOBS["failed"] = {"id": job, "state": "FAILED", "failure_rank": 1}


def _wait_progress(c, env, cwd, job):
    return poll(c, env, cwd, job, lambda s: s["state_name"] == "RUNNING" and s["progress"]
                and (s["progress"]["step"] or 0) >= 2, timeout=180)[0]


def test_user_scancel_with_default_config_ends_cancelled(slurm_cluster, env, elsewhere):
    """A user's plain ``scancel`` must end the job, not requeue it (the default config), and
    status says CANCELLED from every source. (One job for what were two tests, the other with
    ``preempt.requeue=false``: the default is the case that can go wrong, and status reads a
    cancelled job the same way whatever the config said.)"""
    c = slurm_cluster
    job = submit(c, env, "st-scancel", SLOW, epochs=6)
    _wait_progress(c, env, elsewhere, job)
    p = c.run(["scancel", job])
    assert p.returncode == 0, p.stderr
    st, _ = poll(c, env, elsewhere, job, lambda s: s["state_name"] in ENDED or s["restarts"] > 0,
                 timeout=180)
    if st["restarts"] > 0:  # requeued instead of cancelled: stop it for good before failing
        c.run(["scancel", "--full", "--signal=KILL", job])
        c.run(["scancel", job])
        final = c.wait(job, timeout=120)
    else:
        final = c.wait(job, timeout=120)
        st = js(c, env, elsewhere, job)
    assert final == "CANCELLED" and st["restarts"] == 0, (
        f"after a plain `scancel {job}` the job was requeued ({st['restarts']} restart(s), then "
        f"ended {final} after a forced kill): the training core treats scancel's SIGTERM as a "
        f"preemption and rank 0 requeues the job (runs in the logs: {st['runs']})")
    squeue_agrees(c, env, elsewhere, job, "CANCELLED")
    st = js(c, env, elsewhere, job)
    assert st["state_name"] == "CANCELLED" and st["state"].startswith("CANCELLED"), st
    assert st["restarts"] == 0 and st["failure"] is None, st
    assert "CANCELLED" in status(c, env, elsewhere, job).stdout.splitlines()[1]
    # the logs alone cannot tell a cancel (SIGTERM) from a preemption: no "logs" answer to compare
    JOBS["cancelled"] = {"id": job, "state": "CANCELLED", "not_from": ("logs",)}


def _ensure_ended_jobs(c, env) -> None:
    """A completed and a failed job in JOBS: those of the tests above, else (this test alone, or
    after they failed) two of its own, submitted together and waited for."""
    own = {name: submit(c, env, f"st-{name}", FAILING if name == "failed" else [], epochs=1)
           for name in ("completed", "failed") if name not in JOBS}
    for name, job in own.items():
        state = "FAILED" if name == "failed" else "COMPLETED"
        assert c.wait(job, timeout=300) == state, (name, job)
        JOBS[name] = {"id": job, "state": state, **({"failure_rank": 1} if name == "failed" else {})}


@pytest.mark.cluster_exclusive
def test_same_answers_from_every_source_and_without_slurmdbd(slurm_cluster, env, elsewhere):
    """Only test comparing status's answers from sacct, sacct -c and the logs, with slurmdbd and
    without it."""
    c = slurm_cluster
    _ensure_ended_jobs(c, env)
    for j in JOBS.values():
        c.wait(j["id"], timeout=60)  # accounting has the record

    # squeue is not among the sources here: it forgets a job MinJobAge (300 s) after its end, so
    # each test above asked it right after its job ended (squeue_agrees)
    def check(sources):
        for name, j in JOBS.items():
            for source in sources:
                if source in j.get("not_from", ()):
                    continue
                st = js(c, env, elsewhere, j["id"], "--source", source)
                assert st["state_name"] == j["state"], (name, source, st["state"], st["tried"])
                assert st["source"] == source.replace("sacct-c", "sacct -c"), (name, source, st["source"])
                # sacct "00:10:00", sacct -c "10" (minutes), the record "00:10:00": one format
                assert st["time_limit"] == "00:10:00", (name, source, st["time_limit"])
                if "failure_rank" in j:
                    assert st["failure"]["rank"] == j["failure_rank"], (name, source)
            assert js(c, env, elsewhere, j["id"])["state_name"] == j["state"]

    if c.accounting == "slurmdbd":
        check(["sacct", "sacct-c", "logs"])
        c.stop_slurmdbd()
        try:
            assert c.accounting == "jobcomp"
            check(["sacct-c", "logs"])
            st = js(c, env, elsewhere, JOBS["failed"]["id"], "--source", "sacct")
            assert st["source"] == "logs" and any("accounting storage is disabled" in t for t in st["tried"])
        finally:
            c.start_slurmdbd()
    else:
        check(["sacct-c", "logs"])
    # the table from another directory shows all of them with those states
    rows = {r["id"]: r for r in js(c, env, elsewhere)}
    for j in JOBS.values():
        assert rows[j["id"]]["state_name"] == j["state"]
