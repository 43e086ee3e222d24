"""The in-allocation restart supervisor's decisions (ddp_hpc.supervise.plan: what is restartable,
which nodes next), its options (checked with clear errors, YAML and flags), the restart number
the ranks see (env.job_facts) and how the scheduler's runs map past in-allocation restarts. The
supervisor itself runs on the real test cluster: tests/cluster/test_restart_cluster.py."""

import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from ddp_hpc.backends import check_options, get
from ddp_hpc.backends.render import render
from ddp_hpc.backends.spec import JobSpec, SpecError, TaskSpec
from ddp_hpc.config import ConfigError, SlurmOptions
from ddp_hpc.config.slurm_options import merged
from ddp_hpc.env import job_facts
from ddp_hpc.env.checks import detect
from ddp_hpc.judge.restarts import read_restarts, sched_index
from ddp_hpc.runlogs.restarts import append_restart
from ddp_hpc.slurm.cli import SlurmCLI
from ddp_hpc.slurm.query import _view_from_rows  # the rows -> state step of query_slurm
from ddp_hpc.supervise import watch
from ddp_hpc.supervise.cli import main as supervise_main
from ddp_hpc.supervise.loop import Settings, step_args, step_env
from ddp_hpc.supervise.plan import NodePlan, Policy, next_nodes, verdict
from ddp_hpc.supervise.watch import EventTail, Watch


def test_user_errors_are_not_restarted_unless_asked_and_faults_are():
    p = Policy(nodes=2, tasks_per_node=2, max_restarts=2)
    assert not verdict("raised", "exited", p, 0).restart
    assert "--restart-on-error" in verdict("exited", "exited", p, 0).reason
    assert verdict("raised", "exited", dataclasses.replace(p, restart_on_error=True), 0).restart
    for kind in ("killed", "vanished", "stuck", "lost", "consequence"):
        assert verdict(kind, "exited", p, 1).restart, kind
    assert verdict(None, "node down", p, 0).restart and verdict(None, "stalled", p, 0).restart
    assert not verdict(None, "exited", p, 0).restart          # nothing says what failed
    assert "--max-restarts 2" in verdict("killed", "exited", p, 2).reason


def test_a_lost_node_is_replaced_by_a_spare_first_then_the_job_shrinks_to_min_nodes():
    p = Policy(nodes=2, tasks_per_node=2, max_restarts=3, spare_nodes=1, min_nodes=1)
    plan = NodePlan(active=["n1", "n2"], spare=["n3"])
    plan, words = next_nodes(plan, lost=["n2"], suspect=[], policy=p)
    assert (plan.active, plan.spare, plan.excluded) == (["n1", "n3"], [], ["n2"])
    assert "excluded n2" in words
    # a killed rank's node stays when no spare is left (it still answers)
    same, words = next_nodes(plan, lost=[], suspect=["n3"], policy=p)
    assert same.active == ["n1", "n3"] and "no node excluded" in words
    fewer, _ = next_nodes(plan, lost=["n3"], suspect=[], policy=p)
    assert fewer.active == ["n1"] and fewer.excluded == ["n2", "n3"]
    with pytest.raises(ValueError, match="fewer than --min-nodes 1"):
        next_nodes(fewer, lost=["n1"], suspect=[], policy=p)
    strict = Policy(nodes=2, tasks_per_node=2, max_restarts=3)
    with pytest.raises(ValueError, match="--min-nodes 2"):
        next_nodes(NodePlan(["n1", "n2"], []), lost=["n2"], suspect=[], policy=strict)


def test_a_suspect_node_is_swapped_for_a_spare_while_one_is_left():
    p = Policy(nodes=2, tasks_per_node=2, spare_nodes=1)
    plan, _ = next_nodes(NodePlan(["n1", "n2"], ["n3"]), lost=[], suspect=["n2"], policy=p)
    assert plan.active == ["n1", "n3"] and plan.excluded == ["n2"]


def test_restart_options_are_checked_with_clear_errors():
    with pytest.raises(ConfigError, match=r"--min-nodes 3 \(slurm.min_nodes\) is more than --nodes 2"):
        SlurmOptions(nodes=2, max_restarts=1, min_nodes=3)
    with pytest.raises(ConfigError, match="--spare-nodes .* but --max-restarts is 0") as e:
        SlurmOptions(max_restarts=0, spare_nodes=1)
    assert "HINT" in str(e.value)
    with pytest.raises(ConfigError, match="at least 0"):
        SlurmOptions(max_restarts=-1)
    with pytest.raises(ConfigError, match="must be an integer"):
        SlurmOptions(spare_nodes="two")
    opts = merged(SlurmOptions(nodes=2), {"max_restarts": 3, "spare_nodes": 1, "min_nodes": 1})
    assert (opts.max_restarts, opts.spare_nodes, opts.min_nodes) == (3, 1, 1)


def _spec(**opts) -> JobSpec:
    o = SlurmOptions(**{"job_name": "d", "nodes": 2, "gpus_per_node": 2, "cpus_per_task": 1,
                        "signal": "USR2@90", **opts})
    return JobSpec(options=o, config="/c.yaml", tasks=(TaskSpec(None, (), "/r/d-1"),), log_dir="/r/d-1",
                   workdir="/w", python="/py")


