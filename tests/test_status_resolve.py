"""The state resolver (`ddp_hpc.status.assemble.resolve`, the state from `ddp_hpc.judge.decide`):
what a job's row says when its sources disagree or say little. Logs are written as the ranks and
the supervisor write them; the scheduler answers like Slurm's squeue (rows as SlurmCLI returns
them); ``now`` is injected."""
import json

import pytest

from ddp_hpc import backends, records
from ddp_hpc.judge.decide import Described
from ddp_hpc.slurm.query import SourceState
from ddp_hpc.slurm.states import parse_state
from ddp_hpc.status.assemble import resolve
from ddp_hpc.status.collect import collect
from ddp_hpc.status.targets import JobSources, StatusTarget
from ddp_hpc.status.view import render_detail, render_table

T0 = 1_800_000_000.0


def ev(rank, name, t, restart=0, **extra):
    return {"time": T0 + t, "event": name, "rank": rank, "job_id": "91", "restart": restart, "host": "n1",
            **extra}


def write(d, rank, events):
    d.mkdir(parents=True, exist_ok=True)
    with open(d / f"rank{rank}.events.jsonl", "a") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)


class Squeue:
    """squeue lists job 91 RUNNING for ``used`` (its TimeUsed)."""

    def __init__(self, used):
        self.used = used

    def cluster_name(self):
        return "c1"

    def squeue(self, job_ids=None, **kw):
        return [{"JobID": "91", "JobArrayID": "91", "State": "RUNNING", "Reason": "None", "TimeUsed": self.used,
                 "TimeLimit": "1:00:00", "NumNodes": "2", "RestartCnt": "0", "NodeList": "n[1-2]", "Name": "demo"}]

    def sacct(self, job_ids, **kw):
        return []


def restarted_in_allocation(d):
    """Run 0 stepped for 40 s; the supervisor restarted the ranks inside the allocation (restart
    1, restarts.jsonl) and run 1 has stepped for 3 s."""
    for r in range(2):
        run0 = [ev(r, "start", 0, world_size=2, num_nodes=2)] + [ev(r, "step", s, step=s) for s in range(1, 41)]
        run1 = [ev(r, "start", 45, 1, world_size=2, num_nodes=2)] + [ev(r, "step", 45 + s, 1, step=40 + s)
                                                                       for s in range(1, 4)]
        write(d, r, run0 + run1)
    (d / "restarts.jsonl").write_text(json.dumps({"restart": 1, "job_id": "91", "detected_at": T0 + 42,
                                                  "trigger": "rank exited", "rank": 1}) + "\n")


@pytest.mark.parametrize("brief", [True, False])
def test_elapsed_after_an_in_allocation_restart_counts_from_the_allocations_first_run(tmp_path, brief):
    restarted_in_allocation(tmp_path)
    target = StatusTarget("91", None, str(tmp_path))
    # no scheduler: the logs alone; they end at the newest step, 48 s after the first run started
    st = collect([target], now=T0 + 60, brief=brief)[0]
    assert st.elapsed == "00:00:48", st.elapsed
    # a scheduler whose clock restarted with the new run (a --no-kill job's resize) counts 3 s
    st = collect([target], Squeue("0:03"), now=T0 + 49, brief=brief)[0]
    assert (st.state, st.elapsed) == ("RUNNING", "00:00:49")
    assert "00:00:49/01:00:00" in render_table([st])
    # a scheduler that counts longer (the job queued on nodes before its first run) is believed
    assert collect([target], Squeue("5:00"), now=T0 + 49, brief=brief)[0].elapsed == "00:05:00"


def test_elapsed_of_a_job_without_an_in_allocation_restart_is_the_schedulers(tmp_path):
    for r in range(2):
        write(tmp_path, r, [ev(r, "start", 0, world_size=2)] + [ev(r, "step", s, step=s) for s in range(1, 41)])
    st = collect([StatusTarget("91", None, str(tmp_path))], Squeue("0:03"), now=T0 + 41)[0]
    assert st.elapsed == "00:00:03" and "Elapsed:    00:00:03 / limit 01:00:00" in render_detail(st, now=T0 + 41)


def stopped_run(d, reason="preemption", requeued=False):
    """Both ranks stepped, then a signal stopped the run with a checkpoint (the training core's
    preempt and end events; ``requeued``: rank 0 requeued the job, as for the preemption signal)."""
    for r in range(2):
        evs = [ev(r, "start", 0, world_size=2)] + [ev(r, "step", s, step=s) for s in range(1, 11)]
        evs.append(ev(r, "preempt", 11, signal="SIGTERM" if not requeued else "SIGUSR2", reason=reason, step=10))
        evs += [ev(r, "requeue", 12, job_id="91")] if requeued and r == 0 else []
        evs.append(ev(r, "end", 13, status="preempted", step=10))
        write(d, r, evs)


def test_a_slurm_job_stopped_by_sigterm_says_the_logs_cannot_tell_scancel_from_a_preemption(tmp_path):
    """No scheduler source is left (squeue forgot the job, no sacct): its ranks' SIGTERM is what a
    plain scancel and a preemption both send."""
    stopped_run(tmp_path)
    st = collect([StatusTarget("91", None, str(tmp_path))], now=T0 + 60)[0]
    assert (st.state, st.source) == ("PREEMPTED (or scancel)", "logs")
    assert "both `scancel` and a preemption send" in st.reason and "cannot tell which" in st.reason
    assert "reason: stopped with a checkpoint on SIGTERM" in render_detail(st, now=T0 + 60)
    table = collect([StatusTarget("91", None, str(tmp_path))], now=T0 + 60, brief=True)[0]
    assert table.state == "PREEMPTED (or scancel)"


