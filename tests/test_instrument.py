"""ddp_hpc.exec's zero-code instrumentation (ddp_hpc/instrument/): real wrapper processes around
real children, gloo on CPU where torch is needed, plain Python elsewhere (fast)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from ddp_hpc.instrument.hooks import when_imported
from ddp_hpc.instrument.steps import StepCounter
from ddp_hpc.judge.nodefiles import rank_events
from ddp_hpc.judge.reader import RunLogs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "plain_ddp.py"
EXEC = [sys.executable, "-m", "ddp_hpc.exec"]
DDP_HPC = str(Path(sys.executable).with_name("ddp-hpc"))

#: rank and job variables of an enclosing launcher that must not leak into these tests
DROP = re.compile(r"^(SLURM_\w+|SUBMITIT_\w+|TORCHELASTIC_\w+|TORCH_NCCL_\w+|TORCH_FR_\w+|RANK|LOCAL_RANK|WORLD_SIZE"
                  r"|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_\w+|MASTER_ADDR|MASTER_PORT|DDP_HPC_\w+"
                  r"|CUDA_VISIBLE_DEVICES)$")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not DROP.match(k)}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    return env


def events(log_dir: Path, rank: int, kind: str | None = None) -> list[dict]:
    evs = rank_events(log_dir, rank).events
    return [e for e in evs if kind is None or e["event"] == kind]


def run_exec(tmp_path: Path, code: str, *args: str, env: dict | None = None, name: str = "s.py"):
    """``python -m ddp_hpc.exec -- python <code as a file> ARGS`` as rank 0 of 1."""
    script = tmp_path / name
    script.write_text(textwrap.dedent(code))
    log_dir = tmp_path / "logs"
    p = subprocess.run([*EXEC, "--log-dir", str(log_dir), "--", sys.executable, str(script), *args],
                       env=env or clean_env(RANK="0", WORLD_SIZE="1"), capture_output=True,
                       text=True, timeout=120)
    return p, log_dir


# --------------------------------------------------------------------------- in-process units
def test_several_optimizers_in_one_training_step_count_one_step():
    c = StepCounter()
    g, d, other = object(), object(), object()
    news = [c.stepped(o) for o in (d, g, d, g, d, g)]
    assert news == [True, False, True, False, True, False] and c.count == 3
    # a new optimizer (a second phase) joins the step under way, then counts one per step
    assert [c.stepped(other) for _ in range(3)] == [False, True, True] and c.count == 5


def test_when_imported_runs_after_the_first_import_and_at_once_when_imported(tmp_path, monkeypatch):
    (tmp_path / "late_mod_x1.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    when_imported("late_mod_x1", lambda m: seen.append(m.VALUE + 1))
    assert seen == []
    import late_mod_x1
    assert seen == [42] and late_mod_x1.__loader__.__class__.__name__ == "SourceFileLoader"
    when_imported("late_mod_x1", lambda m: seen.append(m.VALUE))
    assert seen == [42, 41]
    when_imported("json", lambda m: seen.append(type(m)))
    assert seen[-1] is types.ModuleType


# --------------------------------------------------------------------------- no torch: fast
NO_TORCH = """
import json, os, sys
import sitecustomize
mods = sorted(m for m in sys.modules if m.startswith("ddp_hpc"))
print("SEEN " + json.dumps({"torch": "torch" in sys.modules, "mods": mods,
      "boot": os.environ.get("DDP_HPC_INSTRUMENT_BOOT"), "pythonpath": os.environ.get("PYTHONPATH"),
      "user_site": getattr(sitecustomize, "USER", None),
      "elastic": {k: os.environ.get(k) for k in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                  "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_TRACE_BUFFER_SIZE")}}))
