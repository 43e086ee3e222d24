"""Who broke the job: attribution by evidence, not by the first timestamp.

Each test writes a log directory the way a real 2-node x 2-task job leaves it (event lines in the
run-log format, srun's report lines in ``slurm-<id>.out``, gloo's and NCCL's words in the errors
and ``rank<R>.out``) and asserts the exact lines a user reads in ``status JOBID``: the state comes
from a scheduler that answers like Slurm (a duck-typed SlurmCLI), the rest from the files.
"""
import json

import pytest

from ddp_hpc.judge.reader import RunLogs
from ddp_hpc.judge.srun import SUPERVISOR_PREFIX, starting_line, stopping_line, task_reports
from ddp_hpc.judge.stacks import stack_excerpt, stack_summary
from ddp_hpc.status.collect import collect
from ddp_hpc.status.targets import StatusTarget
from ddp_hpc.status.view import render_detail

T0 = 1_800_000_000.0
RESET = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [10.89.0.3]:36218: "
         "Connection reset by peer")
CLOSED = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.89.0.3]:28107"
TIMEOUT = ("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
           "30000ms for recv operation to complete")
STACK_PEER = '''Current thread 0x00007f3b3a1c9740 "MainThread" (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2501 in all_reduce
  File "/venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py", line 1644 in _sync
  File "/src/ddp_hpc/train/loop.py", line 337 in backward
  File "/src/ddp_hpc/train/loop.py", line 210 in run
  File "<frozen runpy>", line 88 in _run_code

Thread 0x00007f3b2c7fe640 "pin_memory" (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap
'''
STACK_BUSY = '''Thread 0x00007f3b2c7fe640 "pin_memory" (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait
  File "/usr/lib/python3.11/threading.py", line 1045 in _bootstrap_inner
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f3b3a1c9740 "MainThread" (most recent call first):
  File "/data/slow_loader.py", line 12 in __getitem__
  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 674 in __next__
  File "/src/ddp_hpc/train/loop.py", line 301 in batches
  File "/src/ddp_hpc/run.py", line 40 in main
  File "<frozen runpy>", line 88 in _run_code
'''


def ev(rank, t, event, restart=0, **kw):
    return {"time": T0 + t, "event": event, "rank": rank, "job_id": "77", "restart": restart,
            "host": f"n{rank // 2 + 1}", **kw}


def run_until(rank, last_step, every=1.0, restart=0):
    """start and one step event per step up to ``last_step``, ``every`` seconds apart."""
    evs = [ev(rank, 0, "start", restart, world_size=4, num_nodes=2, local_rank=rank % 2, pid=100 + rank,
              total_steps=100, epochs=1, launcher="slurm", device="cpu")]
    return evs + [ev(rank, s * every, "step", restart, epoch=0, step=s, total_steps=100, loss=1.0 / s,
                     lr=0.1, samples_per_s=64.0, rss_mb=300.0, cpu_percent=99.0)
                  for s in range(1, last_step + 1)]


def peer_error(rank, t, message, restart=0):
    tb = ("Traceback (most recent call last):\n  File \"/src/ddp_hpc/train/loop.py\", line 337, in "
          f"backward\n    loss.backward()\nRuntimeError: {message}")
    return [ev(rank, t, "error", restart, exc_type="RuntimeError", message=message, traceback=tb),
            ev(rank, t + 0.05, "end", restart, status="failed", step=40)]


def write(d, rank, events):
    d.mkdir(parents=True, exist_ok=True)
    with open(d / f"rank{rank}.events.jsonl", "a") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")


class FakeSlurm:
    """squeue / sacct / scontrol as ddp_hpc.slurm.cli.SlurmCLI returns them (rows as dicts)."""

    def __init__(self, squeue=(), sacct=()):
        self.squeue_rows, self.sacct_rows = list(squeue), list(sacct)

    def cluster_name(self):
        return "test"

    def squeue(self, job_ids=None, **kw):
        return [r for r in self.squeue_rows if r["JobID"].split("_")[0] in map(str, job_ids)]

    def sacct(self, job_ids, completion=False, duplicates=False, **kw):
        rows = [r for r in self.sacct_rows if r["JobID"].split(".")[0].split("_")[0] in map(str, job_ids)]
        return rows if duplicates else [r for r in rows if r.get("_last", True)]


def sacct_row(job="77", state="FAILED", exit_code="1:0", elapsed="00:01:23", **kw):
    return {"JobID": job, "JobIDRaw": job, "State": state, "ExitCode": exit_code, "Elapsed": elapsed,
            "Timelimit": "00:30:00", "NNodes": "2", "NodeList": "n[1-2]", "JobName": "demo", **kw}


def detail(d, sched=None, job="77", now=T0 + 300):
    st = collect([StatusTarget(job, None, str(d))], sched, history=True, now=now)[0]
    return st, render_detail(st, now=now).splitlines()


def first_failure(lines):
    i = next(i for i, ln in enumerate(lines) if ln.startswith("First failure: "))
    return lines[i:]


