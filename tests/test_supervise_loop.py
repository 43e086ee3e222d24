"""The supervisor's loop itself (ddp_hpc.supervise.loop: supervise, judge, the restart rows and
the job record) with real processes: a stand-in ``srun`` on PATH runs the step's command as one
rank, which writes real run-log events; sinfo answers through SlurmCLI's runner. The same loop
runs on the real test cluster in tests/cluster/test_restart_cluster.py. Also: which node states
are lost and which only draining (issue: a drain ended every supervised job on the node), and what
counts as a sign of life for the stall check."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ddp_hpc import records
from ddp_hpc.judge.nodefiles import rank_events
from ddp_hpc.judge.restarts import read_restarts, read_stops
from ddp_hpc.slurm.cli import SlurmCLI
from ddp_hpc.supervise import watch
from ddp_hpc.supervise.loop import Settings, judge, supervise
from ddp_hpc.supervise.plan import NodePlan, Policy, next_nodes
from ddp_hpc.supervise.watch import EventTail, StepEnd, Watch, node_condition

REPO = Path(__file__).resolve().parents[1]

# one rank of a step: run 0 reports two steps and then hangs (no sign of life), a later run
# (DDP_HPC_ALLOC_RESTARTS > 0) trains and completes; a SIGINT (srun's abort) ends it
RANK = textwrap.dedent("""
    import json, os, socket, sys, time
    restart = int(os.environ.get("DDP_HPC_ALLOC_RESTARTS", "0"))
    def event(name, **kw):
        with open(os.path.join(sys.argv[1], "rank0.events.jsonl"), "a") as f:
            f.write(json.dumps(dict(time=time.time(), event=name, rank=0, job_id="41", restart=restart,
                                    host=socket.gethostname(), **kw)) + "\\n")
    event("start", world_size=1, num_nodes=1, local_rank=0, pid=os.getpid())
    for step in (1, 2):
        event("step", epoch=0, step=step, total_steps=4)
    if restart == 0:
        time.sleep(120)
    for step in (3, 4):
        event("step", epoch=0, step=step, total_steps=4)
    event("end", status="completed", step=4)
""")


def _sinfo(states: dict) -> SlurmCLI:
    """A SlurmCLI whose sinfo answers ``states`` (node -> state), as a recording runner does."""
    def runner(argv, **kw):
        out = "".join(f"{n}\x1f{s}\n" for n, s in states.items()) if argv[0] == "sinfo" else ""
        return subprocess.CompletedProcess(argv, 0, out, "")
    return SlurmCLI(runner=runner, env={"PATH": os.environ.get("PATH", "")})


@pytest.fixture
def signals():
    """supervise() takes SIGTERM and SIGINT (scancel, the time limit): give them back afterwards."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def _job(tmp_path: Path, monkeypatch) -> tuple[Path, dict]:
    """A log directory, a job record, and a batch step's environment whose PATH starts with a
    stand-in srun: it runs the step's command (after its options) as one process, outside the job
    (a single rank: ddp_hpc's env finds no Slurm task there)."""
    bindir, log_dir = tmp_path / "bin", tmp_path / "run"
    bindir.mkdir()
    log_dir.mkdir()
    srun = bindir / "srun"
    srun.write_text('#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\n'
                    'exec env -u SLURM_JOB_ID -u SLURM_JOB_NODELIST "$@"\n')
    srun.chmod(0o755)
    (tmp_path / "rank.py").write_text(RANK)
    home = tmp_path / "home"
    monkeypatch.setenv("DDP_HPC_HOME", str(home))
    records.write_record({"id": "41", "cluster": "c", "name": "d", "backend": "sbatch", "nodes": 1, "gpus_per_node": 1,
                          "time_limit": None, "log_dir": str(log_dir), "config": None, "overrides": [],
                          "submitted_at": time.time(), "cwd": str(tmp_path)})
    env = {"PATH": f"{bindir}:{os.environ['PATH']}", "SLURM_JOB_ID": "41", "SLURM_JOB_NODELIST": "n1",
           "DDP_HPC_HOME": str(home), "PYTHONPATH": str(REPO), "DDP_HPC_LOG_DIR": str(log_dir)}
    return log_dir, env


def _settings(log_dir: Path, tmp_path: Path, max_restarts: int) -> Settings:
    return Settings(policy=Policy(nodes=1, tasks_per_node=1, max_restarts=max_restarts),
                    log_dir=str(log_dir), command=(sys.executable, str(tmp_path / "rank.py"), str(log_dir)),
                    stall_timeout_s=2.0)


