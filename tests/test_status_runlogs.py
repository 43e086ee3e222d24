"""Reading run logs: last event per rank, the first failing rank, progress/ETA, requeued runs.

The inputs are real files in the format of docs/architecture.md ("Run logs"); one test writes
them with the training core's own writer to pin the contract between the two modules.
"""
import json

import pytest

from ddp_hpc.judge.reader import RunLogs, read_events, traceback_in

T0 = 1_800_000_000.0


def ev(rank, t, event, restart=0, **kw):
    return {"time": T0 + t, "event": event, "rank": rank, "job_id": "42", "restart": restart,
            "host": f"n{rank // 2 + 1}", **kw}


def write(d, rank, events, tail=""):
    with open(d / f"rank{rank}.events.jsonl", "a") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")
        f.write(tail)


def start(rank, t=0, restart=0, total=100, ws=4):
    return ev(rank, t, "start", restart, world_size=ws, num_nodes=2, local_rank=rank % 2, pid=100 + rank,
              total_steps=total, epochs=2, launcher="slurm")


def step(rank, t, s, restart=0, total=100, loss=1.0):
    return ev(rank, t, "step", restart, epoch=s // 50, step=s, total_steps=total, loss=loss, lr=0.1,
              samples_per_s=800.0, rss_mb=200.0, cpu_percent=90.0)


def test_progress_and_eta_from_rank0_steps(tmp_path):
    for r in range(4):
        write(tmp_path, r, [start(r)] + [step(r, 10 + s, s, loss=1 / (s + 1)) for s in (10, 20, 30)])
    logs = RunLogs(tmp_path)
    p = logs.progress()
    assert (p.epoch, p.step, p.total_steps) == (0, 30, 100)
    assert p.percent == pytest.approx(30.0)
    assert p.loss == pytest.approx(1 / 31)
    assert p.samples_per_s == 800.0
    # 20 steps in 20 s -> 1 step/s; 70 steps left
    assert p.eta_s == pytest.approx(70.0)
    assert logs.outcome() is None
    assert logs.first_failure() is None
    assert sorted(logs.last_events()) == [0, 1, 2, 3]
    assert logs.last_events()[2]["step"] == 30


def test_first_failure_is_earliest_error_not_the_echoes(tmp_path):
    tb = ('Traceback (most recent call last):\n  File "m.py", line 3, in f\n    raise ValueError("bad")\n'
          'ValueError: bad batch on rank 3')
    for r in range(4):
        evs = [start(r), step(r, 5, 10)]
        if r == 3:
            evs.append(ev(3, 7, "error", exc_type="ValueError", message="bad batch on rank 3", traceback=tb))
            evs.append(ev(3, 7.1, "end", status="failed", step=10))
        else:  # the others die of the lost peer, later
            evs.append(ev(r, 9 + r, "error", exc_type="RuntimeError", message="Connection reset by peer",
                          traceback="Traceback...\nRuntimeError: Connection reset by peer"))
        write(tmp_path, r, evs)
    logs = RunLogs(tmp_path)
    f = logs.first_failure()
    assert f.rank == 3 and f.exc_type == "ValueError" and f.message == "bad batch on rank 3"
    assert f.basis == "error event" and f.host == "n2"
    assert f.traceback_tail[-1] == "ValueError: bad batch on rank 3"
    assert logs.outcome() == "failed"


def test_traceback_in_rank_out_when_no_error_event(tmp_path):
    for r in range(4):
        write(tmp_path, r, [start(r), step(r, 5, 10)])
        (tmp_path / f"rank{r}.out").write_text("starting\n")
    (tmp_path / "rank2.out").write_text(
        "starting\nTraceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
        "    import nothing\nModuleNotFoundError: No module named 'nothing'\nsrun: error: more\n")
    f = RunLogs(tmp_path).first_failure(assume_failed=True)
    assert f.rank == 2 and f.basis == "traceback in rank2.out"
    assert f.exc_type == "ModuleNotFoundError" and "nothing" in f.message
    assert traceback_in(tmp_path / "rank0.out") is None