def test_sigkill_of_rank3_blames_rank3_not_the_survivors_reset(tmp_path):
    """The OOM killer's SIGKILL: rank 3 writes nothing; the others' "Connection reset by peer"
    errors come first in time but are consequences."""
    for r in range(3):
        write(tmp_path, r, run_until(r, 40) + peer_error(r, 40.3 + r / 10, RESET))
    write(tmp_path, 3, run_until(3, 40))
    (tmp_path / "slurm-77.out").write_text(
        "ddp_hpc: job 77 on n[1-2]\nsrun: error: n2: task 3: Killed\nsrun: Terminating StepId=77.0\n"
        "slurmstepd: error: *** STEP 77.0 ON n1 CANCELLED AT 2026-11-23T04:10:11 ***\n"
        "srun: error: n1: tasks 0-1: Exited with exit code 1\nsrun: error: n2: task 2: Exited with exit code 1\n")
    st, lines = detail(tmp_path, FakeSlurm(sacct=[sacct_row(exit_code="1:0")]))
    assert st.state_name == "FAILED" and st.source == "sacct"
    assert first_failure(lines)[:3] == [
        "First failure: rank 3 on n2 killed by signal 9 (SIGKILL)",
        "    ranks 0-2: lost their peer rank 3 (Connection reset by peer)",
        "    how we know: srun exit report (restart 0)"]
    js = st.to_dict()
    assert js["failure"]["rank"] == 3 and js["failure"]["kind"] == "killed" and js["failure"]["signal"] == 9
    assert {r: c["kind"] for r, c in js["rank_classification"].items()} == {
        "0": "consequence", "1": "consequence", "2": "consequence", "3": "killed"}
    assert js["rank_classification"]["3"]["text"] == "killed by signal 9 (SIGKILL)"


def test_sigkill_under_the_exec_wrapper_and_the_local_driver(tmp_path):
    """A script's rank killed under ddp_hpc.exec (its error event names the signal), and a
    training-core rank killed under the local backend (the driver's line names it)."""
    wrapped, local = tmp_path / "exec", tmp_path / "local"
    for r in range(3):
        write(wrapped, r, run_until(r, 40) + peer_error(r, 40.2, CLOSED))
        write(local, r, run_until(r, 40) + peer_error(r, 40.2, CLOSED))
    write(wrapped, 3, run_until(3, 40) + [
        ev(3, 40.1, "error", exc_type="Signal", message="killed by signal 9 (SIGKILL)", traceback=None,
           exit_code=None, signal="SIGKILL"),
        ev(3, 40.1, "end", status="failed", exit_code=None, signal="SIGKILL", step=40, duration_s=41.0)])
    write(local, 3, run_until(3, 40))
    (local / "local-driver.out").write_text(
        "ddp_hpc local: job local-x: 4 processes on 2 pretend nodes, logs in /l\n"
        f"ddp_hpc local: job local-x FAILED: rank 3 exited with -9; see {local}/rank3.out\n")
    for d in (wrapped, local):
        lines = first_failure(detail(d, job="local-x")[1])
        assert lines[:2] == ["First failure: rank 3 on n2 killed by signal 9 (SIGKILL)",
                             "    ranks 0-2: lost their peer rank 3 (Connection closed by peer)"], d


def test_a_killed_rank_without_any_report_is_the_one_whose_events_stopped(tmp_path):
    for r in range(3):
        write(tmp_path, r, run_until(r, 40) + peer_error(r, 40.2, RESET))
    write(tmp_path, 3, run_until(3, 39))
    f = RunLogs(tmp_path).first_failure(assume_failed=True)
    assert (f.rank, f.kind, f.basis) == (3, "lost", "events stopped first")
    assert f.consequences == [{"ranks": [0, 1, 2], "text": "lost their peer rank 3 (Connection reset by peer)"}]
    # the scheduler's exit code names the signal: killed
    st, lines = detail(tmp_path, FakeSlurm(sacct=[sacct_row(exit_code="0:9")]))
    assert first_failure(lines)[0] == "First failure: rank 3 on n2 killed by signal 9 (SIGKILL)"


def test_sigstop_rank3_is_stuck_and_its_peers_timed_out_waiting(tmp_path):
    """A hang: the others time out in the collective 35 s after rank 3's last step; srun kills
    the frozen rank 3 only after it began ending the step."""
    for r in range(3):
        write(tmp_path, r, run_until(r, 41) + [
            ev(r, 65, "stack", reason="collective timeout: no step for 24 s", stack=STACK_PEER, step=41)]
            + peer_error(r, 76 + r / 100, TIMEOUT))
    write(tmp_path, 3, run_until(3, 41))
    (tmp_path / "slurm-77.out").write_text(
        "srun: error: n1: tasks 0-1: Exited with exit code 1\nsrun: error: n2: task 2: Exited with exit code 1\n"
        "srun: Job step aborted: Waiting up to 32 seconds for job step to finish.\n"
        "srun: error: n2: task 3: Killed\n")
    st, lines = detail(tmp_path, FakeSlurm(sacct=[sacct_row()]))
    assert first_failure(lines)[:4] == [
        "First failure: rank 3 on n2 stuck: its last event (step 41) is 35 s older than the others'",
        "    ranks 0-2: timed out waiting for rank 3 (Timed out waiting 30000ms for recv)",
        "    how we know: its events stopped while the others timed out in a collective; "
        "srun exit report (restart 0)",
        "    ranks 0-2 were in distributed_c10d.py:2501 in all_reduce, from loop.py:337 in backward"]
    assert st.to_dict()["rank_classification"]["3"]["kind"] == "stuck"


