"""``python -m ddp_hpc.status`` as a user runs it: a real process, real job records and run logs
on disk, run from another directory, no Slurm reachable (the cluster tests cover Slurm)."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_hpc import records
from ddp_hpc.env import gpu_usable
from ddp_hpc.launch.tree import start_time

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_HPC_HOME", str(tmp_path / "home"))
    return tmp_path


def env_for(home):
    # no COLUMNS: pytest-xdist's workers set COLUMNS=80, which would fit the table to 80 columns
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "COLUMNS"}
    env["DDP_HPC_HOME"] = str(home / "home")
    # no Slurm here: only the venv's bin on PATH, so no sbatch/squeue (a missing or dead
    # controller makes Slurm's own tools retry for up to a minute)
    env["PATH"] = str(Path(sys.executable).parent)
    return env


def status(home, *args, check=True, timeout=60, cwd=None):
    elsewhere = home / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    p = subprocess.run([sys.executable, "-m", "ddp_hpc.status", *args], cwd=cwd or elsewhere,
                       env=env_for(home), capture_output=True, text=True, timeout=timeout)
    if check:
        assert p.returncode == 0, p.stderr
    return p


def ev(rank, t, event, restart=0, **kw):
    return {"time": time.time() - 100 + t, "event": event, "rank": rank, "job_id": "x",
            "restart": restart, "host": "h", **kw}


def write_events(d, rank, events):
    d.mkdir(parents=True, exist_ok=True)
    with open(d / f"rank{rank}.events.jsonl", "a") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")


def start(r, t=0, restart=0, ws=2, total=100):
    return ev(r, t, "start", restart, world_size=ws, num_nodes=1, local_rank=r, pid=1,
              total_steps=total, epochs=2, launcher="slurm")


def step(r, t, s, restart=0, total=100, loss=0.5):
    return ev(r, t, "step", restart, epoch=0, step=s, total_steps=total, loss=loss, lr=0.1,
              samples_per_s=321.0, rss_mb=1.0, cpu_percent=1.0)


def record(home, job_id, log_dir, backend="sbatch", submitted_at=None, **kw):
    rec = dict(id=job_id, cluster=socket.gethostname(), name="demo", backend=backend, nodes=1,
               gpus_per_node=2, time_limit="00:10:00", log_dir=str(log_dir),
               config="jobs/demo.yaml", overrides=[], cwd=str(home),
               submitted_at=submitted_at or time.time() - 100)
    rec.update(kw)
    records.write_record(rec)


@pytest.fixture
def sleeper():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield p
    p.kill()
    p.wait()


def completed_job(home, job_id="101"):
    d = home / "logs" / job_id
    for r in range(2):
        write_events(d, r, [start(r), step(r, 10, 50), step(r, 20, 100, loss=0.25),
                            ev(r, 21, "end", status="completed", step=100)])
        (d / f"rank{r}.log").write_text("".join(f"r{r} line {i}\n" for i in range(30)))
    record(home, job_id, d, submitted_at=time.time() - 200)
    return d


def running_local_job(home, pid, job_id="local-run"):
    d = home / "logs" / job_id
    for r in range(2):
        write_events(d, r, [start(r), step(r, 10, 10), step(r, 30, 30)])
        (d / f"rank{r}.log").write_text(f"r{r} started\n")
    record(home, job_id, d, backend="local", pids=[pid], pid_times=[start_time(pid)], time_limit=None)
    return d


def test_table_newest_first_with_progress_from_any_directory(home, sleeper):
    completed_job(home)
    running_local_job(home, sleeper.pid)
    rows = json.loads(status(home, "--json").stdout)
    assert [r["id"] for r in rows] == ["local-run", "101"]
    run, done = rows
    assert (run["state"], run["source"], run["backend"]) == ("RUNNING", "processes", "local")
    assert run["progress"]["step"] == 30 and run["progress"]["percent"] == 30.0
    # 20 steps in 20 s -> 70 steps left take about 70 s
    assert run["progress"]["eta_s"] == pytest.approx(70.0, rel=0.01)
    assert (done["state"], done["source"], done["restarts"]) == ("COMPLETED", "logs", 0)
    assert done["progress"]["loss"] == 0.25 and done["progress"]["samples_per_s"] == 321.0
    assert any("slurm" in t for t in done["tried"])  # it looked for Slurm first and says so
    text = status(home, "--wide").stdout
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["ID", "NAME", "BACKEND", "STATE"]
    # submitted from `home`, listed from home/elsewhere: marked, and the mark explained
    assert lines[1].split()[:5] == ["local-run", "demo*", "local", "RUNNING", "1x2"]
    assert "s30/100 30%" in lines[1] and str(home / "logs" / "local-run") in lines[1]
    assert "321 smp/s" in lines[1]
    assert lines[2].split()[:4] == ["101", "demo*", "sbatch", "COMPLETED"]
    assert "/00:10:00" in lines[2]
    assert lines[2].split()[-2] == "-", lines[2]  # an ended job has no ETA (not 00:00:00)
    assert lines[3].startswith("* submitted from another directory") and "--here" in lines[3]
    assert "ETA" not in status(home, "101").stdout
    # into a pipe the table fits 100 columns, every id whole
    fit = status(home).stdout.splitlines()
    assert max(map(len, fit)) <= 100 and [ln.split()[0] for ln in fit[1:3]] == ["local-run", "101"], fit
    # --here: only the jobs submitted from this directory (or below it)
    assert "no jobs submitted from" in status(home, "--here").stdout
    here = status(home, "--here", "--wide", cwd=home).stdout.splitlines()
    assert [ln.split()[:2] for ln in here[1:]] == [["local-run", "demo"], ["101", "demo"]], here
    assert [r["id"] for r in json.loads(status(home, "--here", "--json", cwd=home).stdout)] == ["local-run", "101"]
    assert json.loads(status(home, "--here", "--json").stdout) == []


def test_limit(home):
    completed_job(home, "101")
    completed_job(home, "102")
    rows = json.loads(status(home, "--json", "--limit", "1").stdout)
    assert [r["id"] for r in rows] == ["102"]


def test_no_jobs_yet(home):
    assert "no ddp_hpc jobs recorded" in status(home).stdout
    assert json.loads(status(home, "--json").stdout) == []


def test_failed_job_names_first_rank_exception_and_traceback(home):
    d = home / "logs" / "202"
    tb = ("Traceback (most recent call last):\n  File \"loop.py\", line 9, in step\n"
          "    batch = next(it)\nInjectedFailure: injected failure on rank 3")
    for r in range(4):
        evs = [start(r, ws=4), step(r, 5, 10)]
        if r == 3:
            evs += [ev(3, 6, "error", exc_type="InjectedFailure", message="injected failure on rank 3",
                       traceback=tb), ev(3, 6.1, "end", status="failed", step=10)]
        else:
            evs += [ev(r, 8, "error", exc_type="RuntimeError", message="Connection closed by peer",
                       traceback="Traceback\nRuntimeError: Connection closed by peer")]
        write_events(d, r, evs)
    (d / "slurm-202.out").write_text("srun: error: n2: task 3: Exited with exit code 1\n"
                                     "srun: error: n1: tasks 0-2: Killed\n")
    record(home, "202", d)
    text = status(home, "202").stdout
    assert "State:      FAILED" in text and "[source: logs]" in text
    assert ("First failure: rank 3 on h (restart 0, from error event): "
            "InjectedFailure: injected failure on rank 3") in text
    assert "    InjectedFailure: injected failure on rank 3" in text
    assert "srun: rank 0: killed, rank 1: killed, rank 2: killed, rank 3: 1" in text
    js = json.loads(status(home, "202", "--json").stdout)
    assert js["failure"]["rank"] == 3 and js["failure"]["exc_type"] == "InjectedFailure"
    assert js["rank_exit_codes"] == {"0": -1, "1": -1, "2": -1, "3": 1}
    assert sorted(js["last_events"]) == ["0", "1", "2", "3"]
    assert js["last_events"]["3"]["event"] == "end"


def test_local_processes_gone_without_end_event_is_failed(home):
    d = home / "logs" / "local-dead"
    write_events(d, 0, [start(0, ws=1), step(0, 5, 10)])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    record(home, "local-dead", d, backend="local", pids=[dead.pid])
    js = json.loads(status(home, "local-dead", "--json").stdout)
    assert js["state_name"] == "FAILED" and js["source"] == "processes"
    assert js["failure"]["rank"] == 0 and js["failure"]["basis"] == "events stopped first"


def test_requeued_job_shows_restart_count_and_both_runs(home):
    d = home / "logs" / "303"
    for r in range(2):
        write_events(d, r, [start(r), step(r, 5, 20),
                            ev(r, 6, "preempt", signal="USR2", reason="preemption", step=20),
                            ev(r, 7, "end", status="preempted", step=20)])
        write_events(d, r, [start(r, 30, restart=1), step(r, 40, 60, restart=1)])
    write_events(d, 0, [ev(0, 6.5, "requeue", job_id="303")])
    record(home, "303", d)
    js = json.loads(status(home, "303", "--json").stdout)
    assert js["restarts"] == 1
    assert [(r["restart"], r["end_status"], r["preempt_reason"], r["requeued"]) for r in js["runs"]] == \
        [(0, "preempted", "preemption", True), (1, None, None, False)]
    text = status(home, "303").stdout
    assert "restart 0: ranks 2, last step 20, preempted (preemption), requeue requested" in text
    assert "restart 1: ranks 2, last step 60, no end event" in text


def test_logs_are_rank_prefixed_tails(home):
    d = completed_job(home)
    (d / "rank1.out").write_text("Traceback (most recent call last):\nValueError: x\n")
    out = status(home, "101", "--logs", "-n", "2").stdout
    assert out.splitlines() == ["[rank 0] r0 line 28", "[rank 0] r0 line 29",
                                "[rank 1] r1 line 28", "[rank 1] r1 line 29"]
    assert status(home, "101", "--logs", "--rank", "1", "-n", "1").stdout == "[rank 1] r1 line 29\n"
    assert status(home, "101", "--logs", "--rank", "1", "--out").stdout.splitlines() == \
        ["[rank 1 out] Traceback (most recent call last):", "[rank 1 out] ValueError: x"]
    js = json.loads(status(home, "101", "--logs", "-n", "1", "--json").stdout)
    assert js == [{"rank": 0, "file": "rank0.log", "line": "r0 line 29"},
                  {"rank": 1, "file": "rank1.log", "line": "r1 line 29"}]


def test_logs_name_the_rank_once_and_say_which_file_is_which(home):
    d = completed_job(home)
    # the training core's own line format names the rank after the time stamp
    with open(d / "rank1.log", "a") as f:
        f.write("2026-11-22 15:00:00 [rank 1] epoch 1 loss 0.25\n")
    p = status(home, "101", "--logs", "--rank", "1", "-n", "1")
    assert p.stdout == "[rank 1] 2026-11-22 15:00:00 epoch 1 loss 0.25\n"
    # stderr (not the log lines on stdout) says which file to read first and what the other holds
    assert "rank{R}.log = the training log: read it first" in p.stderr
    assert "rank{R}.out = raw stdout/stderr: tracebacks" in p.stderr
    js = json.loads(status(home, "101", "--logs", "--rank", "1", "-n", "1", "--json").stdout)
    assert js == [{"rank": 1, "file": "rank1.log", "line": "2026-11-22 15:00:00 [rank 1] epoch 1 loss 0.25"}]
    detail = status(home, "101").stdout
    assert "            rank{R}.log  the training log: read it first\n" in detail
    assert "            rank{R}.out  raw stdout/stderr: tracebacks" in detail


def test_a_range_job_shrunk_inside_its_allocation_shows_the_nodes_of_its_newest_run(home):
    """--nodes 1-2, started on 2 nodes, restarted by the supervisor on 1 after a lost node: the
    header counts the newest run's nodes (its start events), not the first run's or MAX."""
    d = home / "logs" / "711"
    for r in range(4):
        write_events(d, r, [{**start(r, ws=4), "num_nodes": 2, "device": "cpu"}, step(r, 10, 5)])
    for r in range(2):
        write_events(d, r, [{**start(r, t=20, restart=1), "num_nodes": 1, "device": "cpu"}, step(r, 30, 8, restart=1)])
    (d / "restarts.jsonl").write_text(json.dumps({"restart": 1, "job_id": "711", "trigger": "node down",
                                                  "world_before": 4, "world_after": 2}) + "\n")
    record(home, "711", d, nodes=2, min_nodes=1)
    header = status(home, "711").stdout.splitlines()[0]
    assert header == "Job 711 (demo), backend sbatch, 1 of 1-2 nodes x 2 processes on CPU"


def test_one_duration_format_and_the_shape_of_a_cpu_run(home):
    d = home / "logs" / "707"
    for r in range(2):
        write_events(d, r, [{**start(r), "device": "cpu"}, step(r, 10, 50),
                            ev(r, 70, "end", status="completed", step=100)])
    record(home, "707", d, time_limit="30")  # sbatch's minutes
    completed_job(home, "708")  # a run whose events do not name the device
    # --nodes 2-4 (the record keeps MAX and min_nodes): the nodes the run got, else the range
    for r in range(2):
        write_events(home / "logs" / "709", r, [{**start(r), "num_nodes": 3}, step(r, 10, 50)])
    record(home, "709", home / "logs" / "709", nodes=4, min_nodes=2)
    record(home, "710", home / "logs" / "710", nodes=4, min_nodes=2)
    assert status(home, "709").stdout.splitlines()[0] == "Job 709 (demo), backend sbatch, 3 of 2-4 nodes x 2 GPUs"
    assert status(home, "710").stdout.splitlines()[0] == "Job 710 (demo), backend sbatch, 2-4 nodes x 2 GPUs"
    text = status(home, "707").stdout
    assert text.splitlines()[0] == "Job 707 (demo), backend sbatch, 1 node x 2 processes on CPU"
    assert "Elapsed:    00:01:10 / limit 00:30:00" in text
    assert "(s)" not in text
    assert status(home, "708").stdout.splitlines()[0] == "Job 708 (demo), backend sbatch, 1 node x 2 GPUs"
    rows = {ln.split()[0]: ln.split() for ln in status(home, "--wide").stdout.splitlines()[1:]}
    assert rows["707"][4:6] == ["1x2cpu", "00:01:10/00:30:00"]
    assert rows["708"][4:6] == ["1x2", "00:00:21/00:10:00"]
    assert "3x2" in rows["709"] and "2-4x2" in rows["710"]   # their STATE cells hold spaces
    js = json.loads(status(home, "707", "--json").stdout)
    assert (js["device"], js["elapsed"], js["time_limit"]) == ("cpu", "00:01:10", "00:30:00")


def test_follow_prints_new_lines_until_the_job_ends(home, sleeper):
    d = running_local_job(home, sleeper.pid)
    p = subprocess.Popen([sys.executable, "-m", "ddp_hpc.status", "local-run", "--logs", "--follow",
                          "--rank", "1"], cwd=home, env=env_for(home), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(2)
        with open(d / "rank1.log", "a") as f:
            f.write("r1 step 40\nr1 step 50\n")
        time.sleep(1.5)
        assert p.poll() is None  # the processes still run: keep following
        with open(d / "rank1.log", "a") as f:
            f.write("r1 end\n")
        write_events(d, 1, [ev(1, 90, "end", status="completed", step=100)])
        write_events(d, 0, [ev(0, 90, "end", status="completed", step=100)])
        sleeper.send_signal(signal.SIGKILL)
        sleeper.wait()
        out, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == 0, err
    assert out.splitlines() == ["[rank 1] r1 started", "[rank 1] r1 step 40", "[rank 1] r1 step 50",
                                "[rank 1] r1 end"]


def test_watch_refreshes(home):
    completed_job(home)
    out = status(home, "--watch", "0.2", "--count", "3", "--json").stdout
    dec, docs, pos = json.JSONDecoder(), [], 0
    while pos < len(out.strip()):
        doc, end = dec.raw_decode(out, pos)
        docs.append(doc)
        pos = end + 1
    assert len(docs) == 3 and all(doc[0]["id"] == "101" for doc in docs)
    text = status(home, "101", "--watch", "0.1", "--count", "2").stdout
    assert text.count("State:      COMPLETED") == 2 and text.count("-- ") == 2


def test_damaged_event_lines_are_skipped_and_reported(home):
    d = completed_job(home)
    with open(d / "rank0.events.jsonl", "a") as f:
        f.write('{"time": 12, "ev')
    js = json.loads(status(home, "101", "--json").stdout)
    assert js["state_name"] == "COMPLETED"
    assert any("1 unreadable line" in n for n in js["notes"])


@pytest.mark.parametrize("args,code,needle", [
    (["1;touch /tmp/pwned"], 2, "'1;touch /tmp/pwned' (command line) is not a job id"),
    (["--rank", "1"], 2, "go with --logs"),
    (["--logs"], 2, "--logs needs a job id"),
    (["101", "--logs", "-n", "-1"], 2, "-n -1"),
    (["101", "--logs", "--follow", "--watch"], 2, "do not combine"),
    (["424242"], 1, "job '424242': no job record in"),
    (["--limit", "-3"], 2, "--limit -3"),
    (["101", "--wide"], 2, "--wide and --here go with the table of jobs"),
    (["101", "--here"], 2, "--wide and --here go with the table of jobs"),
    (["local-nothing"], 1, "error: no job record with id 'local-nothing'"),
    (["local-nothing"], 1, "\nHINT: recent ids there"),
    (["424242"], 1, "\nHINT: check the id with `python -m ddp_hpc.status`"),
])
def test_bad_requests_fail_with_the_value_and_the_fix(home, args, code, needle):
    p = status(home, *args, check=False)
    assert p.returncode == code, (p.stdout, p.stderr)
    assert needle in p.stderr
    assert not Path("/tmp/pwned").exists()


def test_logs_of_a_job_without_files_says_so(home):
    record(home, "505", home / "logs" / "505")
    p = status(home, "505", "--logs", check=False)
    assert p.returncode == 1 and "no log files" in p.stderr and "--follow" in p.stderr


def test_unrecorded_job_with_log_dir(home):
    d = completed_job(home, "606")
    for f in Path(records.records_dir()).glob("606*.json"):
        f.unlink()
    js = json.loads(status(home, "606", "--log-dir", str(d), "--json").stdout)
    assert js["state_name"] == "COMPLETED" and js["log_dir"] == str(d) and js["name"] is None


@pytest.mark.slow
def test_local_backend_job_where_rank1_raises_is_failed_naming_rank1(home):
    """End to end: a real 2-process local job (ddp_hpc.submit, detached) whose rank 1 raises."""
    env = env_for(home)
    env["PYTHONPATH"] = str(REPO)
    p = subprocess.run(
        [sys.executable, "-m", "ddp_hpc.submit", "--backend", "local", "--nodes", "1", "--gpus", "2",
         str(REPO / "jobs" / "demo.yaml"), "--", "train.epochs=1",
         "data.dataset=tests.cluster.status_helpers:failing_synthetic", "data.kwargs.fail_rank=1",
         "data.kwargs.after=1500", f"log.dir={home / 'runs'}", "checkpoint.every_steps=0"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    job_id = p.stdout.strip().splitlines()[-1]
    assert job_id.startswith("local-")
    deadline = time.monotonic() + 150
    seen = []
    while time.monotonic() < deadline:
        js = json.loads(status(home, job_id, "--json").stdout)
        seen.append(js["state"])
        if js["state_name"] != "RUNNING":
            break
        time.sleep(1)
    assert js["state_name"] == "FAILED", (seen, js)
    assert "RUNNING" in seen
    f = js["failure"]
    assert f["rank"] == 1 and f["exc_type"] in ("InjectedFailure", "status_helpers.InjectedFailure"), f
    assert "injected failure on rank 1" in f["message"]
    assert any("InjectedFailure" in ln for ln in f["traceback_tail"])
    assert js["progress"]["step"] >= 10  # it trained a while before failing (step events every 10)
    assert js["last_events"]["1"]["event"] == "end" and js["last_events"]["1"]["status"] == "failed"
    assert js["last_events"]["1"]["step"] >= 10  # the end event names the last finished step


@pytest.mark.parametrize("files", ["none", "traceback"])
def test_local_job_that_ended_before_its_first_event_is_failed(home, files):
    """The driver cleared its pids (or died) and no rank wrote an event: FAILED, pointing at the
    driver's output, not UNKNOWN(logs have no end event yet) forever."""
    d = home / "logs" / "local-early"
    d.mkdir(parents=True)
    if files == "traceback":
        (d / "rank0.out").write_text("Traceback (most recent call last):\n  File \"run.py\", line 1, in "
                                     "<module>\nModuleNotFoundError: No module named 'foo'\n")
    record(home, "local-early", d, backend="local", pids=[])
    js = json.loads(status(home, "local-early", "--json").stdout)
    assert (js["state_name"], js["source"]) == ("FAILED", "processes")
    assert js["reason"] == f"ended before its first event; see {d}/local-driver.out"
    text = status(home, "local-early").stdout  # the first look kept the final state in the record
    assert (f"State:      FAILED   [source: record]   reason: ended before its first event; "
            f"see {d}/local-driver.out") in text
    if files == "traceback":
        assert js["failure"]["rank"] == 0 and js["failure"]["exc_type"] == "ModuleNotFoundError"


