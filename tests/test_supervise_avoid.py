"""preempt.exclude_failed_nodes (ddp_hpc.supervise.avoid): which nodes failed earlier runs of a job, by
its run logs (and sacct -D when it answers), and the Slurm commands that keep a requeued job off
them. The run logs are written the way a 2-node x 2-task job leaves them when node n2 dies; the
Slurm commands go to a recording runner here (the real cluster run is
tests/cluster/test_nodefail_cluster.py)."""

import dataclasses
import io
import json
import subprocess

import pytest

from ddp_hpc.env import job_facts
from ddp_hpc.runlogs.restarts import append_health
from ddp_hpc.slurm.cli import SlurmArgumentError, SlurmCLI
from ddp_hpc.supervise.avoid import REQUEUED, check_placement, failed_nodes

T0 = 1_760_000_000.0
CLOSED = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4321"


def ev(rank, t, event, restart=0, **kw):
    return {"time": T0 + t + 1000 * restart, "event": event, "rank": rank, "job_id": "77",
            "restart": restart, "host": f"n{rank // 2 + 1}" if restart == 0 else f"n{rank // 2 + 3}", **kw}


def run(rank, steps, restart=0, end=None):
    evs = [ev(rank, 0, "start", restart, world_size=4, num_nodes=2, local_rank=rank % 2, pid=100 + rank)]
    evs += [ev(rank, s, "step", restart, epoch=0, step=s, total_steps=100, loss=1.0) for s in range(1, steps + 1)]
    return evs + ([ev(rank, steps + 0.5, "end", restart, status=end, step=steps)] if end else [])


def write(d, rank, events):
    with open(d / f"rank{rank}.events.jsonl", "a") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)


def node2_died(d, then_restart=True):
    """Restart 0 on n1, n2: n2's ranks stop writing, n1's lose their peers; restart 1 on n3, n4."""
    for r in (0, 1):
        write(d, r, run(r, 40) + [ev(r, 40.5, "error", exc_type="RuntimeError", message=CLOSED),
                                  ev(r, 40.6, "end", status="failed", step=40)])
    for r in (2, 3):
        write(d, r, run(r, 40))
    if then_restart:
        for r in range(4):
            write(d, r, run(r, 5, restart=1))


class Recorder:
    """Answers every command with ``stdout``; keeps the argv of each call."""

    def __init__(self, stdout=""):
        self.calls, self.stdout = [], stdout

    def __call__(self, argv, *, input=None, cwd=None, env=None, timeout=None):
        self.calls.append(list(argv))
        ok = argv[0] == "scontrol"   # squeue/sacct "fail": no accounting, the logs decide
        return subprocess.CompletedProcess(argv, 0 if ok else 1, self.stdout if ok else "",
                                           "" if ok else "sacct: error: accounting storage is disabled")

    def scontrol(self):
        return [c for c in self.calls if c[0] == "scontrol"]


def test_the_node_whose_ranks_vanished_failed_the_earlier_run(tmp_path):
    node2_died(tmp_path)
    assert failed_nodes(tmp_path, before=1) == ["n2"]
    assert failed_nodes(tmp_path, before=0) == []          # nothing earlier than restart 0
    (tmp_path / "slurm-77.out").write_text("srun: error: Node failure on n7\n")
    assert failed_nodes(tmp_path, before=1) == ["n2", "n7"]  # srun's own words count too


def test_a_rank_that_raised_is_not_a_failed_node(tmp_path):
    for r in range(4):
        evs = run(r, 10)
        if r == 3:
            evs += [ev(3, 10.2, "error", exc_type="ValueError", message="bad batch"),
                    ev(3, 10.3, "end", status="failed", step=10)]
        else:
            evs += [ev(r, 10.4, "error", exc_type="RuntimeError", message=CLOSED),
                    ev(r, 10.5, "end", status="failed", step=10)]
        write(tmp_path, r, evs + run(r, 2, restart=1))
    assert failed_nodes(tmp_path, before=1) == []


def _facts(nodes, restart="1"):
    return job_facts({"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": restart, "SLURM_JOB_NODELIST": nodes})


