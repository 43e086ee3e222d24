"""Which source answers: squeue, else sacct, else sacct -c, else the logs; and it is named.

The Slurm side here is ddp_hpc.slurm.cli.SlurmCLI with a recording process runner that answers
the way Slurm 22.05 does (same separators, same error text); the real scheduler is exercised in
tests/cluster/test_status_cluster.py. The subject, the precedence and parsing in
ddp_hpc.slurm.query, runs unmodified.
"""
import subprocess
from pathlib import Path

from ddp_hpc.slurm import cli as slurmcli
from ddp_hpc.slurm import query as src
from ddp_hpc.slurm.states import JobState
from ddp_hpc.slurm.times import timestamp

SEP = slurmcli.SEP
DISABLED = "sacct: error: Slurm accounting storage is disabled\n"


def squeue_row(**kw):
    base = dict(JobArrayID="5", JobID="5", ArrayJobID="5", ArrayTaskID="N/A", State="RUNNING",
                Reason="None", TimeUsed="1:05", TimeLimit="10:00", NumNodes="2", RestartCnt="0",
                NodeList="n[1-2]", Partition="debug", UserName="root",
                SubmitTime="2026-11-22T15:00:00", StartTime="2026-11-22T15:00:01", EndTime="N/A",
                Name="demo")
    base.update(kw)
    return "".join(f"{base[f]}{SEP}" for f in slurmcli.SQUEUE_FIELDS)


def sacct_row(**kw):
    base = dict(JobID="5", JobIDRaw="5", State="COMPLETED", ExitCode="0:0", Elapsed="00:01:10",
                Timelimit="00:10:00", NNodes="2", NodeList="n[1-2]", Partition="debug",
                Submit="2026-11-22T15:00:00", Start="2026-11-22T15:00:01",
                End="2026-11-22T15:01:11", JobName="demo")
    base.update(kw)
    return SEP.join(base[f] for f in slurmcli.SACCT_FIELDS)


class Scheduler:
    """Answers squeue / sacct / sacct -c argv like Slurm; records every call."""

    def __init__(self, squeue=(), sacct=None, sacct_c=None, sacct_d=None, controller_down=False):
        self.squeue, self.sacct, self.sacct_c, self.sacct_d = list(squeue), sacct, sacct_c, sacct_d
        self.controller_down = controller_down
        self.calls = []

    def __call__(self, argv, *, input=None, cwd=None, env=None, timeout=None):
        self.calls.append(list(argv))
        if self.controller_down and argv[0] in ("squeue", "scontrol"):
            return subprocess.CompletedProcess(
                argv, 1, "", "slurm_load_ctl_conf error: Unable to contact slurm controller (connect failure)\n")
        if argv[0] == "squeue":
            return self._ok(self.squeue)
        if argv[0] == "scontrol":
            return self._ok(["ClusterName=test"])
        if argv[0] == "sacct":
            rows = self.sacct_c if "--completion" in argv else (
                self.sacct_d if "--duplicates" in argv and self.sacct_d is not None else self.sacct)
            if rows is None:
                return subprocess.CompletedProcess(argv, 1, "", DISABLED)
            return self._ok(rows)
        raise AssertionError(argv)

    @staticmethod
    def _ok(lines):
        return subprocess.CompletedProcess([], 0, "".join(line + "\n" for line in lines), "")


def query(sched, ids=("5",), **kw):
    return src.query_slurm(list(ids), slurmcli.SlurmCLI(runner=sched), **kw)


def test_squeue_answers_first_and_sacct_is_not_asked():
    sched = Scheduler(squeue=[squeue_row()])
    found, tried = query(sched)
    st = found["5"]
    assert (st.info.job_state, st.source) == (JobState.RUNNING, "squeue")
    # squeue's M:SS comes out in the one duration format ddp_hpc shows: [D-]HH:MM:SS
    assert (st.elapsed, st.time_limit, st.nodes, st.restarts) == ("00:01:05", "00:10:00", 2, 0)
    assert [c[0] for c in sched.calls] == ["squeue"]