def test_sweep_table_shows_eval_metrics_and_each_tasks_overrides(home):
    tasks = []
    for i, lr in enumerate(("0.1", "0.01")):
        d = home / "logs" / "909" / str(i)
        for r in range(2):
            write_events(d, r, [start(r), step(r, 10, 100),
                                ev(r, 11, "eval", epoch=1, step=100, metrics={"accuracy": 0.9 - i / 10, "loss": 0.25}),
                                ev(r, 12, "end", status="completed", step=100)])
        tasks.append({"task_id": i, "overrides": [f"optim.lr={lr}", "seed=1"], "log_dir": str(d)})
    record(home, "909", home / "logs" / "909", array=tasks)
    completed_job(home, "101")  # no eval events: "-" in the new columns
    lines = status(home, "--wide").stdout.splitlines()
    head = lines[0].split()
    assert head[-3:] == ["EVAL", "OVERRIDES", "LOG"] or head[-4:] == ["EVAL", "OVERRIDES", "LOG", "DIR"]
    rows = {ln.split()[0]: ln for ln in lines[1:]}
    assert "accuracy=0.9 loss=0.25  optim.lr=0.1 seed=1" in rows["909_0"]
    assert "accuracy=0.8 loss=0.25  optim.lr=0.01 seed=1" in rows["909_1"]
    assert rows["101"].split()[-3:-1] == ["-", "-"]
    js = {r["id"]: r for r in json.loads(status(home, "--json").stdout)}
    assert js["909_1"]["eval_metrics"] == {"accuracy": 0.8, "loss": 0.25}
    assert js["909_1"]["overrides"] == ["optim.lr=0.01", "seed=1"] and js["101"]["overrides"] is None
    detail = status(home, "909_0").stdout
    assert "Eval:       accuracy=0.9, loss=0.25 (step 100)" in detail
    assert "Overrides:  optim.lr=0.1 seed=1" in detail