def test_supervise_restarts_a_stalled_step_and_records_why(tmp_path, monkeypatch, signals, capsys):
    log_dir, env = _job(tmp_path, monkeypatch)
    rc = supervise(_settings(log_dir, tmp_path, 2), _sinfo({"n1": "mixed"}), env)
    assert rc == 0
    rows = read_restarts(log_dir)
    assert len(rows) == 1 and read_stops(log_dir) == []
    row = rows[0]
    assert (row["restart"], row["job_id"], row["trigger"]) == (1, "41", "stalled")
    assert row["stop"] == "no rank showed a sign of life (a step, an eval, a checkpoint) for 2 s"
    assert (row["nodes_before"], row["nodes_after"], row["world_before"], row["world_after"]) == (
        ["n1"], ["n1"], 1, 1)
    assert row["fault_at"] <= row["detected_at"]
    assert records.load_record("41").alloc_restarts == rows          # _to_record: the same row
    ends = rank_events(log_dir, 0).events
    assert [e["restart"] for e in ends if e["event"] == "end"] == [1]
    assert "restart 1 of at most 2 (restart number 1)" in capsys.readouterr().err


def test_a_step_stopped_and_not_restarted_is_a_stop_line_of_restarts_jsonl(tmp_path, monkeypatch, signals,
                                                                          capsys):
    log_dir, env = _job(tmp_path, monkeypatch)
    rc = supervise(_settings(log_dir, tmp_path, 0), _sinfo({"n1": "mixed"}), env)
    assert rc not in (0, 75)                                   # the job fails with the step's status
    assert read_restarts(log_dir) == []
    [stop] = read_stops(log_dir)
    assert (stop["stopped_run"], stop["job_id"], stop["trigger"]) == (0, "41", "stalled")
    assert stop["stop"].startswith("no rank showed a sign of life")
    assert stop["not_restarted"] == "no restart left (--max-restarts 0)"
    assert records.load_record("41").alloc_restarts is None       # the record keeps restarts only
    assert "not restarting: " in capsys.readouterr().err


def test_a_step_whose_ranks_completed_and_then_died_of_a_late_notice_completed(tmp_path, monkeypatch, signals,
                                                                              capsys):
    """A preemption notice that reached the ranks after they wrote their end (seen on the test
    cluster: scancel --signal=USR2 as a loaded run finished) kills them by the signal's default
    action; srun then exits non-zero, but the run completed: the job must not fail."""
    log_dir, env = _job(tmp_path, monkeypatch)
    (tmp_path / "rank.py").write_text(RANK.replace("time.sleep(120)", "pass") + textwrap.dedent("""
        import signal
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(5)
    """))
    rc = supervise(_settings(log_dir, tmp_path, 2), _sinfo({"n1": "mixed"}), env)
    assert rc == 0
    assert read_restarts(log_dir) == [] and read_stops(log_dir) == []
    assert "every rank completed; srun's exit status came after their end" in capsys.readouterr().err


def test_a_failed_write_of_restarts_jsonl_is_reported_and_the_restart_goes_on(tmp_path, monkeypatch, signals,
                                                                              capsys):
    log_dir, env = _job(tmp_path, monkeypatch)
    (log_dir / "restarts.jsonl").mkdir()          # as a full disk would, open(..., "a") raises OSError
    rc = supervise(_settings(log_dir, tmp_path, 2), _sinfo({"n1": "mixed"}), env)
    assert rc == 0
    err = capsys.readouterr().err
    assert "warning: could not write to" in err and "restarts.jsonl" in err and "going on" in err
    assert [r["restart"] for r in records.load_record("41").alloc_restarts] == [1]


