"""python -m ddp_hpc.exec: real wrapper processes around real children (gloo on CPU where torch is
needed, plain Python elsewhere to keep the tests fast); no Slurm."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_hpc.judge.nodefiles import rank_events
from ddp_hpc.judge.reader import RunLogs
from ddp_hpc.launch import run_local, start_local

ROOT = Path(__file__).resolve().parents[1]
EXEC = [sys.executable, "-m", "ddp_hpc.exec"]
#: rank and job variables of an enclosing launcher that must not leak into these tests
DROP = re.compile(r"^(SLURM_\w+|SUBMITIT_\w+|TORCHELASTIC_\w+|RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE"
                  r"|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_\w+|MASTER_ADDR|MASTER_PORT|DDP_HPC_\w+|CUDA_VISIBLE_DEVICES)$")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not DROP.match(k)}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    return env


def events(log_dir: Path, rank: int) -> list[dict]:
    return rank_events(log_dir, rank).events


def kinds(log_dir: Path, rank: int) -> list[str]:
    return [e["event"] for e in events(log_dir, rank)]


def wait_for(cond, timeout: float = 60.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


TORCHRUN_SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
         "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
         "DDP_HPC_LOG_DIR"]
seen = {n: os.environ.get(n) for n in names}
seen.update(sum=t.item(), argv=sys.argv[1:], ddp_hpc=[m for m in sys.modules if m.startswith("ddp_hpc")])
print("SEEN " + json.dumps(seen), flush=True)
dist.destroy_process_group()
"""
TRICKY_ARGS = ["a b", "it's", '"quoted"', "$(touch x)", "*", "", "--lr=0.1"]