def test_a_stuck_rank_that_wrote_its_stack_shows_where_it_was(tmp_path):
    for r in range(3):
        write(tmp_path, r, run_until(r, 41) + peer_error(r, 76, TIMEOUT))
    write(tmp_path, 3, run_until(3, 41) + [
        ev(3, 65, "stack", reason="collective timeout: no step for 24 s", stack=STACK_BUSY, step=41)])
    lines = first_failure(detail(tmp_path, FakeSlurm(sacct=[sacct_row()]))[1])
    assert lines[0] == "First failure: rank 3 on n2 stuck: its last event (step 41) is 35 s older than the others'"
    i = lines.index("    rank 3 was in slow_loader.py:12 in __getitem__ (collective timeout: no step for 24 s):")
    assert lines[i + 1:i + 3] == [
        '        Current thread 0x00007f3b3a1c9740 "MainThread" (most recent call first):',
        '        File "/data/slow_loader.py", line 12 in __getitem__']


def test_nccl_watchdog_abort_is_a_consequence(tmp_path):
    """NCCL's watchdog aborts the waiting ranks (no Python error event; its words in rank<R>.out),
    while the rank that never reached the collective was killed first."""
    for r in range(3):
        write(tmp_path, r, run_until(r, 40))
        (tmp_path / f"rank{r}.out").write_text(
            f"[rank{r}]:[E1123 04:10:11.123456 1234 ProcessGroupNCCL.cpp:616] [Rank {r}] Watchdog caught "
            "collective operation timeout: WorkNCCL(SeqNum=812, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
            "Timeout(ms)=600000) ran for 600094 milliseconds before timing out.\n"
            "terminate called after throwing an instance of 'c10::DistBackendError'\n")
    write(tmp_path, 3, run_until(3, 40))
    (tmp_path / "slurm-77.out").write_text(
        "srun: error: n2: task 3: Killed\nsrun: error: n1: tasks 0-1: Aborted\nsrun: error: n2: task 2: Aborted\n")
    lines = first_failure(detail(tmp_path, FakeSlurm(sacct=[sacct_row()]))[1])
    assert lines[:2] == ["First failure: rank 3 on n2 killed by signal 9 (SIGKILL)",
                         "    ranks 0-2: lost their peer rank 3 (Watchdog caught collective operation timeout)"]


def test_node_failure_names_the_node(tmp_path):
    """Every process of n2 killed: Slurm says NODE_FAIL; the survivors' errors are consequences."""
    for r in (0, 1):
        write(tmp_path, r, run_until(r, 40) + peer_error(r, 40.5, CLOSED))
    for r in (2, 3):
        write(tmp_path, r, run_until(r, 40))
    st, lines = detail(tmp_path, FakeSlurm(sacct=[sacct_row(state="NODE_FAIL", exit_code="0:0")]))
    assert first_failure(lines)[:3] == [
        "First failure: node n2 failed (NODE_FAIL): ranks 2-3 vanished",
        "    ranks 0-1: lost their peers on n2 (Connection closed by peer)",
        "    how we know: NODE_FAIL (restart 0)"]
    js = st.to_dict()
    assert (js["failure"]["kind"], js["failure"]["node"], js["failure"]["ranks"]) == ("vanished", "n2", [2, 3])
    # from the logs alone (the scheduler forgot the job): every rank of n2 went silent
    lines = first_failure(detail(tmp_path)[1])
    assert lines[0] == ("First failure: node n2 lost: ranks 2-3 vanished without end events while the "
                        "others failed")
    # srun's own words name the node
    (tmp_path / "slurm-77.out").write_text("srun: error: Node failure on n2\n"
                                           "srun: error: n1: tasks 0-1: Exited with exit code 1\n")
    f = RunLogs(tmp_path).first_failure(assume_failed=True)
    assert f.summary == "node n2 failed (srun: Node failure on n2): ranks 2-3 vanished"


def test_node_failure_then_requeue_names_the_node_while_the_job_waits(tmp_path):
    for r in (0, 1):
        write(tmp_path, r, run_until(r, 40) + peer_error(r, 40.5, CLOSED))
    for r in (2, 3):
        write(tmp_path, r, run_until(r, 40))
    sched = FakeSlurm(squeue=[{"JobID": "77", "JobArrayID": "77", "State": "PENDING", "Reason": "BeginTime",
                               "TimeUsed": "0:00", "TimeLimit": "30:00", "NumNodes": "2", "RestartCnt": "1",
                               "Name": "demo"}],
                      sacct=[sacct_row(state="NODE_FAIL", _last=False), sacct_row(state="PENDING")])
    st, lines = detail(tmp_path, sched)
    assert st.state_name == "PENDING" and st.restarts == 1
    assert first_failure(lines)[0] == "First failure: node n2 failed (NODE_FAIL): ranks 2-3 vanished"


def test_a_python_exception_keeps_its_line_and_the_echoes_are_consequences(tmp_path):
    tb = ('Traceback (most recent call last):\n  File "loop.py", line 9, in step\n    batch = next(it)\n'
          "InjectedFailure: injected failure on rank 3")
    for r in range(3):
        write(tmp_path, r, run_until(r, 40) + peer_error(r, 41, CLOSED))
    write(tmp_path, 3, run_until(3, 40) + [
        ev(3, 40.5, "error", exc_type="InjectedFailure", message="injected failure on rank 3", traceback=tb),
        ev(3, 40.6, "end", status="failed", step=40)])
    (tmp_path / "slurm-77.out").write_text("srun: error: n2: task 3: Exited with exit code 1\n"
                                           "srun: error: n1: tasks 0-2: Killed\n")
    lines = first_failure(detail(tmp_path, FakeSlurm(sacct=[sacct_row()]))[1])
    assert lines[:2] == [
        "First failure: rank 3 on n2 (restart 0, from error event): InjectedFailure: injected failure on rank 3",
        "    ranks 0-2: lost their peer rank 3 (Connection closed by peer)"]
    assert "    InjectedFailure: injected failure on rank 3" in lines