def test_srun_exit_report_and_stopped_stream(tmp_path):
    for r in range(4):
        write(tmp_path, r, [start(r), step(r, 5, 10)] + ([step(r, 9, 20)] if r != 1 else []))
    logs = RunLogs(tmp_path)
    # killed with no trace at all: the job failed, rank 1's stream stopped first
    f = logs.first_failure(assume_failed=True)
    assert (f.rank, f.basis) == (1, "events stopped first")
    (tmp_path / "slurm-42.out").write_text(
        "srun: error: n1: task 1: Exited with exit code 7\nsrun: error: n1: tasks 0,2-3: Killed\n")
    assert logs.srun_exit_codes() == {0: -1, 1: 7, 2: -1, 3: -1}
    f = logs.first_failure(assume_failed=True)
    assert (f.rank, f.basis, f.message) == (1, "srun exit report", "exit code 7")


def test_requeued_job_keeps_both_runs(tmp_path):
    for r in range(2):
        write(tmp_path, r, [start(r, total=60, ws=2), step(r, 5, 10, total=60),
                            ev(r, 6, "preempt", signal="USR2", reason="preemption", step=12),
                            ev(r, 6.5, "checkpoint", step=12, path="/ck/12.pt")]
              + ([ev(0, 6.6, "requeue", job_id="42")] if r == 0 else [])
              + [ev(r, 7, "end", status="preempted", step=12)])
        write(tmp_path, r, [start(r, 30, restart=1, total=60, ws=2), step(r, 40, 30, restart=1, total=60),
                            step(r, 50, 60, restart=1, total=60),
                            ev(r, 51, "end", restart=1, status="completed", step=60)])
    logs = RunLogs(tmp_path)
    runs = logs.runs()
    assert [r.restart for r in runs] == [0, 1]
    assert (runs[0].end_status, runs[0].preempt_reason, runs[0].requeued, runs[0].last_step) == \
        ("preempted", "preemption", True, 12)
    assert (runs[1].end_status, runs[1].last_step) == ("completed", 60)
    assert logs.outcome() == "completed"
    assert logs.first_failure() is None
    p = logs.progress()
    assert p.step == 60 and p.percent == 100.0 and p.eta_s == 0.0


def test_completed_only_when_every_rank_ended(tmp_path):
    for r in range(4):
        write(tmp_path, r, [start(r), step(r, 5, 100)]
              + ([ev(r, 6, "end", status="completed", step=100)] if r != 2 else []))
    logs = RunLogs(tmp_path)
    assert logs.outcome() is None  # rank 2 has no end yet
    f = logs.first_failure()  # some ended, rank 2 did not: it is the suspect
    assert (f.rank, f.basis) == (2, "events stopped first")


def test_half_written_and_garbage_lines_are_skipped(tmp_path):
    write(tmp_path, 0, [start(0), step(0, 3, 5)], tail='{"time": 1, "event": "st')
    with open(tmp_path / "rank0.events.jsonl", "a") as f:
        f.write("\nnot json\n[1, 2]\n")
    logs = RunLogs(tmp_path)
    assert logs.ranks[0].bad_lines == 3
    assert logs.ranks[0].last["event"] == "step"


def test_event_lines_decode_as_json_loads_does(tmp_path):
    """A line is decoded without json.loads's wrappers only when it is one value from its first
    character to its last: what json.loads makes of every other line (spaces around, two objects
    on one line, one object over two lines) is kept."""
    good = [json.dumps(start(0)), json.dumps(step(0, 3, 5)), "  " + json.dumps(step(0, 4, 6)) + " ", "null"]
    odd = ['{"event": "a", "time": 1}, {"event": "b", "time": 2}', '{"event": "c", "k": [1', '2]}']
    for name, lines, events, bad in (("intact", good, 3, 1), ("run together", good + odd, 3, 4)):
        path = tmp_path / name / "rank0.events.jsonl"
        path.parent.mkdir()
        path.write_text("\n".join(lines) + "\n\n")
        stream = read_events(path)
        assert (len(stream.events), stream.bad_lines) == (events, bad), name
        assert [e["event"] for e in stream.events] == ["start", "step", "step"]


@pytest.mark.parametrize("where", ["nope", None])
def test_missing_dir_is_empty_not_an_error(tmp_path, where):
    logs = RunLogs(tmp_path / where if where else None)
    assert not logs.exists and logs.progress() is None and logs.first_failure() is None
    assert logs.outcome() is None and logs.runs() == [] and logs.srun_exit_codes() == {}


