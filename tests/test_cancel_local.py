"""``ddp-hpc cancel`` and the states of local jobs after a stop, with real local jobs: the local
backend's driver and rank processes, their job records and run logs (no Slurm; the cluster test
is tests/cluster/test_cancel_cluster.py)."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ddp_hpc import records
from ddp_hpc.launch.tree import recorded_alive

#: each rank starts a grandchild (it must die with the job), then reports a step every 0.1 s
SCRIPT = """\
import os, subprocess, sys, time
import ddp_hpc
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
with open(os.path.join(os.environ["DDP_HPC_LOG_DIR"], f"child{os.environ['RANK']}.pid"), "w") as f:
    f.write(str(child.pid))
for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 600):
    ddp_hpc.report(step=i, total=600)
    time.sleep(0.1)
"""


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_HPC_HOME", str(tmp_path / "home"))
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "job.py").write_text(SCRIPT)
    return tmp_path


def env_for(home):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["DDP_HPC_HOME"] = str(home / "home")
    env["PATH"] = str(Path(sys.executable).parent)  # no Slurm here
    return env


def ddp_hpc(home, *args, timeout=60, check=True):
    p = subprocess.run([sys.executable, "-m", "ddp_hpc", *args], cwd=home / "work", env=env_for(home),
                       capture_output=True, text=True, timeout=timeout)
    if check:
        assert p.returncode == 0, p.stdout + p.stderr
    return p


def elapsed_s(status_text: str) -> int:
    """The seconds of the detail view's ``Elapsed:    HH:MM:SS`` line."""
    h, m, s = re.search(r"^Elapsed:\s+(\d+):(\d\d):(\d\d)", status_text, re.M).groups()
    return int(h) * 3600 + int(m) * 60 + int(s)


def within(status_text: str, t0: float) -> bool:
    """The job's elapsed time is more than 0 and no more than the test saw pass since ``t0``
    (before the submission), whatever the load: a start-up may take long on a busy machine."""
    return 0 < elapsed_s(status_text) <= time.monotonic() - t0 + 1


def submit(home, *extra):
    """A detached local job of 2 pretend nodes x 1 rank; returns (job id, record) once both ranks
    reported a step."""
    p = ddp_hpc(home, "submit", "--backend", "local", "-N", "2", "-G", "1", "--log-dir", str(home / "runs"),
                "job.py", *extra)
    job_id = p.stdout.strip().splitlines()[-1]
    rec = wait_steps(job_id)
    return job_id, rec


def wait_steps(job_id, timeout=120):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        rec = records.load_record(job_id)
        evs = [Path(rec.log_dir) / f"rank{r}.events.jsonl" for r in (0, 1)]
        if len(rec.pids or []) == 3 and all(p.exists() and '"step"' in p.read_text() for p in evs):
            return rec
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not start: {records.load_record(job_id)}")


def job_processes(rec):
    """Every process of the job: the driver, the ranks, their scripts and the grandchildren."""
    pids = list(rec.pids) + [int((Path(rec.log_dir) / f"child{r}.pid").read_text()) for r in (0, 1)]
    for pid in rec.pids[1:]:
        pids += [c.pid for c in psutil.Process(pid).children(recursive=True)]
    return sorted(set(pids))


def alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_cancel_stops_every_process_and_status_says_cancelled(home):
    t0 = time.monotonic()
    job_id, rec = submit(home)
    procs = job_processes(rec)
    assert len(procs) >= 7 and all(alive(p) for p in procs)  # driver, 2 wrappers, 2 scripts, 2 children
    p = ddp_hpc(home, "cancel", job_id, "--grace", "5")
    assert f"job {job_id}: CANCELLED" in p.stdout
    assert not [pid for pid in procs if alive(pid)]
    rec = records.load_record(job_id)
    assert rec.final["state_name"] == "CANCELLED" and rec.pids == []
    out = ddp_hpc(home, "status", job_id).stdout
    assert "State:      CANCELLED" in out and "FAILED" not in out, out
    assert within(out, t0), out
    table = ddp_hpc(home, "status").stdout
    assert " CANCELLED " in table, table
    again = ddp_hpc(home, "cancel", job_id)
    assert "no process of it runs any more (CANCELLED)" in again.stdout