def test_sacct_when_squeue_forgot_the_job():
    sched = Scheduler(sacct=[sacct_row(State="CANCELLED by 0", ExitCode="0:15"),
                             sacct_row(JobID="5.batch", JobIDRaw="5.batch", State="CANCELLED",
                                       ExitCode="0:15", JobName="batch")])
    found, tried = query(sched)
    st = found["5"]
    assert (st.info.job_state, st.info.label, st.source) == (JobState.CANCELLED, "CANCELLED by 0", "sacct")
    assert st.exit_code == "0:15"
    assert st.steps == [{"id": "5.batch", "state": "CANCELLED", "exit_code": "0:15"}]
    assert any("squeue" in t for t in st.tried)


def test_jobcomp_only_cluster_falls_back_to_sacct_c_and_says_why():
    # sacct -c gives the time limit in minutes (Slurm 22.05)
    sched = Scheduler(sacct=None, sacct_c=[sacct_row(State="FAILED", ExitCode="1:0", Timelimit="10")])
    found, tried = query(sched)
    st = found["5"]
    assert (st.info.job_state, st.source, st.exit_code) == (JobState.FAILED, "sacct -c", "1:0")
    assert (st.elapsed, st.time_limit) == ("00:01:10", "00:10:00")
    assert any(t.startswith("sacct:") and "accounting storage is disabled" in t for t in st.tried)


def test_no_source_knows_the_job():
    sched = Scheduler(sacct=None, sacct_c=[])
    found, tried = query(sched, ids=("9",))
    assert found == {}
    assert [t.split(":")[0] for t in tried] == ["squeue", "sacct", "sacct -c"]


def test_requeue_history_from_sacct_duplicates():
    sched = Scheduler(squeue=[squeue_row(State="PENDING", RestartCnt="1", Reason="BeginTime")],
                      sacct=[sacct_row(State="PENDING")],
                      sacct_d=[sacct_row(State="REQUEUED", ExitCode="0:0"),
                               sacct_row(JobID="5.0", JobIDRaw="5.0", State="CANCELLED", JobName="python"),
                               sacct_row(State="PENDING", Start="Unknown", End="Unknown")])
    found, _ = query(sched, history=True)
    st = found["5"]
    assert (st.info.job_state, st.source, st.reason) == (JobState.PENDING, "squeue", "BeginTime")
    assert st.history_source == "sacct -D"
    assert [h["state"] for h in st.history] == ["REQUEUED", "PENDING"]
    assert st.restarts == 1
    assert any("--duplicates" in c for c in sched.calls)


def test_requeue_history_from_jobcomp_when_no_accounting():
    sched = Scheduler(sacct=None, sacct_c=[sacct_row(State="REQUEUED"), sacct_row(State="COMPLETED")])
    found, _ = query(sched, history=True)
    st = found["5"]
    assert (st.info.job_state, st.source, st.history_source) == (JobState.COMPLETED, "sacct -c", "sacct -c")
    assert [h["state"] for h in st.history] == ["REQUEUED", "COMPLETED"]


def test_reused_id_of_another_job_is_not_taken():
    submitted = timestamp("2026-11-22T15:00:00")
    sched = Scheduler(squeue=[squeue_row(Name="someone-else")], sacct=None, sacct_c=[])
    found, _ = query(sched, expect={"5": {"name": "demo", "submitted_at": submitted}})
    assert "5" not in found
    # a never-restarted job submitted an hour after our record is a later job with the same id
    sched = Scheduler(squeue=[squeue_row(SubmitTime="2026-11-22T16:00:00")], sacct=None, sacct_c=[])
    found, _ = query(sched, expect={"5": {"name": "demo", "submitted_at": submitted}})
    assert "5" not in found
    sched = Scheduler(squeue=[squeue_row()])
    found, _ = query(sched, expect={"5": {"name": "demo", "submitted_at": submitted + 2}})
    assert found["5"].source == "squeue"


