"""`ddp-hpc status JOB --stacks`: why a rank did not answer names only the causes its run logs leave
open (issue 30 item 16: it blamed --no-instrument, which was never passed)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_hpc.judge.nodefiles import rank_events
from ddp_hpc.status.stacks import FROZEN, render_stacks, silence_causes

ROOT = Path(__file__).resolve().parents[1]
T0 = 1_800_000_000.0


def ev(rank, t, event, **kw):
    return {"time": T0 + t, "event": event, "rank": rank, "job_id": "9", "restart": 0, "host": "n1", **kw}


def start(rank, launcher, **kw):
    return ev(rank, 0, "start", world_size=6, num_nodes=1, local_rank=rank, pid=100 + rank, total_steps=None,
              epochs=None, launcher=launcher, device=None, **kw)


def write(d: Path, rank: int, events: list[dict], out: str | None = None) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / f"rank{rank}.events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    if out is not None:
        (d / f"rank{rank}.out").write_text(out)


def test_each_silent_rank_gets_only_the_causes_its_logs_leave_open(tmp_path):
    python = ["python", "train.py"]
    write(tmp_path, 0, [start(0, "slurm"), ev(0, 5, "step", step=1)])              # the training core, stepping
    write(tmp_path, 1, [start(1, "slurm")])                                       # ... before its loop
    write(tmp_path, 2, [start(2, "exec/slurm", command=python, instrumented=True)])
    write(tmp_path, 3, [start(3, "exec/slurm", command=python, instrumented=False)])
    write(tmp_path, 4, [start(4, "exec/slurm", command=python)],                    # an older wrapper: no key
          out="ddp_hpc: no instrumentation in /usr/bin/python3: No module named 'ddp_hpc'\nhello\n")
    write(tmp_path, 5, [start(5, "exec/slurm", command=python, instrumented=True),
                        ev(5, 9, "end", status="completed", step=3)])
    write(tmp_path, 6, [start(6, "function/local")])                                # ddp_hpc.submit(fn)
    why = silence_causes(str(tmp_path), list(range(7)))
    assert why[6] == (f"{FROZEN}, or its function has not called ddp_hpc.report nor ddp_hpc.fit yet (the "
                      "watchdog starts then)")
    assert why[0] == FROZEN
    assert why[1] == f"{FROZEN}, or its training loop has not started (its watchdog starts with the loop)"
    assert why[2] == (f"{FROZEN}, or its script has not imported torch nor taken a step yet (the watchdog of "
                      "ddp_hpc's instrumentation starts then)")
    assert "DDP_HPC_INSTRUMENT=0 / submit --no-instrument" in why[3]
    assert why[4] == (f"{FROZEN}, or no watchdog: rank4.out says \"ddp_hpc: no instrumentation in "
                      "/usr/bin/python3: No module named 'ddp_hpc'\"")
    assert why[5] == "ended"
    assert [r for r, w in why.items() if "no-instrument" in w] == [3]   # only where the logs say so
    text = render_stacks("9", "scancel --signal=URG 9", {}, [0, 1, 2, 3, 4, 5], why)
    assert f"no answer from rank 0: {FROZEN}\n" in text and "no answer from rank 5: ended\n" in text


def test_the_exec_wrapper_says_in_its_start_event_whether_it_instrumented_the_script(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDP_HPC_", "RANK", "WORLD_SIZE"))}
    for flag, (value, want) in {"on": ("1", True), "off": ("0", False)}.items():
        d = tmp_path / flag
        p = subprocess.run([sys.executable, "-m", "ddp_hpc.exec", "--log-dir", str(d), "--", sys.executable,
                            "-c", "pass"], env={**env, "DDP_HPC_INSTRUMENT": value}, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        first = rank_events(d, 0).events[0]
        assert first["event"] == "start" and first["instrumented"] is want, first
    p = subprocess.run([sys.executable, "-m", "ddp_hpc.exec", "--log-dir", str(tmp_path / "sh"), "--", "true"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert rank_events(tmp_path / "sh", 0).events[0]["instrumented"] is False


@pytest.mark.timeout(180)
def test_stacks_of_a_script_that_has_not_imported_torch_do_not_blame_the_flag(tmp_path):
    """A real local script job, instrumented, that sleeps before importing torch: its rank cannot
    answer, and the reason given is the true one, not --no-instrument (never passed)."""
    script = tmp_path / "late.py"
    script.write_text("import time\ntime.sleep(120)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDP_HPC_"))}
    env.update(DDP_HPC_HOME=str(tmp_path / "home"))
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not (Path(p) / "sbatch").exists())
    p = subprocess.run([sys.executable, "-m", "ddp_hpc.submit", "--backend", "local", "-N", "1", "-G", "1",
                        "--log-dir", str(tmp_path / "runs"), str(script)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rec = json.loads(next((tmp_path / "home" / "jobs").glob("*.json")).read_text())
    try:
        deadline = time.monotonic() + 90
        while not rank_events(rec["log_dir"], 0).events and time.monotonic() < deadline:
            time.sleep(0.3)
        s = subprocess.run([sys.executable, "-m", "ddp_hpc.status", rec["id"], "--stacks", "--json"],
                           cwd="/", env=env, capture_output=True, text=True, timeout=60)
        assert s.returncode == 0, s.stderr
        got = json.loads(s.stdout)
        assert got["silent_ranks"] == [0], got
        assert "has not imported torch" in got["silent_causes"]["0"]
        assert "no-instrument" not in got["silent_causes"]["0"]
        text = subprocess.run([sys.executable, "-m", "ddp_hpc.status", rec["id"], "--stacks"], cwd="/", env=env,
                              capture_output=True, text=True, timeout=60).stdout
        assert "no answer from rank 0: " in text and "no-instrument" not in text, text
    finally:
        subprocess.run([sys.executable, "-m", "ddp_hpc", "cancel", rec["id"]], env=env, capture_output=True, timeout=60)