"""


def _seen(p) -> dict:
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("SEEN "))[5:])


def test_a_script_without_torch_runs_as_before_and_the_users_sitecustomize_still_runs(tmp_path):
    user = tmp_path / "usersite"
    user.mkdir()
    (user / "sitecustomize.py").write_text("USER = 'mine'\n")
    env = clean_env(RANK="0", WORLD_SIZE="1",
                    PYTHONPATH=os.pathsep.join([str(user), os.environ.get("PYTHONPATH", str(ROOT))]))
    seen = _seen(run_exec(tmp_path, NO_TORCH, env=env)[0])
    assert seen["torch"] is False and seen["user_site"] == "mine"
    assert seen["boot"] is None and seen["pythonpath"] == env["PYTHONPATH"]   # given back unchanged
    assert "ddp_hpc.instrument.boot" in seen["mods"] and "ddp_hpc.progress" not in seen["mods"]
    assert seen["elastic"] == {"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                               "TORCHELASTIC_ERROR_FILE": str((tmp_path / "logs" / "rank0.error.json").resolve()),
                               "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_TRACE_BUFFER_SIZE": None}
    # the opt-out: nothing of ddp_hpc in the script; the user's own values are kept
    env.update(DDP_HPC_INSTRUMENT="0", TORCHELASTIC_MAX_RESTARTS="3")
    seen = _seen(run_exec(tmp_path, NO_TORCH, env=env)[0])
    assert seen["mods"] == [] and seen["user_site"] == "mine"
    assert seen["elastic"]["TORCHELASTIC_MAX_RESTARTS"] == "3"


MISSING_SITE = """
import sys
from pathlib import Path
import ddp_hpc.exec.instrumented as instrumented
instrumented.SITE_DIR = Path(sys.argv[1])     # an installation without the start-up folder
from ddp_hpc.exec.wrapper import main
sys.exit(main(sys.argv[2:]))
"""


def test_an_installation_without_the_site_folder_refuses_to_run_the_script_blind(tmp_path):
    ran = tmp_path / "ran"
    script = tmp_path / "s.py"
    script.write_text(f"open({str(ran)!r}, 'w').close()\n")
    log_dir = tmp_path / "logs"
    argv = [sys.executable, "-c", MISSING_SITE, str(tmp_path / "no-site"), "--log-dir", str(log_dir), "--",
            sys.executable, str(script)]
    p = subprocess.run(argv, env=clean_env(RANK="0", WORLD_SIZE="1"), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and not ran.exists(), p.stderr
    assert f"cannot instrument {sys.executable!r}: {tmp_path}/no-site/sitecustomize.py is missing" in p.stderr
    assert "HINT: reinstall ddp_hpc" in p.stderr and "DDP_HPC_INSTRUMENT=0" in p.stderr
    (err,) = events(log_dir, 0, "error")
    assert "sitecustomize.py is missing from this installation" in err["message"] and err["exit_code"] == 2
    # the opt-out runs the script, uninstrumented
    p = subprocess.run(argv, env=clean_env(RANK="0", WORLD_SIZE="1", DDP_HPC_INSTRUMENT="0"),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and ran.exists(), p.stderr


TEARDOWN = """
import os, sys
class Native:
    def __del__(self, abort=os.abort):
        abort()        # stands for a C++ destructor's std::terminate at interpreter exit
keep = Native()
if sys.argv[1] == "exit":
    sys.exit(int(sys.argv[2]))
if sys.argv[1] == "raise":
    sys.excepthook = lambda *exc: print("the script's own hook")    # rich.traceback.install() does this
    raise ValueError("bad 7")
if sys.argv[1] == "atexit":   # an abort while the script's own exit code still runs: a crash
    import atexit
    atexit.register(os.abort)
"""


@pytest.mark.timeout(600)   # 16 runs: ~60 s on an idle 2-core machine, 120 s and more beside other work
def test_a_native_abort_after_the_script_ended_is_no_failure_many_runs(tmp_path):
    """The script's own exit code wins over an abort in native teardown; an abort while its own
    Python code still runs (an atexit handler) stays a crash."""
    cases = [(("end",), 0, "completed")] * 12 + [(("exit", "0"), 0, "completed"), (("exit", "3"), 3, "failed"),
                                                (("raise",), 1, "failed"), (("atexit",), 134, "failed")]
    for args, rc, status in cases:
        p, log_dir = run_exec(tmp_path, TEARDOWN, *args)
        assert p.returncode == rc, (args, p.stderr)
        end = events(log_dir, 0, "end")[-1]
        assert end["status"] == status, (args, end)
        assert end["teardown"] == (None if args == ("atexit",) else "SIGABRT"), (args, end)
    errors = events(log_dir, 0, "error")
    assert [e["message"] for e in errors] == ["exited with status 3", "exited with status 1",
                                              "killed by signal 6 (SIGABRT)"]
    assert "in the interpreter's native teardown" in (log_dir / "rank0.log").read_text()
    assert "Fatal Python error: Aborted" in errors[-1]["traceback"]


SLOW_TEARDOWN = """
import sys, time
class SlowTeardown:
    def __del__(self, marker=sys.argv[1], sleep=time.sleep, create=open):
        create(marker, "w").close()  # after the exit record: atexit ran, module teardown has begun
        sleep(60)                    # stands for a teardown that outlasts a peer's reaction