def test_a_restart_placed_on_the_failed_node_requeues_itself_off_it(tmp_path):
    node2_died(tmp_path, then_restart=False)
    rec, out = Recorder(stdout="JobId=77 JobName=demo ExcNodeList=n4 Restarts=1\n"), io.StringIO()
    assert check_placement(tmp_path, _facts("n[1-2]"), SlurmCLI(runner=rec), out=out) == REQUEUED
    assert rec.scontrol() == [["scontrol", "requeue", "77"], ["scontrol", "show", "job", "-o", "77"],
                              ["scontrol", "update", "JobId=77", "ExcNodeList=n[2,4]"]]
    assert "restart 1 landed on n2, which failed an earlier run" in out.getvalue()


def test_a_restart_elsewhere_goes_on_and_a_first_run_asks_nothing(tmp_path):
    node2_died(tmp_path, then_restart=False)
    rec, out = Recorder(), io.StringIO()
    assert check_placement(tmp_path, _facts("n[3-4]"), SlurmCLI(runner=rec), out=out) == 0
    assert rec.scontrol() == [] and "n2 failed an earlier run; this run is elsewhere" in out.getvalue()
    rec = Recorder()
    assert check_placement(tmp_path, _facts("n[1-2]", restart="0"), SlurmCLI(runner=rec)) == 0
    assert rec.calls == []


def test_requeue_with_exclude_validates_node_names_first():
    rec = Recorder()
    with pytest.raises(SlurmArgumentError, match="invalid node name"):
        SlurmCLI(runner=rec).requeue("77", exclude=["n1", "-x;reboot"])
    assert rec.calls == []
    SlurmCLI(runner=rec).requeue("77")
    assert rec.calls == [["scontrol", "requeue", "77"]]       # no exclusion: one command


def test_a_resumed_jobs_first_run_asks_nothing_and_its_requeue_checks(tmp_path):
    """A job that resumed a stopped run starts at restart DDP_HPC_RESTART_BASE: the placement
    check runs on the scheduler's requeues of the job, not on its first run."""
    node2_died(tmp_path, then_restart=False)   # the earlier job's restart 0 lost n2
    facts = job_facts({"SLURM_JOB_ID": "78", "SLURM_RESTART_COUNT": "0", "SLURM_JOB_NODELIST": "n[1-2]",
                       "DDP_HPC_RESTART_BASE": "1"})
    rec = Recorder()
    assert check_placement(tmp_path, facts, SlurmCLI(runner=rec)) == 0 and rec.calls == []
    requeued = dataclasses.replace(facts, restart_count=2)   # its first requeue
    rec, out = Recorder(stdout="JobId=78 JobName=demo ExcNodeList=(null) Restarts=1\n"), io.StringIO()
    assert check_placement(tmp_path, requeued, SlurmCLI(runner=rec), out=out) == REQUEUED
    assert "restart 2 landed on n2, which failed an earlier run" in out.getvalue()


def test_a_node_the_health_check_excluded_is_avoided_by_a_requeue(tmp_path):
    """The supervisor's health check excluded n2 (a full scratch) before the first start, and the
    job was requeued later (preempted): the requeued run that lands on n2 leaves it."""
    append_health(tmp_path, {"health_check": 0, "job_id": "77", "time": T0, "seconds": 0.3,
                             "excluded": {"n2": "/tmp full (0.0 GB free, checkpoint needs 0.1 GB)"},
                             "nodes_after": ["n1", "n3"], "not_started": None})
    assert failed_nodes(tmp_path) == ["n2"]                   # before any rank logged
    for r in range(4):
        write(tmp_path, r, run(r, 5))
    assert failed_nodes(tmp_path, job_id="77") == ["n2"]
    assert failed_nodes(tmp_path, job_id="76") == []          # another job's check
    rec, out = Recorder(stdout="JobId=77 JobName=demo ExcNodeList=(null) Restarts=1\n"), io.StringIO()
    assert check_placement(tmp_path, _facts("n[1-2]"), SlurmCLI(runner=rec), out=out) == REQUEUED
    assert rec.scontrol()[-1] == ["scontrol", "update", "JobId=77", "ExcNodeList=n2"]
