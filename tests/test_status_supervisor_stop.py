"""A step the supervisor stopped (ddp_hpc.supervise): ``ddp-hpc status`` says so and why, in a
line, and blames no rank for the ranks the stop killed (issue: a drain ended a job and status
blamed "rank 2 on n2 (from events stopped first)")."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from ddp_hpc import records
from ddp_hpc.judge.restarts import restart_lines
from ddp_hpc.runlogs.restarts import append_stop


def _status(home: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "COLUMNS"}
    env.update(DDP_HPC_HOME=str(home / "home"), PATH=str(Path(sys.executable).parent))
    p = subprocess.run([sys.executable, "-m", "ddp_hpc.status", *args], cwd=home, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


def _job(home: Path, job_id: str = "902") -> Path:
    """A 2x2 config job that FAILED after the supervisor stopped its step: every rank stepped, rank
    2's events end first (the stop killed it a moment before the others), no rank wrote an error."""
    d = home / "logs" / job_id
    d.mkdir(parents=True)
    t0 = time.time() - 100
    for rank in range(4):
        host = "n1" if rank < 2 else "n2"
        evs = [{"time": t0, "event": "start", "rank": rank, "job_id": job_id, "restart": 0, "host": host,
                "world_size": 4, "num_nodes": 2, "local_rank": rank % 2, "pid": 100 + rank}]
        last = 20 if rank == 2 else 21
        evs += [{"time": t0 + s, "event": "step", "rank": rank, "job_id": job_id, "restart": 0, "host": host,
                 "epoch": 0, "step": s, "total_steps": 100, "loss": 1.0} for s in range(1, last + 1)]
        (d / f"rank{rank}.events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))
    records.write_record(dict(id=job_id, cluster=socket.gethostname(), name="demo", backend="sbatch", nodes=2,
                              gpus_per_node=2, time_limit="00:10:00", log_dir=str(d), config=None, overrides=[],
                              cwd=str(home), submitted_at=t0 - 5,
                              final={"state": "FAILED", "state_name": "FAILED", "source": "sacct",
                                     "seen_at": time.time(), "exit_code": "137:0"}),
                         {"DDP_HPC_HOME": str(home / "home")})
    return d


def test_a_job_the_supervisor_stopped_blames_no_rank_and_says_why(tmp_path):
    d = _job(tmp_path)
    before = _status(tmp_path, "902")
    assert "First failure: rank 2 on n2" in before, before      # no stop line: the stop looks like a crash
    append_stop(d, {"stopped_run": 0, "job_id": "902", "detected_at": time.time() - 70, "trigger": "stalled",
                    "stop": "no rank showed a sign of life (a step, an eval, a checkpoint) for 35 s",
                    "why": "no training step for 35 s", "basis": "stalled",
                    "not_restarted": "no restart left (--max-restarts 0)"})
    text = _status(tmp_path, "902")
    assert "First failure: rank" not in text, text
    assert ("Supervisor: stopped the step of restart 0 at " in text and "because no rank showed a sign of "
            "life (a step, an eval, a checkpoint) for 35 s; not restarted: no restart left (--max-restarts 0)"
            in text), text


def test_a_restart_line_says_why_the_supervisor_stopped_the_step():
    row = {"restart": 1, "detected_at": time.time(), "trigger": "node down", "rank": None, "node": "n2",
           "why": "node(s) n2 down", "basis": "node down", "world_before": 4, "world_after": 4,
           "nodes_after": ["n1", "n3"], "stop": "node(s) n2 stopped answering (sinfo: down or not responding)"}
    lines = restart_lines([row])
    assert lines[0] == "Restarts inside the allocation: 1"
    assert lines[-1] == ("    the supervisor stopped the step because node(s) n2 stopped answering (sinfo: down "
                         "or not responding)")
    assert restart_lines([dict(row, stop=None)])[-1].startswith("    how we know: ")   # srun ended it itself