def test_srun_kills_after_a_bad_exit_are_srun_stopping_the_step(tmp_path):
    for r in range(4):
        write(tmp_path, r, run_until(r, 20 if r != 1 else 19))
    (tmp_path / "slurm-77.out").write_text("srun: error: n1: task 1: Exited with exit code 7\n"
                                           "srun: error: n1: tasks 0,2-3: Killed\n")
    lines = first_failure(detail(tmp_path, FakeSlurm(sacct=[sacct_row()]))[1])
    assert lines[:2] == ["First failure: rank 1 on n1 (restart 0, from srun exit report): exit code 7",
                         "    ranks 0,2-3: stopped after rank 1 failed (SIGKILL)"]


def test_a_wrappers_exit_status_gives_way_to_the_ranks_own_error_line(tmp_path):
    """submitit's "python -m ddp_hpc.run exited with status 2": the real line is in rank0.out."""
    write(tmp_path, 0, [ev(0, 1, "error", exc_type="RuntimeError",
                           message="python -m ddp_hpc.run exited with status 2",
                           traceback="Traceback (most recent call last):\n  File \"submitit/core.py\", "
                                     "line 9, in result\nRuntimeError: python -m ddp_hpc.run exited with status 2")])
    (tmp_path / "rank0.out").write_text("ddp_hpc run: error: cannot import module 'foo.bar' "
                                        "(model.name=foo.bar:baz)\nHINT: check model.name\n")
    f = RunLogs(tmp_path).first_failure(assume_failed=True)
    assert f.summary == ("rank 0 on n1 (restart 0, from error event; rank0.out): ddp_hpc run: error: "
                         "cannot import module 'foo.bar' (model.name=foo.bar:baz)")
    assert f.traceback_tail[-1] == "RuntimeError: python -m ddp_hpc.run exited with status 2"


def test_stack_summary_reads_faulthandler_and_traceback_text():
    assert stack_summary(STACK_PEER) == "distributed_c10d.py:2501 in all_reduce, from loop.py:337 in backward"
    # faulthandler's own dump from a helper thread: "Current thread" is the helper; the main
    # thread is the one not started by threading
    dump = ("Current thread 0x0000000000000001 (most recent call first):\n"
            '  File "/src/watch.py", line 5 in _run\n'
            '  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap\n\n'
            "Thread 0x0000000000000002 (most recent call first):\n"
            '  File "/src/ddp_hpc/train/loop.py", line 337 in backward\n'
            '  File "/src/train.py", line 3 in <module>\n')
    assert stack_summary(dump) == "loop.py:337 in backward"
    tb = 'Traceback (most recent call last):\n  File "/x/a.py", line 1, in <module>\n  File "/x/b.py", line 7, in f\n'
    assert stack_summary(tb) == "b.py:7 in f"
    assert stack_summary("") is None and stack_summary("no frames here") is None
    assert stack_excerpt(STACK_PEER, 3) == [
        'Current thread 0x00007f3b3a1c9740 "MainThread" (most recent call first):',
        'File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2501 in all_reduce',
        'File "/venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py", line 1644 in _sync']


def test_the_oom_killer_by_srun_or_by_the_scheduler(tmp_path):
    for r in range(3):
        write(tmp_path, r, run_until(r, 40) + peer_error(r, 40.2, RESET))
    write(tmp_path, 3, run_until(3, 40))
    lines = first_failure(detail(tmp_path, FakeSlurm(sacct=[sacct_row(state="OUT_OF_MEMORY", exit_code="0:125")]))[1])
    assert lines[:2] == ["First failure: rank 3 on n2 killed by the OOM killer",
                         "    ranks 0-2: lost their peer rank 3 (Connection reset by peer)"]
    (tmp_path / "slurm-77.out").write_text(
        "slurmstepd: error: Detected 1 oom_kill event in StepId=77.0. Some of the step tasks have been OOM Killed.\n"
        "srun: error: n2: task 3: Out Of Memory\n")
    assert RunLogs(tmp_path).first_failure(assume_failed=True).summary == "rank 3 on n2 killed by the OOM killer"


def test_a_real_script_rank_killed_under_the_exec_wrapper(tmp_path):
    """Real processes: two ranks of a sleeping script under ddp_hpc.exec, rank 1's script
    SIGKILLed; the wrapper's events name the signal, the launcher stops rank 0."""
    import os
    import signal
    import socket
    import sys
    import time

    from ddp_hpc.launch import start_local
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(60)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDP_HPC_"))
           and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    run = start_local([sys.executable, "-m", "ddp_hpc.exec", "--", sys.executable, str(script)],
                      nodes=1, procs_per_node=2, log_dir=tmp_path, env=env)
    try:
        deadline = time.monotonic() + 60
        while len(RunLogs(tmp_path).last_events()) < 2:
            assert time.monotonic() < deadline, "no start events"
            time.sleep(0.05)
        os.kill(RunLogs(tmp_path).ranks[1].events[0]["pid"], signal.SIGKILL)
        run.wait()
    finally:
        run.kill(grace=0)
    f = RunLogs(tmp_path).first_failure(assume_failed=True)
    assert f.summary == f"rank 1 on {socket.gethostname()} killed by signal 9 (SIGKILL)"
    assert f.consequences == [{"ranks": [0], "text": "stopped after rank 1 failed (SIGTERM)"}]


