"""Where a restarted run's state came from, as ``ddp-hpc status`` shows it: rank 0's ``restored``
event (train/restore.py) in the restart's lines and in the detail view's ``Restored:`` line."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from ddp_hpc import records
from ddp_hpc.judge.restarts import restored_text
from ddp_hpc.runlogs.restarts import append_restart


def _status(home: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "COLUMNS"}
    env.update(DDP_HPC_HOME=str(home / "home"), PATH=str(Path(sys.executable).parent))
    p = subprocess.run([sys.executable, "-m", "ddp_hpc.status", *args], cwd=home, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


def _events(job_id: str, rank: int, restart: int, host: str, t0: float, steps: range, restored=None) -> list[dict]:
    head = {"rank": rank, "job_id": job_id, "restart": restart, "host": host}
    evs = []
    if restored is not None:
        evs.append({**head, "time": t0, "event": "restored", **restored})
    evs.append({**head, "time": t0, "event": "start", "world_size": 4, "num_nodes": 2, "local_rank": rank % 2,
                "pid": 100 + rank})
    evs += [{**head, "time": t0 + s / 10, "event": "step", "epoch": 0, "step": s, "total_steps": 100, "loss": 1.0}
            for s in steps]
    return evs


def test_status_names_the_node_whose_memory_the_restart_restored(tmp_path):
    job, d = "903", tmp_path / "logs" / "903"
    d.mkdir(parents=True)
    t0 = time.time() - 100
    mem = {"step": 21, "source": "memory", "node": "n1", "seconds": 0.42, "path": "/dev/shm/x/n1/ckpt-000000021.pt",
           "lost": ["n2"]}
    for rank in range(4):
        first = _events(job, rank, 0, "n1" if rank < 2 else "n2", t0, range(1, 22))
        again = _events(job, rank, 1, "n1" if rank < 2 else "n3", t0 + 30, range(22, 40),
                        dict(mem, source="memory" if rank < 2 else "peer"))
        (d / f"rank{rank}.events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in first + again))
    append_restart(d, {"restart": 1, "job_id": job, "fault_at": t0 + 3, "detected_at": t0 + 4, "trigger": "node down",
                       "why": "node(s) n2 down", "kind": "lost", "rank": 2, "node": "n2", "basis": "node down",
                       "excluded": ["n2"], "nodes_before": ["n1", "n2"], "nodes_after": ["n1", "n3"],
                       "world_before": 4, "world_after": 4})
    records.write_record(dict(id=job, cluster=socket.gethostname(), name="demo", backend="sbatch", nodes=2,
                              gpus_per_node=2, time_limit="00:10:00", log_dir=str(d), config=None, overrides=[],
                              cwd=str(tmp_path), submitted_at=t0 - 5,
                              final={"state": "COMPLETED", "state_name": "COMPLETED", "source": "sacct",
                                     "seen_at": time.time(), "exit_code": "0:0"}),
                         {"DDP_HPC_HOME": str(tmp_path / "home")})
    text = _status(tmp_path, job)
    assert "    state: restored step 21 from n1's memory (n2 was lost), 0.4 s" in text, text
    assert "Restored:   step 21 from n1's memory (n2 was lost), 0.4 s" in text, text


def test_the_restored_words_for_each_source():
    assert restored_text({"step": 5, "source": "file", "path": "/c/ckpt-000000005.pt", "seconds": 2.0}) == \
        "restored step 5 from /c/ckpt-000000005.pt, 2.0 s"
    assert restored_text({"step": 7, "source": "peer", "node": "n1", "seconds": 0.25, "lost": ["n2", "n3"]}) == \
        "restored step 7 from n1's memory (n2, n3 were lost), 0.2 s"
    assert restored_text({"step": 0, "source": "none"}) is None