def test_a_requeue_or_a_time_limit_is_no_scancel(tmp_path):
    stopped_run(tmp_path / "requeued", requeued=True)
    stopped_run(tmp_path / "timelimit", reason="timelimit")
    got = collect([StatusTarget("91", None, str(tmp_path / "requeued")),
                   StatusTarget("92", None, str(tmp_path / "timelimit"))], now=T0 + 60)
    assert [(s.state, s.reason) for s in got] == [("REQUEUED (requeue requested)", None), ("PREEMPTED", None)]


def test_a_local_job_stopped_by_sigterm_is_no_preemption(tmp_path):
    """A local job has no scheduler that preempts: its SIGTERM states nothing uncertain."""
    stopped_run(tmp_path)
    st = collect([StatusTarget("local-x-1", None, str(tmp_path))], now=T0 + 60)[0]
    assert st.state == "PREEMPTED" and st.reason is None


def test_a_slurm_script_job_killed_by_sigterm_says_the_same(tmp_path):
    for r in range(2):   # ddp_hpc.exec forwarded the SIGTERM to the script and wrote its end
        write(tmp_path, r, [ev(r, "start", 0, world_size=2), ev(r, "step", 1, step=1),
                            ev(r, "end", 5, status="killed", signal="SIGTERM", exit_code=None)])
    slurm, local = collect([StatusTarget("91", None, str(tmp_path)),
                            StatusTarget("local-x-1", None, str(tmp_path))], now=T0 + 60)
    assert slurm.state == local.state == "CANCELLED by SIGTERM"
    assert "cannot tell which" in slurm.reason and local.reason is None


def test_the_header_names_the_nodes_the_newest_run_got(tmp_path, monkeypatch):
    """A 2-node job whose supervisor restarted it on 1 node (--min-nodes 1, a lost node): the
    header and the row say 1 node, as the newest run's start events do."""
    monkeypatch.setenv("DDP_HPC_HOME", str(tmp_path / "home"))
    d = tmp_path / "run"
    for r in range(2):
        write(d, r, [ev(r, "start", 0, world_size=4, num_nodes=2, device="cpu"), ev(r, "step", 1, step=1),
                     ev(r, "start", 45, 1, world_size=2, num_nodes=1, device="cpu"), ev(r, "step", 46, 1, step=2)])
    (d / "restarts.jsonl").write_text(json.dumps({"restart": 1, "job_id": "91", "world_before": 4,
                                                 "world_after": 2}) + "\n")
    rec = records.JobRecord(id="91", cluster="c1", name="demo", backend="sbatch", nodes=2, gpus_per_node=2,
                            time_limit="01:00:00", log_dir=str(d), config=None, overrides=[], submitted_at=T0,
                            cwd=str(tmp_path), command=["python", "t.py"])
    records.write_record(rec)
    target = StatusTarget("91", rec, str(d))
    detail = collect([target], Squeue("0:50"), now=T0 + 50)[0]
    assert render_detail(detail, now=T0 + 50).splitlines()[0] == \
        "Job 91 (demo), backend sbatch, 1 node x 2 processes on CPU"
    row = collect([target], Squeue("0:50"), now=T0 + 50, brief=True)[0]
    assert "1x2cpu" in render_table([row]).splitlines()[1].split()


def test_the_state_comes_from_the_first_source_that_knows_in_the_documented_order(tmp_path, monkeypatch):
    """scheduler -> record -> logs for a Slurm job; record -> processes/logs for a local one;
    ``--source`` names one source, and the record then does not stand in for it."""
    monkeypatch.setenv("DDP_HPC_HOME", str(tmp_path / "home"))
    for r in range(2):   # the logs say COMPLETED
        write(tmp_path / "run", r, [ev(r, "start", 0, world_size=2), ev(r, "end", 9, status="completed")])
    final = records.local_final("FAILED", T0, T0 + 9, "sacct")

    def rec(backend, job_id):
        return records.JobRecord(id=job_id, cluster="c1", name="demo", backend=backend, nodes=1, gpus_per_node=2,
                                 time_limit=None, log_dir=str(tmp_path / "run"), config=None, overrides=[],
                                 submitted_at=T0, cwd="/", final=final, pids=[])

    def state(target, sched=None, only=None):   # what the job's backend described: a scheduler's, or none
        scheduled = backends.of_record(target.record, job_id=target.id).describes_with == "slurm"
        r = resolve(JobSources(target, Described(scheduled, sched), T0 + 60, only))
        return r.state.info.label, r.state.source

    running = collect([StatusTarget("91", None, str(tmp_path / "run"))], Squeue("0:30"), now=T0 + 60)[0]
    slurm = StatusTarget("91", rec("sbatch", "91"), str(tmp_path / "run"))
    sched = SourceState(parse_state("RUNNING"), "squeue", [])
    assert (running.state, running.source) == ("RUNNING", "squeue")
    assert state(slurm, sched) == ("RUNNING", "squeue")                     # 1. the scheduler
    assert state(slurm, SourceState(parse_state("FOO"), "squeue", [])) == ("FAILED", "record")   # it cannot name it
    assert state(slurm) == ("FAILED", "record")                             # 2. the record
    assert state(slurm, only="logs") == ("COMPLETED", "logs")               # --source logs: not the record
    assert state(StatusTarget("91", None, str(tmp_path / "run"))) == ("COMPLETED", "logs")   # 3. the logs
    local = StatusTarget("local-x-1", rec("local", "local-x-1"), str(tmp_path / "run"))
    assert state(local, only="logs") == ("FAILED", "record")               # a local job's record first