def test_cancel_leaves_alone_a_process_that_took_a_recorded_pid(home, tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = psutil.Process(other.pid).create_time()
        records.write_record(dict(
            id="local-old-1", cluster=os.uname().nodename, name="old", backend="local", nodes=1,
            gpus_per_node=1, time_limit=None, log_dir=str(tmp_path / "gone"), config=None, overrides=[],
            cwd=str(tmp_path), submitted_at=started - 200, pids=[other.pid], pid_times=[started - 100]))
        p = ddp_hpc(home, "cancel", "local-old-1")
        assert "no process of it runs any more" in p.stdout
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_cancel_never_signals_a_pid_recorded_without_a_start_time(home, tmp_path):
    """A rank that had ended when its pids were recorded has no start time beside its pid; a
    process started later under that pid (after the submission) is a stranger: left alone, and
    the answer says so."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = psutil.Process(other.pid).create_time()
        records.write_record(dict(
            id="local-old-2", cluster=os.uname().nodename, name="old", backend="local", nodes=1,
            gpus_per_node=1, time_limit=None, log_dir=str(tmp_path / "gone"), config=None, overrides=[],
            cwd=str(tmp_path), submitted_at=started - 200, pids=[other.pid], pid_times=[None]))
        p = ddp_hpc(home, "cancel", "local-old-2")
        assert "no process of it runs any more" in p.stdout
        assert (f"left alone 1 pid recorded without a start time ({other.pid}): whatever runs there "
                "now is not the job's") in p.stdout
        assert other.poll() is None
        # the same one check tells status what still runs (ddp_hpc.launch.tree)
        here = os.uname().nodename
        assert recorded_alive([other.pid], [None], here) is False
        assert recorded_alive([other.pid], [started], here) is True
        assert recorded_alive([other.pid], [started], "another-host") is None
    finally:
        other.kill()
        other.wait()


def test_cancel_of_an_unknown_id_says_so(home):
    p = ddp_hpc(home, "cancel", "local-nope-1", check=False)
    assert p.returncode == 2
    assert "ddp-hpc cancel: error: no job record with id 'local-nope-1'" in p.stderr
    assert "HINT:" in p.stderr


def test_ctrl_c_of_a_waited_job_is_interrupted_not_failed(home):
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "ddp_hpc", "submit", "--backend", "local", "--wait", "-N", "2",
                             "-G", "1", "--log-dir", str(home / "runs"), "job.py"], cwd=home / "work",
                            env=env_for(home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not records.list_records() and time.monotonic() < deadline:
            time.sleep(0.1)
        rec = wait_steps(records.list_records()[-1].id)
        time.sleep(2)
        proc.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends the submit command
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    assert "interrupted (Ctrl-C" in out
    st = ddp_hpc(home, "status", rec.id).stdout
    assert "State:      INTERRUPTED by SIGINT" in st and "FAILED" not in st, st
    assert "0-1 interrupted (SIGINT)" in st
    assert within(st, t0), st


def test_term_to_the_driver_is_cancelled_and_a_lost_driver_is_judged_by_the_end_events(home):
    job_id, rec = submit(home)
    os.kill(rec.pids[0], signal.SIGTERM)  # `kill DRIVER`: the driver stops the ranks, keeps the state
    psutil.wait_procs([psutil.Process(rec.pids[0])], timeout=20)
    st = ddp_hpc(home, "status", job_id).stdout
    assert "State:      CANCELLED by SIGTERM" in st and "source: record" in st, st

    job_id, rec = submit(home)
    os.kill(rec.pids[0], signal.SIGKILL)  # the driver gone without a word; then the ranks stopped
    for pid in rec.pids[1:]:
        os.killpg(pid, signal.SIGTERM)
    psutil.wait_procs([psutil.Process(p) for p in rec.pids[1:] if alive(p)], timeout=20)
    st = ddp_hpc(home, "status", job_id).stdout
    assert "State:      CANCELLED by SIGTERM" in st and "processes gone without an end event" not in st, st
    assert records.load_record(job_id).final["state_name"] == "CANCELLED"  # kept for later


def test_a_completed_job_whose_logs_were_removed_stays_completed(home):
    t0 = time.monotonic()
    p = ddp_hpc(home, "submit", "--backend", "local", "--wait", "-N", "2", "-G", "1", "--log-dir",
                str(home / "runs"), "job.py", "25")
    assert "completed" in p.stderr
    rec = records.list_records()[-1]
    for f in Path(rec.log_dir).iterdir():
        f.unlink()
    Path(rec.log_dir).rmdir()
    st = ddp_hpc(home, "status", rec.id).stdout
    assert "State:      COMPLETED" in st and "FAILED" not in st, st
    assert f"log directory {rec.log_dir} is gone; final state from the record" in st
    assert within(st, t0), st


def test_job_cancel_from_python(home, monkeypatch):
    import ddp_hpc as api

    monkeypatch.chdir(home / "work")
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    job = api.submit_job(["job.py"], nodes=2, gpus=1, backend="local", log_dir=str(home / "runs"))
    rec = wait_steps(job.job_id)
    procs = job_processes(rec)
    job.cancel(grace=5)
    assert not [pid for pid in procs if alive(pid)]
    assert job.state() == "CANCELLED"


def ev(rank, t, event, **kw):
    return {"time": t, "event": event, "rank": rank, "job_id": "x", "restart": 0, "host": "h", **kw}


def test_a_stall_before_a_cancel_stays_the_first_failure(home, tmp_path):
    """Rank 1 stopped reporting at step 40 while rank 0 went on to step 200; then the job was
    cancelled and both wrote their end: status still names rank 1."""
    t0 = time.time() - 600
    log_dir = tmp_path / "runs" / "stalled"
    log_dir.mkdir(parents=True)
    stop = t0 + 200.5
    for rank, last in ((0, 200), (1, 40)):
        evs = [ev(rank, t0, "start", world_size=2, num_nodes=2, local_rank=0, pid=1, launcher="exec/local")]
        evs += [ev(rank, t0 + s, "step", step=s, total_steps=1000) for s in range(1, last + 1)]
        evs.append(ev(rank, stop + rank * 0.1, "end", status="killed", signal="SIGTERM", exit_code=None, step=last))
        (log_dir / f"rank{rank}.events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))
    rec = records.JobRecord(
        id="local-stalled-1", cluster=os.uname().nodename, name="stalled", backend="local", nodes=2,
        gpus_per_node=1, time_limit=None, log_dir=str(log_dir), config=None, overrides=[], cwd=str(tmp_path),
        submitted_at=t0 - 1, pids=[], final=records.local_final("CANCELLED", t0 - 1, stop, "ddp-hpc cancel"))
    records.write_record(rec)
    st = ddp_hpc(home, "status", "local-stalled-1").stdout
    assert "State:      CANCELLED" in st, st
    assert "First failure: rank 1 stopped first: no event for 00:02:40 before the stop (last step 40; " \
           "the others reached step 200)" in st, st