def test_the_options_reach_the_script_and_other_backends_refuse_them():
    text = render(_spec(max_restarts=2, spare_nodes=1))
    assert "#SBATCH --nodes=3" in text and "#SBATCH --no-kill" in text
    assert "-m ddp_hpc.supervise --nodes 2 --tasks-per-node 2 --max-restarts 2 --spare-nodes 1" in text
    plain = render(_spec(max_restarts=0))
    # no supervisor (the requeue prologue, python -m ddp_hpc.supervise.avoid, runs either way)
    assert "-m ddp_hpc.supervise " not in plain and "the supervisor" not in plain
    assert "--no-kill" not in plain and "exec srun" in plain
    with pytest.raises(SpecError, match="only the sbatch backend does, not submitit"):
        check_options(_spec(max_restarts=2, spare_nodes=1), get("submitit"))
    check_options(_spec(max_restarts=2), get("submitit"))      # the default alone is no request


def test_the_step_runs_no_kill_on_the_planned_nodes_with_one_task_per_gpu():
    s = Settings(Policy(nodes=2, tasks_per_node=4), "/logs", ("python", "t.py"), ("--cpu-bind=none",))
    args = step_args(s, ["n1", "n3"])
    assert args[:2] == ["--no-kill", "--kill-on-bad-exit=1"]
    assert {"--nodes=2", "--ntasks=8", "--ntasks-per-node=4", "--nodelist=n[1,3]",
            "--output=/logs/rank%t.out"} <= set(args)
    assert args[-3:] == ["--cpu-bind=none", "python", "t.py"]


def test_the_steps_environment_carries_the_restart_budget_unless_the_user_set_it():
    s = Settings(Policy(nodes=2, tasks_per_node=1, max_restarts=3), "/logs", ("python", "t.py"))
    env = step_env(s, {"PATH": "/bin", "DDP_HPC_ALLOC_RESTARTS": "9"}, 1)
    assert env == {"PATH": "/bin", "TORCHELASTIC_MAX_RESTARTS": "3", "DDP_HPC_ALLOC_RESTARTS": "1"}
    assert step_env(s, {"TORCHELASTIC_MAX_RESTARTS": "0"}, 0)["TORCHELASTIC_MAX_RESTARTS"] == "0"


def test_the_supervisor_command_line_refuses_bad_input(capsys):
    assert supervise_main(["--nodes", "0", "--tasks-per-node", "1", "--log-dir", "/x", "--", "true"]) == 2
    assert "--nodes 0 is not >= 1" in capsys.readouterr().err
    assert supervise_main(["--nodes", "1", "--tasks-per-node", "1", "--log-dir", "/x"]) == 2
    assert "HINT: end the options with -- COMMAND" in capsys.readouterr().err


def test_the_ranks_restart_number_counts_in_allocation_restarts():
    env = {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1", "DDP_HPC_RESTART_BASE": "2",
           "DDP_HPC_ALLOC_RESTARTS": "3"}
    f = job_facts(env)
    assert (f.restart_count, f.requeues, f.alloc_restarts) == (6, 1, 3)
    assert job_facts({"SLURM_JOB_ID": "7"}).restart_count == 0
    step = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1",
            "SLURM_STEP_ID": "1", "SLURM_NODEID": "0", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "n1",
            "SLURM_STEP_TASKS_PER_NODE": "1", "SLURMD_NODENAME": "n1", "DDP_HPC_ALLOC_RESTARTS": "2"}
    assert detect(step).restart_count == 2


def test_restarts_file_and_the_scheduler_runs_past_it(tmp_path: Path):
    append_restart(tmp_path, {"restart": 1, "job_id": "7", "why": "node n2 failed"})
    append_restart(tmp_path, {"restart": 2, "job_id": "7"})
    (tmp_path / "restarts.jsonl").open("a").write("not json\n")
    append_restart(tmp_path, {"restart": 4, "job_id": "8"})
    rows = read_restarts(tmp_path, "7")
    assert [r["restart"] for r in rows] == [1, 2] and rows[0]["why"] == "node n2 failed"
    # restarts 0, 1, 2 were one scheduler run (two in-allocation restarts); 3 its requeue
    assert [sched_index(r, 0, rows) for r in (0, 1, 2, 3)] == [0, 0, 0, 1]


def test_event_tail_reads_new_whole_lines_of_one_run(tmp_path: Path):
    f = tmp_path / "rank0.events.jsonl"
    f.write_text('{"event": "step", "restart": 0}\n{"event": "step", "restart": 1}\n{"event": "er')
    tail = EventTail(tmp_path, 1)
    assert tail.poll() == [{"event": "step", "restart": 1}]
    with f.open("a") as fh:
        fh.write('ror", "restart": 1}\n')
    assert tail.poll() == [{"event": "error", "restart": 1}] and tail.poll() == []