def test_while_srun_still_ends_the_step_the_silent_rank_is_blamed_not_the_first_echo(tmp_path):
    """squeue still says RUNNING a few seconds after rank 3 was killed: the survivors' errors
    are already there, srun's report not yet."""
    for r in range(3):
        write(tmp_path, r, run_until(r, 40) + peer_error(r, 40.3, RESET))
    write(tmp_path, 3, run_until(3, 40))
    running = {"JobID": "77", "JobArrayID": "77", "State": "RUNNING", "Reason": "None", "TimeUsed": "0:41",
               "TimeLimit": "30:00", "NumNodes": "2", "RestartCnt": "0", "Name": "demo"}
    st, lines = detail(tmp_path, FakeSlurm(squeue=[running]), now=T0 + 42)
    assert first_failure(lines)[:2] == ["First failure: rank 3 on n2 (restart 0, from events stopped first)",
                                        "    ranks 0-2: lost their peer rank 3 (Connection reset by peer)"]
    assert any("the scheduler says RUNNING but rank 3 failed" in n for n in st.notes)


def test_a_node_silenced_by_srun_after_a_rank_raised_is_not_a_lost_node(tmp_path):
    tb = "Traceback (most recent call last):\n  File \"loop.py\", line 9, in step\nValueError: bad batch"
    write(tmp_path, 0, run_until(0, 40) + [ev(0, 40.5, "error", exc_type="ValueError", message="bad batch",
                                              traceback=tb), ev(0, 40.6, "end", status="failed", step=40)])
    write(tmp_path, 1, run_until(1, 40) + peer_error(1, 41, CLOSED))
    for r in (2, 3):
        write(tmp_path, r, run_until(r, 40))
    (tmp_path / "slurm-77.out").write_text("srun: error: n1: task 0: Exited with exit code 1\n"
                                           "srun: Terminating StepId=77.0\nsrun: error: n2: tasks 2-3: Killed\n"
                                           "srun: error: n1: task 1: Exited with exit code 1\n")
    lines = first_failure(detail(tmp_path, FakeSlurm(sacct=[sacct_row()]))[1])
    assert lines[:3] == ["First failure: rank 0 on n1 (restart 0, from error event): ValueError: bad batch",
                         "    rank 1: lost its peer rank 0 (Connection closed by peer)",
                         "    ranks 2-3: stopped after rank 0 failed (SIGKILL)"]


def test_the_local_driver_names_the_killed_rank_of_an_array_task(tmp_path):
    task = tmp_path / "task1"
    write(task, 0, run_until(0, 20) + peer_error(0, 20.2, CLOSED))
    write(task, 1, run_until(1, 20))
    (tmp_path / "local-driver.out").write_text(
        "ddp_hpc local: task 0 local-x_0 completed: all 2 ranks exited 0\n"
        f"ddp_hpc local: task 1 local-x_1 FAILED: rank 1 exited with -9; see {task}/rank1.out\n")
    f = RunLogs(task).first_failure(assume_failed=True)
    assert f.summary == "rank 1 on n1 killed by signal 9 (SIGKILL)" and f.basis == "local driver exit report"


def test_a_stopped_rank_woken_by_slurm_is_still_the_stuck_one(tmp_path):
    """SIGSTOP on rank 3: the others' watchdogs dump their stacks, then they time out; Slurm sends
    SIGCONT before it ends the step, so rank 3 wakes, dumps late and fails with a peer error too.
    It is the one that wrote no stack before the others' timeouts."""
    for r in range(3):
        write(tmp_path, r, run_until(r, 40) + [ev(r, 64, "stack", reason="stalled: no step for 60 s",
                                                  stack=STACK_PEER, step=40)]
              + peer_error(r, 100.2 + r / 10, TIMEOUT if r != 1 else CLOSED))
    write(tmp_path, 3, run_until(3, 40) + [ev(3, 100.6, "stack", reason="collective timeout: no step "
                                              "for 100 s", stack=STACK_BUSY, step=40)]
          + peer_error(3, 100.7, CLOSED))
    st, lines = detail(tmp_path, FakeSlurm(sacct=[sacct_row()]))
    assert first_failure(lines)[0].startswith(
        "First failure: rank 3 on n2 stuck after step 40: it wrote no stack before the others' "
        "collective timeout while they did")
    assert any("timed out waiting for rank 3" in ln for ln in lines)


PAIR_CLOSURE = "Application timeout caused pair closure"