@pytest.mark.timeout(180)
def test_unmodified_torchrun_script_2x2(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(TORCHRUN_SCRIPT)
    log_dir = tmp_path / "logs"
    ddp_hpc = Path(sys.executable).with_name("ddp-hpc")
    p = subprocess.run([str(ddp_hpc), "launch", "--nodes", "2", "--procs-per-node", "2", "--log-dir",
                        str(log_dir), "--job-id", "t-2x2", "--", *EXEC, "--", sys.executable, str(script),
                        *TRICKY_ARGS], cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                       timeout=170)
    assert p.returncode == 0, p.stdout + p.stderr
    seen = []
    for r in range(4):
        line = next(ln for ln in (log_dir / f"rank{r}.out").read_text().splitlines() if ln.startswith("SEEN "))
        seen.append(json.loads(line[5:]))
    for r, s in enumerate(seen):
        assert (s["RANK"], s["LOCAL_RANK"], s["GROUP_RANK"], s["ROLE_RANK"]) == (
            str(r), str(r % 2), str(r // 2), str(r))
        assert (s["WORLD_SIZE"], s["LOCAL_WORLD_SIZE"], s["GROUP_WORLD_SIZE"], s["ROLE_WORLD_SIZE"]) == (
            "4", "2", "2", "4")
        assert s["TORCHELASTIC_RUN_ID"] == "t-2x2" and s["DDP_HPC_LOG_DIR"] == str(log_dir.resolve())
        assert s["sum"] == 10.0
        # the instrumentation, installed once the script imported torch (docs/scripts.md)
        assert "ddp_hpc.instrument.steps" in s["ddp_hpc"]
        assert s["argv"] == TRICKY_ARGS          # verbatim: no shell in between
    assert len({(s["MASTER_ADDR"], s["MASTER_PORT"]) for s in seen}) == 1
    assert not (tmp_path / "x").exists()
    for r in range(4):
        ev = events(log_dir, r)
        # the instrumentation adds when the process group came up (the restart phases) and that
        # the script's interpreter ends (no hang is called while it tears down)
        assert [e["event"] for e in ev] == ["start", "rendezvous", "progress", "end"], ev
        start, rdzv, leaving, end = ev
        assert rdzv["proc_start"] <= rdzv["called_at"] <= rdzv["up_at"] and leaving["phase"] == "exit"
        assert start["launcher"] == "exec/local" and start["world_size"] == 4 and start["num_nodes"] == 2
        assert start["local_rank"] == r % 2 and start["command"] == [sys.executable, str(script), *TRICKY_ARGS]
        assert start["job_id"] == "t-2x2" and isinstance(start["pid"], int)
        assert (end["status"], end["exit_code"], end["signal"], end["step"]) == ("completed", 0, None, None)
        assert end["duration_s"] > 0
    assert RunLogs(log_dir).outcome() == "completed"


FAIL_ON_RANK_1 = """
import os, time
if os.environ["RANK"] == "1":
    time.sleep(0.2)
    raise ValueError("bad value 42 on purpose")
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_a_rank_that_raises_gets_an_error_event_and_the_others_are_killed(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(FAIL_ON_RANK_1)
    res = run_local([*EXEC, "--", sys.executable, str(script)], nodes=1, procs_per_node=2,
                    log_dir=tmp_path, env=clean_env())
    assert res.first_failed_rank == 1 and res.returncodes[1] == 1 and res.exitcode == 1
    assert kinds(tmp_path, 1) == ["start", "error", "end"]
    _, err, end = events(tmp_path, 1)
    assert (err["exc_type"], err["message"]) == ("ValueError", "bad value 42 on purpose")
    assert 'raise ValueError("bad value 42 on purpose")' in err["traceback"]
    assert (err["exit_code"], err["signal"]) == (1, None)
    assert (end["status"], end["exit_code"]) == ("failed", 1)
    # rank 0 was stopped by the launcher: a consequence, not a cause
    assert kinds(tmp_path, 0) == ["start", "end"]
    assert events(tmp_path, 0)[-1]["status"] == "killed"
    failure = RunLogs(tmp_path).first_failure()
    assert (failure.rank, failure.basis, failure.exc_type) == (1, "error event", "ValueError")


SLEEP = "import time\ntime.sleep(60)\n"


@pytest.mark.timeout(60)
def test_a_child_killed_from_outside_is_named_with_its_signal(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text(SLEEP)
    run = start_local([*EXEC, "--", sys.executable, str(script)], nodes=1, procs_per_node=2,
                      log_dir=tmp_path, env=clean_env())
    try:
        wait_for(lambda: all(kinds(tmp_path, r)[:1] == ["start"] for r in (0, 1)), what="start events")
        os.kill(events(tmp_path, 1)[0]["pid"], signal.SIGKILL)     # the script, not its wrapper
        res = run.wait()
    finally:
        run.kill(grace=0)
    assert res.first_failed_rank == 1 and res.returncodes[1] == 128 + 9
    _, err, end = events(tmp_path, 1)
    assert (err["exc_type"], err["message"]) == ("Signal", "killed by signal 9 (SIGKILL)")
    assert (err["exit_code"], err["signal"]) == (None, "SIGKILL")
    assert (end["status"], end["signal"], end["exit_code"]) == ("failed", "SIGKILL", None)
    assert kinds(tmp_path, 0) == ["start", "end"] and events(tmp_path, 0)[-1]["status"] == "killed"


HANDLES_USR2 = """
import signal, sys, time
from pathlib import Path
def bye(signum, frame):
    print("got", signal.Signals(signum).name, flush=True)
    sys.exit(0)
signal.signal(signal.SIGUSR2, bye)
Path(sys.argv[1]).touch()
time.sleep(60)
sys.exit(5)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig, rc, status", [
    (signal.SIGUSR2, 0, "completed"),             # handled by the script
    (signal.SIGTERM, 128 + signal.SIGTERM, "killed"),
    (signal.SIGINT, 128 + signal.SIGINT, "interrupted"),
    (signal.SIGUSR1, 128 + signal.SIGUSR1, "killed"),   # not handled: dies of it, with a warning
])
def test_signals_to_the_wrapper_reach_the_child(tmp_path, sig, rc, status):
    script, ready, log_dir = tmp_path / "child.py", tmp_path / "ready", tmp_path / "logs"
    script.write_text(HANDLES_USR2)
    with open(tmp_path / "rank0.out", "wb") as out:
        proc = subprocess.Popen([*EXEC, "--log-dir", str(log_dir), "--", sys.executable, str(script), str(ready)],
                                env=clean_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(ready.exists, what="the child")
        os.kill(proc.pid, sig)                        # the wrapper only
        assert proc.wait(timeout=30) == rc
    finally:
        proc.kill()
    output = (tmp_path / "rank0.out").read_text()
    assert kinds(log_dir, 0) == ["start", "end"], output     # a stop from outside is no error
    end = events(log_dir, 0)[-1]
    assert end["status"] == status
    if sig == signal.SIGUSR2:
        assert "got SIGUSR2" in output and end["exit_code"] == 0
    if sig == signal.SIGUSR1:
        assert end["signal"] == "SIGUSR1" and "does not handle that signal" in (log_dir / "rank0.log").read_text()


@pytest.mark.timeout(60)
def test_exit_status_survives_an_unwritable_log_dir(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    p = subprocess.run([*EXEC, "--log-dir", str(not_a_dir), "--", sys.executable, "-c", "raise SystemExit(3)"],
                       env=clean_env(), capture_output=True, text=True, timeout=50)
    assert p.returncode == 3
    assert p.stderr.count("cannot write rank 0's run log") == 1, p.stderr


@pytest.mark.timeout(60)
def test_a_setup_that_would_hang_is_refused_with_an_error_event(tmp_path):
    """SLURM_* variables of another task (SLURM_TASK_PID is no ancestor): exit 2 before the
    command starts, the error on stderr and in rank 1's events."""
    env = clean_env(SLURM_JOB_ID="77", SLURM_STEP_ID="0", SLURM_PROCID="1", SLURM_LOCALID="1",
                    SLURM_NODEID="0", SLURM_NTASKS="2", SLURM_STEP_NODELIST="n1",
                    SLURM_STEP_TASKS_PER_NODE="2", SLURM_TASK_PID="999999999")
    p = subprocess.run([*EXEC, "--log-dir", str(tmp_path), "--", sys.executable, "-c", "print('ran')"],
                       env=env, capture_output=True, text=True, timeout=50)
    assert p.returncode == 2 and "ran" not in p.stdout
    assert p.stderr.startswith("python -m ddp_hpc.exec: error: SLURM_TASK_PID=999999999") and "HINT:" in p.stderr
    (err,) = events(tmp_path, 1)
    assert err["event"] == "error" and err["exc_type"] == "EnvError" and err["exit_code"] == 2


def test_the_end_events_step_is_the_newest_step_the_child_appended(tmp_path):
    """outcome.last_step reads only what follows the offset the wrapper took after its start
    event: an earlier run's steps never count; an epoch event after the step and a torn last
    line do not hide it."""
    from ddp_hpc.exec.outcome import last_step
    p = tmp_path / "node0.events.jsonl"
    p.write_text("".join(json.dumps(e) + "\n" for e in [{"event": "step", "step": 40, "rank": 0},
                                                        {"event": "start", "rank": 0}]))
    offset = p.stat().st_size
    assert last_step(p, offset, 0) is None and last_step(None, 0, 0) is None
    with open(p, "a") as f:
        for e in [{"event": "step", "step": 3}, {"event": "step", "step": "x"}, {"event": "epoch", "epoch": 1},
                  {"event": "step", "step": 9, "rank": 1}]:      # the node's other rank
            f.write(json.dumps({"rank": 0, **e}) + "\n")
        f.write('{"event": "step", "st')
    assert last_step(p, offset, 0) == 3 and last_step(p, 0, 0) == 3 and last_step(p, 0, 1) == 9


def test_usage_errors():
    p = subprocess.run([*EXEC], capture_output=True, text=True, env=clean_env(), timeout=50)
    assert p.returncode == 2 and "no command to run" in p.stderr
    p = subprocess.run([*EXEC, "--", "no-such-program-xyz"], capture_output=True, text=True,
                       env=clean_env(), timeout=50)
    assert p.returncode == 127 and "cannot start 'no-such-program-xyz'" in p.stderr


def test_in_process_run_restores_signal_handlers(tmp_path, monkeypatch):
    """What a submitit task does: ``ddp_hpc.exec.run(cmd, log_dir)`` returns the exit status."""
    from ddp_hpc import exec as ddp_exec

    for k in [k for k in os.environ if DROP.match(k)]:
        monkeypatch.delenv(k)
    before = signal.getsignal(signal.SIGUSR2)
    assert ddp_exec.run([sys.executable, "-c", "import os; raise SystemExit(int(os.environ['WORLD_SIZE']) + 40)"],
                        str(tmp_path)) == 41
    assert signal.getsignal(signal.SIGUSR2) is before
    assert events(tmp_path, 0)[-1]["status"] == "failed"


def _env(local_world_size: int):
    local_rank = local_world_size - 1
    from ddp_hpc.env import DistEnv
    return DistEnv(rank=local_rank, local_rank=local_rank, world_size=local_world_size,
                   local_world_size=local_world_size, node_rank=0, num_nodes=1, master_addr="127.0.0.1",
                   master_port=29500, hostnames=("h",), job_id=None, restart_count=0, launcher="local")


@pytest.mark.parametrize("visible, lws, words", [
    ("0", 2, "each task sees only its own GPU"),              # --gpus-per-task=1: LOCAL_RANK fails
    ("0,1", 4, "has no GPU to bind"),                          # fewer GPUs than tasks
    ("0,1", 2, None),                                          # every task sees the node's GPUs
    ("0", 1, None),
    (None, 2, None),                                           # unknown without torch: no guess
    ("", 2, None),                                             # CPU only
])
def test_binding_note(visible, lws, words):
    from ddp_hpc.exec.wrapper import binding_note
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    note = binding_note(_env(lws), environ)
    if words is None:
        assert note is None
    else:
        assert words in note and "set_device(LOCAL_RANK" in note and "ddp_hpc.dist.setup_ddp()" in note


def test_per_task_gpu_binding_warns_in_the_rank_log(tmp_path):
    """Two tasks of one node, each bound to its own GPU as Slurm's --gpus-per-task=1 binds them
    (each sees one device, CUDA_VISIBLE_DEVICES=<its own>); started by hand with torchrun's
    variables, since the local launcher gives a pretend node's ranks the node's GPUs."""
    procs = []
    for r in (0, 1):
        env = clean_env(CUDA_VISIBLE_DEVICES=str(r), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                        LOCAL_WORLD_SIZE="2", GROUP_RANK="0", GROUP_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                        MASTER_PORT="29555", TORCHELASTIC_RUN_ID="per-task", DDP_HPC_LOG_DIR=str(tmp_path))
        with open(tmp_path / f"rank{r}.out", "wb") as out:
            procs.append(subprocess.Popen([*EXEC, "--", sys.executable, "-c", "pass"], env=env,
                                          stdout=out, stderr=subprocess.STDOUT))
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    for r in (0, 1):
        assert "WARNING: each task sees only its own GPU" in (tmp_path / f"rank{r}.log").read_text()
        assert "WARNING" in (tmp_path / f"rank{r}.out").read_text()
