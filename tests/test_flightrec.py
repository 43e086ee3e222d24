"""Flight recorder dumps that are cut short or crafted (ddp_hpc.judge.flightrec): reported as
unreadable, and `ddp-hpc status JOB` goes on (a real status process over real files)."""
import json
import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_hpc import records
from ddp_hpc.judge import flightrec
from ddp_hpc.judge.consequences import ranks_text

GOOD = {"version": "2.4", "pg_config": {}, "entries": [
    {"process_group": ["0", "default_pg"], "collective_seq_id": 3, "profiling_name": "nccl:all_reduce",
     "state": "completed", "is_p2p": False, "frames": []}]}
GOOD_PICKLE = pickle.dumps(GOOD, protocol=4)

#: each a file a status user may find in a run directory; none is a readable dump
BAD = {
    "truncated pickle": GOOD_PICKLE[: len(GOOD_PICKLE) // 2],
    "truncated JSON": json.dumps(GOOD).encode()[:40],
    "empty file": b"",
    "APPEND onto an int (AttributeError)": b"\x80\x04K\x01K\x02a.",
    "ADDITEMS onto an int (AttributeError)": b"\x80\x04K\x01(K\x02\x90.",
    "BUILD onto an int (AttributeError)": b"\x80\x04K\x01}b.",
    "SETITEM with a list key (TypeError)": b"\x80\x04}]K\x01s.",
    "JSON nested past the recursion limit (RecursionError)": b'{"entries":' + b"[" * 100000 + b"]" * 100000 + b"}",
    "a pickle that loads a class": b"\x80\x04cos\nsystem\n.",
    "no entries list": pickle.dumps({"entries": 5}),
    "not a dict": pickle.dumps([1, 2, 3]),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_dump_reads_as_unreadable(tmp_path, name):
    path = tmp_path / "flight_recorder_rank0"
    path.write_bytes(BAD[name])
    assert flightrec.read_dump(path) is None


def test_unreadable_dumps_are_named_beside_the_readable_ones(tmp_path):
    (tmp_path / "flight_recorder_rank0").write_bytes(GOOD_PICKLE)
    (tmp_path / "flight_recorder_rank1").write_bytes(BAD["APPEND onto an int (AttributeError)"])
    (tmp_path / "flight_recorder_rank2").write_bytes(BAD["truncated pickle"])
    per_rank = flightrec.dumps(tmp_path)
    assert sorted(per_rank) == [0, 1, 2] and per_rank[1] is None and per_rank[2] is None
    assert flightrec.summary(per_rank, ranks_text) == [
        "default_pg: rank 0 last entered all_reduce #3 (completed)",
        "unreadable: flight_recorder_rank1, flight_recorder_rank2 (cut short, or not PyTorch's dump format)"]


def test_status_of_a_job_with_a_crafted_dump_goes_on(tmp_path):
    home, d = tmp_path / "home", tmp_path / "logs" / "303"
    d.mkdir(parents=True)
    now = time.time()
    for r in range(2):
        base = {"rank": r, "job_id": "303", "restart": 0, "host": "h"}
        evs = [{**base, "time": now - 60, "event": "start", "world_size": 2, "num_nodes": 1, "local_rank": r,
                "pid": 1, "total_steps": 100, "epochs": 1, "launcher": "slurm"},
               {**base, "time": now - 50, "event": "step", "epoch": 0, "step": 10, "total_steps": 100},
               {**base, "time": now - 40, "event": "end", "status": "completed", "step": 100}]
        (d / f"rank{r}.events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))
    (d / "flight_recorder_rank0").write_bytes(GOOD_PICKLE)
    (d / "flight_recorder_rank1").write_bytes(BAD["SETITEM with a list key (TypeError)"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "COLUMNS"}
    env.update(DDP_HPC_HOME=str(home), PATH=str(Path(sys.executable).parent))   # no Slurm on PATH
    records.write_record(dict(id="303", cluster=socket.gethostname(), name="demo", backend="sbatch", nodes=1,
                              gpus_per_node=2, time_limit="00:10:00", log_dir=str(d), config=None, overrides=[],
                              cwd=str(tmp_path), submitted_at=now - 100), environ=env)
    p = subprocess.run([sys.executable, "-m", "ddp_hpc.status", "303"], env=env, capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "Flight rec: default_pg: rank 0 last entered all_reduce #3 (completed)" in p.stdout
    assert "unreadable: flight_recorder_rank1 (cut short, or not PyTorch's dump format)" in p.stdout