def test_a_stopped_rank_is_blamed_when_gloo_says_pair_closure(tmp_path):
    """Issue 30 item 4 as the test cluster showed it: SIGSTOP on rank 3, a 150 s collective timeout.
    Rank 2's DDP all-reduce failed with gloo's "Application timeout caused pair closure" (an
    asynchronous all-reduce started before it timed out first and closed the group), ranks 0-1
    saw the closed connections, and rank 3, woken by Slurm's SIGCONT, lost its peers too. The
    rank that went silent while the others waited is the culprit, not rank 2."""
    for r in range(3):
        write(tmp_path, r, run_until(r, 40) + [
            ev(r, 100, "stack", reason="stalled: no step for 60 s", stack=STACK_PEER, step=40),
            ev(r, 160, "stack", reason="collective timeout: no step for 120 s", stack=STACK_PEER, step=40)]
            + peer_error(r, 190.2 + r / 10, PAIR_CLOSURE if r == 2 else CLOSED))
    write(tmp_path, 3, run_until(3, 40) + peer_error(3, 191.0, CLOSED))
    st, lines = detail(tmp_path, FakeSlurm(sacct=[sacct_row()]))
    assert first_failure(lines)[0].startswith(
        "First failure: rank 3 on n2 stuck after step 40: it wrote no stack before the others' "
        "collective timeout while they did"), lines
    assert f"    rank 2: timed out waiting for rank 3 ({PAIR_CLOSURE})" in lines
    assert st.to_dict()["rank_classification"]["2"]["kind"] == "consequence"


def test_the_stall_wins_over_words_the_patterns_do_not_know(tmp_path):
    """Ranks whose watchdog stacks showed them waiting in a collective, and that failed there with
    no step since, are victims whatever their error says; the rank that wrote no stack is stuck."""
    odd = "[gloo] a collective failed for a reason these patterns have never seen"
    for r in range(3):
        write(tmp_path, r, run_until(r, 40) + [
            ev(r, 66, "stack", reason="collective timeout: no step for 24 s", stack=STACK_PEER, step=40)]
            + peer_error(r, 70.1 + r / 10, odd))
    write(tmp_path, 3, run_until(3, 40))
    st, lines = detail(tmp_path, FakeSlurm(sacct=[sacct_row()]))
    assert first_failure(lines)[0] == (
        "First failure: rank 3 on n2 stuck: its last event (step 40) is 30 s older than the others'"), lines
    kinds = {r: c["kind"] for r, c in st.to_dict()["rank_classification"].items()}
    assert kinds == {"0": "consequence", "1": "consequence", "2": "consequence", "3": "stuck"}
    assert st.to_dict()["rank_classification"]["0"]["waited"] == "all_reduce"


def test_an_error_outside_a_collective_or_after_a_step_stays_the_ranks_own(tmp_path):
    """The stall evidence holds only for a rank still waiting in a collective: rank 1's stack was
    in its own loader, rank 2 stepped on after its stack; both raised their own errors."""
    write(tmp_path, 0, run_until(0, 40) + [ev(0, 80, "end", status="completed", step=40)])
    write(tmp_path, 1, run_until(1, 40) + [
        ev(1, 66, "stack", reason="collective timeout: no step for 24 s", stack=STACK_BUSY, step=40)]
        + peer_error(1, 70.1, "odd loader failure"))
    write(tmp_path, 2, run_until(2, 40) + [
        ev(2, 60, "stack", reason="on request", stack=STACK_PEER, step=40),
        ev(2, 61, "step", epoch=0, step=41, total_steps=100)] + peer_error(2, 75, "odd step failure"))
    write(tmp_path, 3, run_until(3, 40) + [ev(3, 80, "end", status="completed", step=40)])
    kinds = {r: c["kind"] for r, c in detail(tmp_path, FakeSlurm(sacct=[sacct_row()]))[0].to_dict()[
        "rank_classification"].items()}
    assert kinds["1"] == "raised" and kinds["2"] == "raised"


@pytest.mark.parametrize("moved_on", ["progress", "eval", "checkpoint", "epoch"])
def test_a_rank_that_moved_on_after_its_waiting_stack_and_then_raised_is_blamed(tmp_path, moved_on):
    """A stack shows rank 1 waiting in a collective (a slow all-reduce, say of the evaluation's
    metrics); it then went on (an evaluation's progress, an eval, a checkpoint, an epoch's end:
    no step event in between) and raised an error of its own: the cause, not a victim."""
    write(tmp_path, 0, run_until(0, 40) + [ev(0, 80, "end", status="completed", step=40)])
    write(tmp_path, 1, run_until(1, 40) + [
        ev(1, 60, "stack", reason="collective timeout: no step for 24 s", stack=STACK_PEER, step=40),
        ev(1, 62, moved_on, step=40, epoch=0)] + peer_error(1, 70.1, "CUDA out of memory in the eval"))
    for r in (2, 3):
        write(tmp_path, r, run_until(r, 40) + [ev(r, 80, "end", status="completed", step=40)])
    st, lines = detail(tmp_path, FakeSlurm(sacct=[sacct_row()]))
    assert st.to_dict()["rank_classification"]["1"]["kind"] == "raised", lines
    assert first_failure(lines)[0].startswith("First failure: rank 1 on n1"), lines


@pytest.mark.parametrize("marked", [True, False])
def test_a_traceback_of_an_earlier_run_is_no_evidence_after_the_supervisors_run_mark(tmp_path, marked):
    """Rank 3 lost its peer in run 0 (its traceback stays in rank3.out: srun appends every run's
    output to it); in run 1 it is SIGKILLed. The supervisor's mark before run 1 keeps run 0's
    traceback out of run 1's evidence: rank 3 was killed, no consequence of an old error. Without
    the mark the old traceback is read, and srun's report of the kill still outweighs it."""
    for r in range(3):
        write(tmp_path, r, run_until(r, 40, restart=1) + peer_error(r, 40.3 + r / 10, RESET, restart=1))
    write(tmp_path, 3, run_until(3, 40, restart=1))
    old = f"Traceback (most recent call last):\n  File \"/src/x.py\", line 3, in f\nRuntimeError: {CLOSED}\n"
    (tmp_path / "rank3.out").write_text(old + ("ddp_hpc supervise: --- run 1 starts ---\n" if marked else "")
                                        + "step 40\n")
    (tmp_path / "slurm-77.out").write_text("srun: error: n2: task 3: Killed\n")
    logs = RunLogs(tmp_path)
    assert (logs.out_traceback(3) is None) is marked
    failure = logs.first_failure(assume_failed=True)
    assert (failure.rank, failure.kind, failure.basis) == (3, "killed", "srun exit report")