def test_a_long_evaluation_of_the_training_core_is_no_stall(tmp_path, monkeypatch, signals):
    """ddp_hpc's own loop, one rank, an evaluation of about 28 s (a slow eval set) under a stall
    timeout of 14 s: its progress events (at most one per 5 s) keep the supervisor from stopping a
    healthy run. (With 7 s, a loaded CI machine's eval start-up alone once outlasted the timeout.)"""
    log_dir, env = _job(tmp_path, monkeypatch)
    command = (sys.executable, "-m", "ddp_hpc.run", str(REPO / "jobs" / "demo.yaml"), "data.kwargs.size=256",
               "train.epochs=1", "train.batch_size=32", "train.eval_every_epochs=0", "log.every_n_steps=1",
               "data.eval_dataset=tests.cluster.status_helpers:slow_synthetic", "data.eval_split=0.0",
               "data.eval_kwargs.size=112", "data.eval_kwargs.delay=0.25", "data.eval_kwargs.in_dim=32",
               "train.eval_batch_size=2", "train.device=cpu", "log.progress=off", "checkpoint.every_steps=0")
    s = Settings(policy=Policy(nodes=1, tasks_per_node=1, max_restarts=1), log_dir=str(log_dir), command=command,
                 stall_timeout_s=14.0)
    rc = supervise(s, _sinfo({"n1": "mixed"}), env)
    evs = rank_events(log_dir, 0).events
    names = [e["event"] for e in evs]
    assert rc == 0 and read_restarts(log_dir) == [] and read_stops(log_dir) == [], names
    assert names.count("eval") == 1 and names[-1] == "end"
    evals = [e for e in evs if e["event"] == "progress" and e["phase"] == "eval"]
    last_step = max(e["time"] for e in evs if e["event"] == "step")
    eval_at = next(e["time"] for e in evs if e["event"] == "eval")
    assert eval_at - last_step > 14.0, "the evaluation must outlast the stall timeout"
    assert len(evals) >= 2 and all(b["time"] - a["time"] < 14.0 for a, b in zip(evals, evals[1:]))


def _events(log_dir: Path, *events: dict) -> None:
    with (log_dir / "rank0.events.jsonl").open("a") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)


def test_judge_restarts_a_killed_rank_off_a_draining_node_onto_a_healthy_spare(tmp_path):
    now = time.time()
    base = {"rank": 0, "job_id": "41", "restart": 0, "host": "n2"}
    _events(tmp_path, dict(base, time=now - 3, event="start", world_size=1, num_nodes=1, local_rank=0, pid=1),
            dict(base, time=now - 2, event="step", step=1),
            dict(base, time=now - 1, event="error", exc_type="Signal", message="killed by signal 9 (SIGKILL)",
                 signal="SIGKILL", exit_code=None),
            dict(base, time=now - 1, event="end", status="killed", signal="SIGKILL", exit_code=None))
    s = Settings(policy=Policy(nodes=2, tasks_per_node=1, max_restarts=2, spare_nodes=2), log_dir=str(tmp_path),
                 command=("true",))
    plan = NodePlan(active=["n1", "n2"], spare=["n3", "n4"])
    cli = _sinfo({"n1": "mixed", "n2": "mixed", "n3": "drained", "n4": "idle"})
    end = StepEnd("exited", 137, now)
    j = judge(s, cli, plan, end, restart=0, done=0)
    f = j.finding
    assert (f.trigger, f.stop, f.kind, f.rank, f.draining) == ("exited", None, "killed", 0, ("n3",))
    assert j.plan is not None and j.plan.active == ["n1", "n4"] and j.plan.spare == ["n3"], j
    # nothing restartable left: the same finding, no plan, and why not
    spent = judge(s, cli, plan, end, restart=0, done=2)
    assert spent.plan is None and spent.change == "no restart left (--max-restarts 2)"


def test_a_step_that_ended_without_evidence_says_what_the_supervisor_read(tmp_path):
    """No rank wrote an event and srun reported nothing: the supervisor does not restart, and its
    reason lists what it read (each rank's ending, srun's reports), so the batch output tells a
    step that left no trace from evidence that was misread."""
    now = time.time()
    s = Settings(policy=Policy(nodes=1, tasks_per_node=1, max_restarts=2), log_dir=str(tmp_path), command=("true",))
    j = judge(s, _sinfo({"n1": "mixed"}), NodePlan(["n1"], []), StepEnd("exited", 1, now), restart=0, done=0)
    assert j.plan is None and j.finding.rank is None
    assert j.finding.why == "the step ended (exited; ranks' endings: none; srun's task reports: none)", j.finding
    (tmp_path / "slurm-41.out").write_text("srun: error: n1: task 0: Exited with exit code 3\n")
    j = judge(s, _sinfo({"n1": "mixed"}), NodePlan(["n1"], []), StepEnd("exited", 1, now), restart=0, done=0)
    assert j.finding.rank == 0 and "exit" in j.finding.why, j.finding


NODE_STATES = [("idle", "up"), ("mixed", "up"), ("allocated", "up"), ("completing", "up"),
               ("draining", "draining"), ("drained", "draining"), ("drain", "draining"),
               ("mixed+drain", "draining"), ("fail", "draining"), ("failing", "draining"),
               ("maint", "draining"), ("mixed$", "draining"), ("mixed@", "draining"),
               ("reboot_requested", "draining"), ("reboot_issued", "draining"), ("inval", "draining"),
               ("planned", "up"), ("mixed-", "up"), ("idle#", "up"), ("draining!", "draining"),
               ("down", "lost"), ("down*", "lost"), ("idle*", "lost"), ("allocated*", "lost"),
               ("drained*", "lost"), ("draining*", "lost"), ("failing*", "lost"), ("idle~", "lost"),
               ("powered_down", "lost"), ("mixed%", "lost")]