def test_a_resized_record_is_no_run_of_the_scheduler_history():
    """A --no-kill job that lost a node: sacct -D lists its record before the loss as RESIZING."""
    rows = [{"JobID": "1", "State": "RESIZING", "ExitCode": "0:0"},
            {"JobID": "1.batch", "State": "RESIZING", "ExitCode": "0:0"},
            {"JobID": "1", "State": "COMPLETED", "ExitCode": "0:0"}]
    st = _view_from_rows(rows, "sacct", [])
    assert st.info.job_state.name == "COMPLETED" and st.history == []


def _sinfo(states: dict):
    """A SlurmCLI whose sinfo answers ``states`` (node -> state), as a recording runner does."""
    def runner(argv, **kw):
        out = "".join(f"{n}\x1f{s}\n" for n, s in states.items()) if argv[0] == "sinfo" else ""
        return subprocess.CompletedProcess(argv, 0, out, "")
    return SlurmCLI(runner=runner, env={"PATH": os.environ.get("PATH", "")})


def _events(tmp_path: Path, *events: dict) -> None:
    with (tmp_path / "rank0.events.jsonl").open("a") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)


def test_the_watcher_stops_a_stalled_step_and_one_on_a_down_node(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(watch, "NODE_EVERY_S", 0.0)
    _events(tmp_path, {"event": "step", "restart": 0, "time": time.time() - 5})
    proc = subprocess.Popen(["sleep", "30"])
    try:
        end = watch.watch_step(proc, EventTail(tmp_path, 0), _sinfo({"n1": "mixed"}),
                               Watch(("n1",), stall_timeout_s=2.0, every_s=0.05))
        assert end.trigger == "stalled" and end.returncode is None and end.last_step_at
        end = watch.watch_step(proc, EventTail(tmp_path, 0), _sinfo({"n1": "mixed", "n2": "idle*"}),
                               Watch(("n1", "n2"), every_s=0.05))
        assert (end.trigger, end.down) == ("node down", ["n2"])
    finally:
        assert watch.stop_step(proc, timeout=5) == -2          # srun's abort: SIGINT
    done = subprocess.Popen(["sh", "-c", "exit 3"])
    assert watch.watch_step(done, EventTail(tmp_path, 0), _sinfo({}), Watch(("n1",), every_s=0.05)).returncode == 3


def test_the_watcher_gives_srun_a_grace_after_a_rank_failed(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(watch, "FAILED_GRACE_S", 0.2)
    _events(tmp_path, {"event": "error", "restart": 1, "time": time.time(), "message": "ValueError: bad input"})
    proc = subprocess.Popen(["sh", "-c", "sleep 1; exit 1"])        # a rank's own error: srun ends it
    end = watch.watch_step(proc, EventTail(tmp_path, 1), _sinfo({}), Watch(("n1",), every_s=0.05))
    assert (end.trigger, end.returncode, end.first_bad_at) == ("exited", 1, None)
    _events(tmp_path, {"event": "error", "restart": 1, "time": time.time(),
                       "message": "RuntimeError: [pair.cc:537] Connection reset by peer"})
    proc = subprocess.Popen(["sleep", "30"])                       # a lost peer: srun may wait long
    try:
        end = watch.watch_step(proc, EventTail(tmp_path, 1), _sinfo({}), Watch(("n1",), every_s=0.05))
        assert end.trigger == "rank failed" and end.first_bad_at
    finally:
        watch.stop_step(proc, timeout=5)


def test_a_rank_that_raised_keeps_its_exit_report_though_its_peers_lost_it(tmp_path: Path, monkeypatch):
    """Rank 3 raised, its peers lost it: the raising rank is on its way out and srun's report of its
    exit code comes when it is gone, so srun gets `RAISED_GRACE_S`, not the lost peer's short grace
    (a step killed at once after the peers' errors kept no report: a CI run's status showed no exit
    code for the rank that raised)."""
    monkeypatch.setattr(watch, "FAILED_GRACE_S", 0.2)
    monkeypatch.setattr(watch, "RAISED_GRACE_S", 10.0)
    now = time.time()
    _events(tmp_path, {"event": "error", "restart": 0, "time": now, "message": "InjectedFailure: rank 3"},
            {"event": "error", "restart": 0, "time": now + 0.1,
             "message": "RuntimeError: [pair.cc:537] Connection reset by peer"})
    proc = subprocess.Popen(["sh", "-c", "sleep 1.5; exit 1"])     # srun ends it once rank 3 exited
    end = watch.watch_step(proc, EventTail(tmp_path, 0), _sinfo({}), Watch(("n1",), every_s=0.05))
    assert (end.trigger, end.returncode) == ("exited", 1)
    monkeypatch.setattr(watch, "RAISED_GRACE_S", 0.5)              # a raising rank stuck in teardown
    proc = subprocess.Popen(["sleep", "30"])
    try:
        end = watch.watch_step(proc, EventTail(tmp_path, 0), _sinfo({}), Watch(("n1",), every_s=0.05))
        assert end.trigger == "rank failed" and end.first_bad_at
    finally:
        watch.stop_step(proc, timeout=5)