def test_a_lost_peer_is_a_victim_whatever_its_exit_code_and_report_order(tmp_path):
    """Issue 38, bug 8 (seen in CI under load): rank 3 SIGKILLed; rank 1's script raised "Connection
    closed by peer" (its own error event) and the exec wrapper then wrote "exited with status 1";
    srun reported rank 1's exit code before rank 3's kill. Rank 1 is a victim, rank 3 the cause."""
    for r in (0, 2):
        write(tmp_path, r, run_until(r, 40) + peer_error(r, 40.4, CLOSED))
    write(tmp_path, 1, run_until(1, 40) + peer_error(1, 40.2, CLOSED)[:1] + [
        ev(1, 40.3, "error", exc_type="Exited", message="exited with status 1", traceback=None, exit_code=1),
        ev(1, 40.35, "end", status="failed", exit_code=1, step=40)])
    write(tmp_path, 3, run_until(3, 40))
    (tmp_path / "slurm-77.out").write_text(
        "srun: error: n1: task 1: Exited with exit code 1\nsrun: error: n2: task 3: Killed\n"
        "srun: error: n1: task 0: Exited with exit code 1\nsrun: error: n2: task 2: Exited with exit code 1\n")
    f = RunLogs(tmp_path).first_failure(assume_failed=True)
    assert (f.rank, f.kind, f.signal) == (3, "killed", 9)
    assert f.consequences[0]["ranks"] == [0, 1, 2]


def test_an_earlier_run_the_supervisor_restarted_is_blamed_as_the_supervisor_found(tmp_path):
    """Seen on the test cluster (4 DataLoader workers per rank, rank 3 SIGKILLed): srun's stop
    ended rank 0's workers ("DataLoader worker ... is killed by signal: Terminated"), an error event
    of rank 0's own; the run history took it for the cause of run 0. The supervisor's finding for
    that run (restarts.jsonl, which read srun's report) is the cause status shows."""
    for r in range(3):
        write(tmp_path, r, run_until(r, 8) + (peer_error(r, 8.5, "DataLoader worker (pid 13903) is killed by "
                                                                  "signal: Terminated. ") if r == 0 else []))
    write(tmp_path, 3, run_until(3, 8))
    for r in range(4):
        write(tmp_path, r, run_until(r, 16, restart=1)[:1] + run_until(r, 16, restart=1)[9:] + [
            ev(r, 30, "end", restart=1, status="completed", step=16)])
    row = {"restart": 1, "job_id": "77", "fault_at": T0 + 8.2, "detected_at": T0 + 9, "trigger": "exited",
           "stop": None, "why": "rank 3 on n2 killed by signal 9 (SIGKILL)", "kind": "killed", "rank": 3,
           "node": "n2", "basis": "srun exit report", "excluded": [], "nodes_before": ["n1", "n2"],
           "nodes_after": ["n1", "n2"], "world_before": 4, "world_after": 4}
    (tmp_path / "restarts.jsonl").write_text(json.dumps(row) + "\n")
    lines = detail(tmp_path, FakeSlurm(sacct=[sacct_row(state="COMPLETED", exit_code="0:0")]))[1]
    [run0] = [ln for ln in lines if ln.strip().startswith("restart 0: ranks")]
    assert run0.endswith("first failure: rank 3 on n2 killed by signal 9 (SIGKILL) (the supervisor's "
                         "finding: srun exit report)"), run0


def test_a_rank_the_supervisor_killed_while_stopping_the_step_is_the_stuck_one_not_killed(tmp_path):
    """A hang under the supervisor: the others time out and exit, srun does not end the step (rank 3
    is stopped), so the supervisor kills its tasks (``scancel --signal=KILL``), which srun reports
    as "task 3: Killed" with no abort line of its own before it. Its line before the kill marks the
    reports after it as the supervisor's doing: rank 3 is stuck, not killed by signal 9 (with one
    rank a node, a fresh-clone CI run blamed the kill)."""
    for r in range(3):   # each wrote its timeout, and was killed in its teardown: no end event
        write(tmp_path, r, run_until(r, 41) + [
            ev(r, 65, "stack", reason="collective timeout: no step for 24 s", stack=STACK_PEER, step=41)]
            + peer_error(r, 76 + r / 100, TIMEOUT)[:1])
    write(tmp_path, 3, run_until(3, 41))
    (tmp_path / "slurm-77.out").write_text(
        f"{SUPERVISOR_PREFIX} {starting_line(0)}\n{SUPERVISOR_PREFIX} {stopping_line(0, 'rank failed')}\n"
        "srun: error: n2: task 3: Killed\nsrun: error: n1: tasks 0-1: Killed\nsrun: error: n2: task 2: Killed\n")
    st, lines = detail(tmp_path, FakeSlurm(sacct=[sacct_row()]))
    assert first_failure(lines)[0] == \
        "First failure: rank 3 on n2 stuck: its last event (step 41) is 35 s older than the others'"
    assert st.to_dict()["rank_classification"]["3"]["kind"] == "stuck"