def test_array_tasks_are_their_own_jobs():
    sched = Scheduler(squeue=[squeue_row(JobArrayID="7_0", JobID="8", State="COMPLETING"),
                              squeue_row(JobArrayID="7_1", JobID="9", State="R")])
    found, _ = query(sched, ids=("7_0", "7_1"))
    assert found["7_0"].info.job_state is JobState.COMPLETING
    assert found["7_1"].info.job_state is JobState.RUNNING


def test_unknown_state_from_the_scheduler_is_shown_raw():
    sched = Scheduler(squeue=[squeue_row(State="WARPING")])
    found, _ = query(sched)
    assert found["5"].info.job_state is JobState.UNKNOWN
    assert found["5"].info.label == "UNKNOWN(WARPING)"


def test_controller_down_skips_squeue_and_asks_the_completion_log(tmp_path):
    from ddp_hpc.status.collect import StatusTarget, collect
    sched = Scheduler(sacct=None, sacct_c=[sacct_row(State="TIMEOUT", ExitCode="0:15")],
                      controller_down=True)
    (st,) = collect([StatusTarget("5", None, str(tmp_path))], slurmcli.SlurmCLI(runner=sched))
    assert (st.state, st.source) == ("TIMEOUT", "sacct -c")
    assert "squeue" not in [c[0] for c in sched.calls]
    assert any("controller does not answer" in t for t in st.tried)


def test_only_one_source_is_asked_when_named():
    sched = Scheduler(squeue=[squeue_row()], sacct=[sacct_row(State="RUNNING")],
                      sacct_c=[sacct_row(State="COMPLETED")])
    found, _ = query(sched, only="sacct -c")
    assert (found["5"].info.job_state, found["5"].source) == (JobState.COMPLETED, "sacct -c")
    assert [c[0] for c in sched.calls] == ["sacct"] and "--completion" in sched.calls[0]


def _events(d, rank, *evs):
    import json
    with open(d / f"rank{rank}.events.jsonl", "a") as f:
        for i, (event, kw) in enumerate(evs):
            f.write(json.dumps({"time": 100 + rank + i, "event": event, "rank": rank, "job_id": "5",
                                "restart": 0, "host": "n1", **kw}) + "\n")


def test_failing_rank_guess_only_for_jobs_that_broke(tmp_path):
    """A cancelled job's ranks all stop without `end`: no rank is blamed. A FAILED job with the
    same logs gets the rank whose events stopped first as the suspect."""
    from ddp_hpc.status.collect import StatusTarget, collect
    for r in range(2):
        _events(tmp_path, r, ("start", {"world_size": 2}), ("step", {"step": 4 + r, "total_steps": 9}))
    for state, blamed in (("CANCELLED by 0", None), ("TIMEOUT", None), ("FAILED", 0), ("NODE_FAIL", 0)):
        sched = Scheduler(sacct=[sacct_row(State=state, ExitCode="0:15")])
        (st,) = collect([StatusTarget("5", None, str(tmp_path))], slurmcli.SlurmCLI(runner=sched))
        assert st.state.split()[0] == state.split()[0]
        assert (st.failure.rank if st.failure else None) == blamed, state


def _record(home, job_id, log_dir, array=None):
    from ddp_hpc import records
    rec = records.JobRecord(id=job_id, cluster="test", name="demo", backend="sbatch", nodes=2,
                            gpus_per_node=2, time_limit="00:30:00", log_dir=str(log_dir), config=None,
                            overrides=[], submitted_at=timestamp("2026-11-22T15:00:00"), cwd=str(home),
                            array=array)
    records.write_record(rec)
    return records.load_record(job_id)