keep = SlowTeardown()
raise RuntimeError("boom before the stop")
"""


def test_a_rank_that_raised_before_the_launcher_stopped_it_is_the_cause_not_one_more_stopped(tmp_path):
    """On a loaded machine a rank's teardown after its uncaught exception outlasted its peer's
    reaction: the peer saw the connection close, failed and exited first, the launcher stopped
    the others with SIGTERM, and the rank that raised read as "killed" with no error, so status
    and submit --wait named the peer. A SIGTERM that came after the script's exit record only
    cut its teardown short: the rank failed with its own exception."""
    script, marker, log_dir = tmp_path / "s.py", tmp_path / "tearing-down", tmp_path / "logs"
    script.write_text(textwrap.dedent(SLOW_TEARDOWN))
    log_dir.mkdir()
    with open(log_dir / "rank0.out", "ab") as out:   # where the launcher sends a rank's output
        p = subprocess.Popen([*EXEC, "--log-dir", str(log_dir), "--", sys.executable, str(script), str(marker)],
                             env=clean_env(RANK="0", WORLD_SIZE="1"), stdout=out, stderr=out)
    try:
        for _ in range(1200):
            if marker.exists() or p.poll() is not None:
                break
            time.sleep(0.1)
        assert marker.exists(), (log_dir / "rank0.out").read_text()
        p.send_signal(signal.SIGTERM)       # the launcher stopping "the other ranks"
        p.wait(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 1, (log_dir / "rank0.out").read_text()
    end = events(log_dir, 0, "end")[-1]
    assert (end["status"], end["exit_code"], end["teardown"]) == ("failed", 1, "SIGTERM"), end
    (error,) = events(log_dir, 0, "error")
    assert (error["exc_type"], error["message"]) == ("RuntimeError", "boom before the stop"), error
    # a stop that comes while the script still runs stays a stop: no error, "killed"
    marker.unlink()
    script.write_text("import time\ntime.sleep(60)\n")
    with open(log_dir / "rank0.out", "ab") as out:
        p = subprocess.Popen([*EXEC, "--log-dir", str(log_dir), "--", sys.executable, str(script)],
                             env=clean_env(RANK="0", WORLD_SIZE="1"), stdout=out, stderr=out)
    try:
        for _ in range(1200):
            if len(events(log_dir, 0, "start")) == 2:
                break
            time.sleep(0.1)
        time.sleep(1.0)
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=120)
    finally:
        p.kill()
    assert events(log_dir, 0, "end")[-1]["status"] == "killed" and len(events(log_dir, 0, "error")) == 1


# --------------------------------------------------------------------------- real torch
def _launch(tmp_path: Path, *script_args: str, procs: int = 2, env: dict | None = None) -> Path:
    log_dir = tmp_path / "logs"
    p = subprocess.run([DDP_HPC, "launch", "--nodes", "1", "--procs-per-node", str(procs), "--log-dir",
                        str(log_dir), "--", *EXEC, "--", sys.executable, str(SCRIPT), *script_args],
                       env=env or clean_env(), capture_output=True, text=True, timeout=170)
    assert p.returncode == 0, p.stdout + p.stderr + "".join(
        (log_dir / f"rank{r}.out").read_text() for r in range(procs) if (log_dir / f"rank{r}.out").exists())
    return log_dir


@pytest.mark.timeout(180)
def test_a_plain_ddp_script_gets_step_events_from_the_optimizer_hook(tmp_path):
    """Two optimizers per step (a GAN's pattern) count one step; loss, lr, data wait, steps/s."""
    log_dir = _launch(tmp_path, "--steps", "6", "--step-sleep", "0.4", "--gan")
    for r in range(2):
        steps = events(log_dir, r, "step")
        assert len(steps) >= 3 and steps[-1]["step"] == 6, steps       # the last one flushed at exit
        assert [s["step"] for s in steps] == sorted({s["step"] for s in steps})
        later = steps[1:]
        assert all(s["loss"] > 0 and s["lr"] == 0.05 and s["data_s"] >= 0 for s in later)
        # a step sleeps 0.4 s: never more than 2.5 steps/s (a slow, loaded machine gives fewer)
        assert all(0 < s["steps_per_s"] <= 2.5 and s["samples_per_s"] > 0 for s in later[:-1]), later
        assert events(log_dir, r, "end")[-1]["step"] == 6
    p = RunLogs(log_dir).progress()
    assert (p.step, p.total_steps) == (6, None) and p.loss is not None and p.steps_per_s


@pytest.mark.timeout(180)
def test_explicit_report_calls_win_over_the_automatic_count(tmp_path):
    log_dir = _launch(tmp_path, "--steps", "5", "--report", procs=1)
    steps = events(log_dir, 0, "step")
    assert steps and all(s["total_steps"] == 5 for s in steps), steps      # report()'s events only
    assert steps[-1]["step"] == 5 and "steps_per_s" not in steps[-1]


@pytest.mark.timeout(180)
def test_a_segfaulting_rank_is_blamed_with_its_python_stack(tmp_path):
    home = tmp_path / "home"
    env = clean_env(DDP_HPC_HOME=str(home))
    p = subprocess.run([DDP_HPC, "submit", "--backend", "local", "-N", "1", "-G", "2", "--wait", "--log-dir",
                        str(tmp_path / "runs"), str(SCRIPT), "--segv-rank", "1", "--stuck-at", "2"],
                       env=env, capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert p.returncode != 0
    job = json.loads(next((home / "jobs").glob("*.json")).read_text())["id"]
    st = subprocess.run([DDP_HPC, "status", job], env=env, capture_output=True, text=True, timeout=60).stdout
    first = st.split("First failure:", 1)[1]
    assert first.lstrip().startswith("rank 1") and "SIGSEGV" in first.splitlines()[0], st
    assert "Fatal Python error: Segmentation fault" in first and "in crash_in_c" in first, st
    assert "plain_ddp.py" in first


@pytest.mark.timeout(180)
def test_stacks_name_the_rank_outside_the_collective(tmp_path):
    """`status --stacks` on a running job whose rank 1 hangs in its own code: the hang line."""
    home = tmp_path / "home"
    env = clean_env(DDP_HPC_HOME=str(home))
    p = subprocess.run([DDP_HPC, "submit", "--backend", "local", "-N", "1", "-G", "2", "--log-dir",
                        str(tmp_path / "runs"), str(SCRIPT), "--stuck-rank", "1", "--stuck-at", "3"],
                       env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    job = json.loads(next((home / "jobs").glob("*.json")).read_text())["id"]
    log_dir = Path(json.loads(next((home / "jobs").glob("*.json")).read_text())["log_dir"])
    try:
        _wait(lambda: all(events(log_dir, r, "step") for r in range(2)))
        out = ""
        for _ in range(20):   # until both ranks sit where they hang
            out = subprocess.run([DDP_HPC, "status", job, "--stacks"], env=env, capture_output=True,
                                 text=True, timeout=60).stdout
            if "hang:" in out:
                break
        assert "hang: rank 1 in stuck_in_user_code (plain_ddp.py:" in out, out
        assert "rank 0 waits in DDP's all-reduce (backward)" in out, out
    finally:
        subprocess.run([DDP_HPC, "cancel", job], env=env, capture_output=True, timeout=60)


def _wait(cond, timeout: float = 120.0) -> None:
    import time
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.2)


FLIGHT = """
import os, pickle, threading, time
import torch, torch.distributed as dist
import torch._C._distributed_c10d as c10d
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(2)
for _ in range(3):
    dist.all_reduce(t)
prefix = os.environ["TORCH_FR_DUMP_TEMP_FILE"]

def entries():
    return len(pickle.loads(c10d._dump_fr_trace())["entries"])

def dump():   # what PyTorch does on a collective timeout, in its own format and file name
    tmp = os.path.join(os.path.dirname(prefix), f".dump{rank}.tmp")
    with open(tmp, "wb") as f:
        f.write(c10d._dump_fr_trace())
    os.rename(tmp, prefix + str(rank))

def dump_once_entered(before):   # rank 0, as soon as its 4th all_reduce is recorded
    while entries() == before:
        time.sleep(0.05)
    dump()
    os._exit(0)

if rank == 0:        # rank 1 never comes to the 4th all_reduce
    threading.Thread(target=dump_once_entered, args=(entries(),), daemon=True).start()
    dist.all_reduce(t)
else:
    dump()
    while not os.path.exists(prefix + "0"):   # its exit would end rank 0's wait: it stays until rank 0 dumped
        time.sleep(0.05)
    os._exit(0)
"""


@pytest.mark.timeout(120)
def test_a_flight_recorder_dump_names_the_rank_missing_from_the_last_collective(tmp_path):
    from ddp_hpc.exec.instrumented import torch_environ
    from ddp_hpc.judge import flightrec
    from ddp_hpc.judge.consequences import ranks_text
    log_dir = tmp_path / "logs"
    fr = torch_environ(log_dir, 0, 0, gpus=True)     # what exec sets where a GPU is seen
    assert fr["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000" and fr["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert fr["TORCH_FR_DUMP_TEMP_FILE"] == str(log_dir / "flight_recorder_rank")
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in torch_environ(log_dir, 0, 0, gpus=False)
    script = tmp_path / "fr.py"
    script.write_text(FLIGHT)
    env = clean_env(TORCH_FR_BUFFER_SIZE="100", TORCH_FR_DUMP_TEMP_FILE=fr["TORCH_FR_DUMP_TEMP_FILE"])
    p = subprocess.run([DDP_HPC, "launch", "--nodes", "1", "--procs-per-node", "2", "--log-dir", str(log_dir),
                        "--", *EXEC, "--", sys.executable, str(script)], env=env, capture_output=True,
                       text=True, timeout=110)
    assert p.returncode == 0, p.stdout + p.stderr
    dumps = flightrec.dumps(log_dir)
    assert sorted(dumps) == [0, 1]
    assert flightrec.summary(dumps, ranks_text) == [
        "default_pg: rank 0 last entered all_reduce #4 (scheduled); rank 1 last entered all_reduce #3 "
        "(scheduled): rank 1 missing from #4"]
    (log_dir / "flight_recorder_rank1").write_bytes(b"\x80\x04cos\nsystem\n.")   # a pickle that loads a class
    assert flightrec.read_dump(log_dir / "flight_recorder_rank1") is None


def _dump(*frames: tuple[str, int, str]) -> str:
    """A faulthandler-style dump of the main thread (innermost frame first)."""
    lines = ['Current thread 0x00007f0000000001 "MainThread" (most recent call first):']
    return "\n".join(lines + [f'  File "{f}", line {n} in {fn}' for f, n, fn in frames]) + "\n"


def test_the_hang_line_names_the_ranks_outside_a_collective():
    from ddp_hpc.judge.consequences import ranks_text
    from ddp_hpc.judge.stacks import hang_line
    c10d = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
    barrier = _dump((c10d, 4000, "barrier"), ("/venv/lib/python3.11/site-packages/torch/distributed/"
                                              "c10d_logger.py", 83, "wrapper"), ("/w/train.py", 30, "<module>"))
    own = _dump(("/usr/lib/python3.11/time.py", 1, "sleep"), ("/w/train.py", 17, "load_shard"),
                ("/w/train.py", 29, "<module>"))
    assert hang_line({0: barrier, 1: own, 2: barrier, 3: barrier}, ranks_text) == (
        "rank 1 in load_shard (train.py:17); ranks 0,2-3 wait in barrier")
    assert hang_line({0: barrier, 1: barrier}, ranks_text) is None      # every rank waits: no culprit
    assert hang_line({0: own, 1: own}, ranks_text) is None


RECORDED = """
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    raise ValueError("bad batch 42")

main()
"""


@pytest.mark.timeout(120)
def test_the_elastic_error_file_is_the_ranks_error(tmp_path):
    """``@record`` writes TORCHELASTIC_ERROR_FILE (set by exec); the error event is taken from it."""
    p, log_dir = run_exec(tmp_path, RECORDED)
    assert p.returncode == 1
    (err,) = events(log_dir, 0, "error")
    assert (err["exc_type"], err["message"]) == ("ValueError", "bad batch 42"), err
    assert 'raise ValueError("bad batch 42")' in err["traceback"]
    assert json.loads((log_dir / "rank0.error.json").read_text())["message"]["message"].startswith("ValueError")


HELD = """
import sys, time
import torch
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(30):                     # far under a second: the throttle holds the newest back
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
print("stepped", flush=True)
time.sleep(120)                         # as a rank waiting for a peer that failed
"""


def test_a_rank_killed_while_its_newest_step_was_held_back_ends_at_that_step(tmp_path):
    """The throttle writes a step event at most once a second and the held one at exit, which a
    SIGTERM skips: the watchdog writes the held step's number once no step came for a second,
    so the end event says step 30 (it said the step of the last event written, 2)."""
    import signal
    script = tmp_path / "held.py"
    script.write_text(HELD)
    log_dir = tmp_path / "logs"
    p = subprocess.Popen([*EXEC, "--log-dir", str(log_dir), "--", sys.executable, str(script)],
                         env=clean_env(RANK="0", WORLD_SIZE="1"), stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "stepped"
        _wait(lambda: any(e.get("phase") == "step" for e in events(log_dir, 0, "progress")), timeout=60)
        steps = [e["step"] for e in events(log_dir, 0, "step")]
        assert steps and max(steps) < 30, steps            # the newest step was held back
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert [e["step"] for e in events(log_dir, 0, "progress") if e.get("phase") == "step"] == [30]
    (end,) = events(log_dir, 0, "end")
    assert end["status"] == "killed" and end["signal"] == "SIGTERM" and end["step"] == 30, end