def test_a_kill_reported_after_the_next_start_is_that_runs_own(tmp_path):
    """The supervisor's stop marks srun's reports up to its next start line only: a rank killed in
    the next run (the OOM killer) is that run's fault, not the supervisor's."""
    lines = [f"{SUPERVISOR_PREFIX} {starting_line(0)}", f"{SUPERVISOR_PREFIX} {stopping_line(0, 'stalled')}",
             "srun: error: n2: task 1: Killed", "srun: error: n1: task 0: Killed"]
    out = tmp_path / "slurm-1.out"
    out.write_text("\n".join(lines) + "\n")
    assert {t: r.after_abort for t, r in task_reports([out]).items()} == {0: True, 1: True}
    out.write_text("\n".join(lines + [f"{SUPERVISOR_PREFIX} {starting_line(1)}",
                                      "srun: error: n2: task 1: Killed"]) + "\n")
    assert {t: r.after_abort for t, r in task_reports([out]).items()} == {0: True, 1: False}


WORKER_RESET = """Traceback (most recent call last):
  File "/usr/lib/python3.11/multiprocessing/resource_sharer.py", line 138, in _serve
    with self._listener.accept() as conn:
         ^^^^^^^^^^^^^^^^^^^^^^^
  File "/usr/lib/python3.11/multiprocessing/connection.py", line 395, in _recv
    chunk = read(handle, remaining)
            ^^^^^^^^^^^^^^^^^^^^^^^
ConnectionResetError: [Errno 104] Connection reset by peer
"""


@pytest.mark.parametrize("first", ["killed rank first", "stopped rank first"])
def test_a_killed_rank_with_dataloader_workers_is_blamed_not_the_workers_srun_stopped(tmp_path, first):
    """Rank 3 SIGKILLed while DataLoader workers saturate the CPUs: its orphaned workers print a
    multiprocessing "Connection reset by peer" traceback into rank3.out (seen on a real kill), and
    srun's stop reaches rank 0's workers before rank 0's own handler, so torch raises "DataLoader
    worker ... is killed by signal: Terminated" there (a fresh-clone CI run blamed rank 0 for it,
    and the supervisor gave up instead of restarting)."""
    stopped = "DataLoader worker (pid 21504) is killed by signal: Terminated. "
    write(tmp_path, 0, run_until(0, 6) + [
        ev(0, 6.4, "error", exc_type="RuntimeError", message=stopped,
           traceback=f"Traceback (most recent call last):\n  File \"step.py\", line 61\nRuntimeError: {stopped}"),
        ev(0, 6.5, "end", status="failed", step=6)])
    for r in (1, 2):
        write(tmp_path, r, run_until(r, 6) + peer_error(r, 6.3, RESET))
    write(tmp_path, 3, run_until(3, 5))
    (tmp_path / "rank3.out").write_text(WORKER_RESET)
    reports = ["srun: error: n2: task 3: Killed", "srun: error: n1: task 0: Killed"]
    (tmp_path / "slurm-77.out").write_text(
        "\n".join(reports if first == "killed rank first" else reports[::-1])
        + "\nsrun: Terminating StepId=77.1\nsrun: error: n1: task 1: Exited with exit code 1\n"
          "srun: error: n2: task 2: Exited with exit code 1\n")
    st, lines = detail(tmp_path, FakeSlurm(sacct=[sacct_row()]))
    assert first_failure(lines)[0] == "First failure: rank 3 on n2 killed by signal 9 (SIGKILL)", lines
    kinds = {r: c["kind"] for r, c in st.to_dict()["rank_classification"].items()}
    assert kinds == {"0": "stopped", "1": "consequence", "2": "consequence", "3": "killed"}, kinds
    assert st.to_dict()["rank_classification"]["0"]["text"] == "stopped by SIGTERM via its DataLoader workers"


def test_a_running_rank_that_printed_a_traceback_and_went_on_is_no_failure_until_it_falls_silent(tmp_path):
    """Of a job that runs, a rank whose events go on is alive: a traceback in its rank*.out is
    one it caught (a worker restarted, a logged exception), not its end, and its output is not
    read at all (at 8,192 ranks, 8,192 files a status). Once its events stopped for the stall
    floor (30 s) it may be dying with its error printed: then the traceback names it."""
    d = tmp_path / "logs"
    for r in range(4):
        write(d, r, run_until(r, 40))
        (d / f"rank{r}.out").write_text("ok\n")
    (d / "rank2.out").write_text("Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n"
                                 "    load()\nOSError: [Errno 5] Input/output error\n")
    running = FakeSlurm(squeue=[{"JobID": "77", "State": "RUNNING", "TimeUsed": "1:00", "TimeLimit": "30:00",
                                 "NodeList": "n[1-2]", "Reason": "None", "NumNodes": "2"}])
    st, lines = detail(d, running, now=T0 + 45)
    assert st.failure is None and not any(ln.startswith("First failure: ") for ln in lines)
    st, lines = detail(d, running, now=T0 + 40 + 31)
    assert st.failure is not None and st.failure.rank == 2 and "OSError" in (st.failure.exc_type or ""), lines