def test_final_state_is_kept_in_the_record_and_wins_once_slurm_forgot_the_job(tmp_path, monkeypatch):
    """FAILED with its elapsed time and limit, as sacct said it; after the cluster went down the
    record tells the same, instead of UNKNOWN with times from the logs."""
    from ddp_hpc import records
    from ddp_hpc.status.collect import collect
    from ddp_hpc.status.targets import targets_from_records
    monkeypatch.setenv("DDP_HPC_HOME", str(tmp_path / "home"))
    for r in range(2):
        _events(tmp_path, r, ("start", {"world_size": 2}), ("step", {"step": 4, "total_steps": 9}))
    (tmp_path / "slurm-5.out").write_text("srun: error: n1: task 1: Exited with exit code 3\n")
    rec = _record(tmp_path, "5", tmp_path)
    sched = Scheduler(sacct=[sacct_row(State="FAILED", ExitCode="3:0", Elapsed="00:07:41", Timelimit="00:30:00")])
    (st,) = collect(targets_from_records([rec]), slurmcli.SlurmCLI(runner=sched), now=2e9)
    assert (st.state, st.source, st.elapsed) == ("FAILED", "sacct", "00:07:41")
    final = records.load_record("5").final
    assert {k: final[k] for k in ("state", "state_name", "source", "elapsed", "time_limit", "exit_code",
                                  "rank_exit_codes", "seen_at")} == {
        "state": "FAILED", "state_name": "FAILED", "source": "sacct", "elapsed": "00:07:41",
        "time_limit": "00:30:00", "exit_code": "3:0", "rank_exit_codes": {"1": 3}, "seen_at": 2e9}
    path = Path(records.load_record("5").path)
    mtime = path.stat().st_mtime_ns
    collect(targets_from_records([records.load_record("5")]), slurmcli.SlurmCLI(runner=sched), now=2e9 + 60)
    assert path.stat().st_mtime_ns == mtime  # the same facts seen again: the record is not rewritten
    down = Scheduler(sacct=None, sacct_c=None, controller_down=True)
    (st,) = collect(targets_from_records([records.load_record("5")]), slurmcli.SlurmCLI(runner=down))
    assert (st.state, st.source, st.elapsed, st.time_limit, st.exit_code) == (
        "FAILED", "record", "00:07:41", "00:30:00", "3:0")
    assert st.tried[-1].startswith("record: the final state sacct reported at ")
    assert st.rank_exit_codes == {1: 3} and st.failure.rank == 1


def test_an_array_keeps_a_final_state_per_task(tmp_path, monkeypatch):
    from ddp_hpc import records
    from ddp_hpc.status.collect import collect
    from ddp_hpc.status.targets import targets_from_records
    monkeypatch.setenv("DDP_HPC_HOME", str(tmp_path / "home"))
    tasks = [{"task_id": i, "overrides": [f"seed={i}"], "log_dir": str(tmp_path / str(i))} for i in (0, 1)]
    rec = _record(tmp_path, "7", tmp_path, array=tasks)
    sched = Scheduler(sacct=[sacct_row(JobID="7_0", JobIDRaw="8", State="COMPLETED", ExitCode="0:0"),
                             sacct_row(JobID="7_1", JobIDRaw="9", State="TIMEOUT", ExitCode="0:15",
                                       Elapsed="00:30:02")])
    sts = collect(targets_from_records([rec]), slurmcli.SlurmCLI(runner=sched))
    assert [(s.id, s.state, s.overrides) for s in sts] == [("7_0", "COMPLETED", ["seed=0"]),
                                                          ("7_1", "TIMEOUT", ["seed=1"])]
    final = records.load_record("7").final
    assert (final["0"]["state"], final["1"]["state"], final["1"]["elapsed"]) == ("COMPLETED", "TIMEOUT", "00:30:02")
    down = Scheduler(sacct=None, sacct_c=[])
    sts = collect(targets_from_records([records.load_record("7")]), slurmcli.SlurmCLI(runner=down))
    assert [(s.state, s.source) for s in sts] == [("COMPLETED", "record"), ("TIMEOUT", "record")]