def test_contract_with_the_training_core_writer(tmp_path):
    from ddp_hpc.runlogs import writer as runlog
    for r in range(2):
        log = runlog.RunLog(tmp_path, rank=r, job_id="7", restart=0, console=False)
        log.event("start", world_size=2, num_nodes=1, local_rank=r, pid=1, total_steps=10,
                  epochs=1, launcher="local")
        log.event("step", epoch=0, step=5, total_steps=10, loss=0.5, lr=0.1, samples_per_s=10.0,
                  rss_mb=1.0, cpu_percent=1.0)
        if r == 1:
            log.event("error", exc_type="KeyError", message="'x'", traceback="Traceback\nKeyError: 'x'")
            log.event("end", status="failed", step=5)
        else:
            log.event("end", status="completed", step=10)
        log.close()
    logs = RunLogs(tmp_path)
    assert logs.outcome() == "failed"
    assert logs.first_failure().rank == 1 and logs.first_failure().exc_type == "KeyError"
    assert logs.progress().total_steps == 10


def test_files_named_by_the_schema_are_the_ones_read(tmp_path):
    from ddp_hpc.runlogs import schema
    (tmp_path / schema.events_file(5)).write_text(json.dumps(start(5, ws=6)) + "\n")
    (tmp_path / schema.text_log(5)).write_text("x\n")
    (tmp_path / schema.rank_out(5)).write_text("Traceback (most recent call last):\nKeyError: 'k'\n")
    (tmp_path / schema.batch_out("42")).write_text("srun: error: n1: task 5: Exited with exit code 3\n")
    logs = RunLogs(tmp_path)
    assert (list(logs.ranks), list(logs.texts), list(logs.outs)) == ([5], [5], [5])
    assert logs.srun_exit_codes() == {5: 3}
    assert logs.first_failure(assume_failed=True).basis == f"traceback in {schema.rank_out(5)}"


def test_device_of_the_newest_run(tmp_path):
    assert RunLogs(tmp_path).device() is None
    write(tmp_path, 0, [start(0)])  # an older writer: no device key
    assert RunLogs(tmp_path).device() is None
    write(tmp_path, 1, [{**start(1), "device": "cuda:1"}])
    write(tmp_path, 0, [{**start(0, t=50, restart=1), "device": "cpu"}])
    assert RunLogs(tmp_path).device() == "cpu"  # restart 1 ran on the CPU
    write(tmp_path, 1, [{**start(1, t=50, restart=1), "device": "cuda:1"}])
    assert RunLogs(tmp_path).device() == "cpu"  # rank 0 first


def test_the_package_re_exports_the_reader():
    import ddp_hpc.judge as judge
    from ddp_hpc.judge import reader
    assert set(reader.__all__) <= set(judge.__all__)
    assert all(getattr(judge, n) is getattr(reader, n) for n in reader.__all__)


def test_traceback_with_torch_rank_prefixes_is_read(tmp_path):
    """torch.distributed prefixes an uncaught exception's lines with "[rank3]: "."""
    from ddp_hpc.judge.srun import exception_of, traceback_in
    p = tmp_path / "rank3.out"
    p.write_text("starting\n[rank3]: Traceback (most recent call last):\n"
                 '[rank3]:   File "/x/train.py", line 24, in <module>\n'
                 '[rank3]:     raise RuntimeError("rank 3 was told to fail")\n'
                 "[rank3]: RuntimeError: rank 3 was told to fail\n")
    block = traceback_in(p)
    assert block[0] == "Traceback (most recent call last):" and block[1].startswith("  File")
    assert exception_of(block) == ("RuntimeError", "rank 3 was told to fail")


def test_run_ending_reads_the_newest_step_when_an_async_checkpoint_lands_after_newer_steps(tmp_path):
    """An async save's checkpoint event is written when its file is complete, after steps that
    came later: the run's step is the newest step, and the checkpoint found is the saved one."""
    from ddp_hpc.judge.reader import run_ending
    ckpt = tmp_path / "ckpt-000000020.pt"
    ckpt.write_bytes(b"x")
    write(tmp_path, 0, [start(0), ev(0, 1, "step", step=20), ev(0, 2, "step", step=21),
                        ev(0, 3, "step", step=22), ev(0, 4, "checkpoint", step=20, path=str(ckpt))])
    end = run_ending(tmp_path)
    assert (end.step, end.checkpoint_step, end.checkpoint) == (22, 20, str(ckpt))