@pytest.mark.skipif(gpu_usable(os.environ), reason="this machine has a GPU driver: a script's device is its own choice")
def test_a_script_job_without_gpus_reads_on_cpu_like_a_config_job(home):
    """End to end on this machine without a GPU driver: a plain script and the demo config, each
    a real local 1 x 2 job; both read `1 node x 2 processes on CPU` and `1x2cpu`."""
    env = env_for(home)
    env["PYTHONPATH"] = str(REPO)
    (home / "plain.py").write_text("import time\nfor _ in range(3):\n    time.sleep(0.1)\n")
    ids = []
    for what in (["plain.py"], [str(REPO / "jobs" / "demo.yaml"), "--", "train.epochs=1", "data.kwargs.size=64",
                                 f"log.dir={home / 'runs'}", "checkpoint.every_steps=0"]):
        p = subprocess.run([sys.executable, "-m", "ddp_hpc.submit", "--backend", "local", "--nodes", "1", "--gpus",
                            "2", "--log-dir", str(home / "runs"), "--wait", *what],
                           cwd=home, env=env, capture_output=True, text=True, timeout=240)
        assert p.returncode == 0, p.stdout + p.stderr
        ids.append(json.loads(status(home, "--json").stdout)[0]["id"])
    for job_id in ids:
        js = json.loads(status(home, job_id, "--json").stdout)
        assert (js["state_name"], js["device"]) == ("COMPLETED", "cpu"), js
        assert status(home, job_id).stdout.splitlines()[0].endswith("1 node x 2 processes on CPU")
    rows = {ln.split()[0]: ln.split() for ln in status(home, "--wide").stdout.splitlines()[1:]}
    assert [rows[i][4] for i in ids] == ["1x2cpu", "1x2cpu"]