@pytest.mark.parametrize("state,condition", NODE_STATES)
def test_node_states_lost_or_draining(state, condition):
    assert node_condition(state) == condition


def test_a_draining_node_does_not_stop_the_step(tmp_path, monkeypatch):
    """An admin's drain (no new work): Slurm lets the step go on, so does the watcher."""
    monkeypatch.setattr(watch, "NODE_EVERY_S", 0.0)
    proc = subprocess.Popen(["sleep", "1"])
    cli = _sinfo({"n1": "mixed", "n2": "draining", "n3": "failing", "n4": "drained"})
    end = watch.watch_step(proc, EventTail(tmp_path, 0), cli, Watch(("n1", "n2", "n3", "n4"), every_s=0.05))
    assert (end.trigger, end.returncode, end.down) == ("exited", 0, [])
    assert watch.down_nodes(cli, ["n1", "n2", "n3", "n4"]) == []
    assert watch.down_nodes(_sinfo({"n1": "mixed", "n2": "down*"}), ["n1", "n2"]) == ["n2"]


def test_a_draining_node_is_swapped_for_a_healthy_spare_at_the_next_restart_else_kept():
    p = Policy(nodes=2, tasks_per_node=2, max_restarts=2, spare_nodes=2)
    plan, words = next_nodes(NodePlan(["n1", "n2"], ["n3", "n4"]), lost=[], suspect=[], policy=p,
                             draining=["n2", "n3"])
    assert (plan.active, plan.spare, plan.excluded) == (["n1", "n4"], ["n3"], ["n2"]) and "excluded n2" in words
    kept, words = next_nodes(NodePlan(["n1", "n2"], []), lost=[], suspect=[], policy=p, draining=["n2"])
    assert kept.active == ["n1", "n2"] and "draining, kept: n2" in words
    # a lost node takes the healthy spare; the draining one stays (better than fewer nodes)
    lost, _ = next_nodes(NodePlan(["n1", "n2"], ["n3"]), lost=["n1"], suspect=[], policy=p, draining=["n2"])
    assert lost.active == ["n2", "n3"]


def test_eval_checkpoint_and_progress_events_are_signs_of_life(tmp_path):
    """A long evaluation is no hang: after the first step, an eval, a checkpoint or a progress
    event restarts the stall clock as a step does."""
    now = time.time()
    _events(tmp_path, {"event": "step", "restart": 0, "time": now - 30},
            {"event": "checkpoint", "restart": 0, "time": now - 20},
            {"event": "progress", "restart": 0, "time": now - 10, "phase": "eval"},
            {"event": "eval", "restart": 0, "time": now})
    proc = subprocess.Popen(["sleep", "1"])
    end = watch.watch_step(proc, EventTail(tmp_path, 0), _sinfo({}), Watch(("n1",), stall_timeout_s=3.0,
                                                                          every_s=0.05))
    assert end.trigger == "exited" and end.last_step_at == pytest.approx(now)
    # before the first step nothing starts the clock: a start-up that only writes "start" is no stall
    other = tmp_path / "other"
    other.mkdir()
    _events(other, {"event": "eval", "restart": 0, "time": now - 30})
    proc = subprocess.Popen(["sleep", "0.5"])
    end = watch.watch_step(proc, EventTail(other, 0), _sinfo({}), Watch(("n1",), stall_timeout_s=3.0, every_s=0.05))
    assert end.trigger == "exited" and end.last_step_at is None


def test_to_record_adds_each_restart_and_a_job_without_a_record_is_fine(tmp_path, monkeypatch, capsys):
    from ddp_hpc.supervise.loop import _to_record
    _job(tmp_path, monkeypatch)                     # the record of job 41
    _to_record("41", {"restart": 1, "job_id": "41"})
    _to_record("41", {"restart": 2, "job_id": "41"})
    assert [r["restart"] for r in records.load_record("41").alloc_restarts] == [1, 2]
    _to_record("77", {"restart": 1, "job_id": "77"})    # submitted without ddp_hpc: no record
    assert "warning: restart not added to the job record: no job record with id '77'" in capsys.readouterr().err
    _to_record(None, {"restart": 1})                  # no job id at all: nothing to do
    assert capsys.readouterr().err == ""
