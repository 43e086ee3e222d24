"""How status says things: no Python ``None`` in its lines, a script's exit status said once,
a table that fits the terminal or 100 columns (the log directory gives way first), and ``--logs`` of a script
job showing the script's own output. Real processes, real records and run logs on disk."""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_hpc import records
from ddp_hpc.text import cut_middle


@pytest.fixture
def home(tmp_path):
    return tmp_path


def status(home, *args, columns=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "COLUMNS"}
    env.update(DDP_HPC_HOME=str(home / "home"), PATH=str(Path(sys.executable).parent))
    if columns is not None:
        env["COLUMNS"] = str(columns)
    p = subprocess.run([sys.executable, "-m", "ddp_hpc.status", *args], cwd=home, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p


def ev(rank, t, event, **kw):
    return {"time": time.time() - 100 + t, "event": event, "rank": rank, "job_id": "x", "restart": 0,
            "host": "h", **kw}


def script_job(home, job_id="901", log_dir=None):
    """A script job (ddp-hpc submit ... train.py) whose rank 0 exited with status 3 and no traceback,
    as the exec wrapper writes it: rank0.log has its two lines, rank0.out the script's output."""
    d = Path(log_dir or home / "logs" / job_id)
    d.mkdir(parents=True, exist_ok=True)
    evs = [ev(0, 0, "start", world_size=1, num_nodes=1, local_rank=0, pid=1, launcher="exec/local",
              command=["python", "train.py"]),
           ev(0, 5, "error", exc_type="Exited", message="exited with status 3", traceback=None, exit_code=3,
              signal=None),
           ev(0, 5.1, "end", status="failed", step=None, exit_code=3, signal=None, duration_s=5.1)]
    (d / "rank0.events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))
    (d / "rank0.log").write_text("exec: started python train.py\nexec: exited with status 3\n")
    (d / "rank0.out").write_text("loading data\nepoch 1 loss 0.5\nbad config, giving up\n")
    records.write_record(dict(id=job_id, cluster=socket.gethostname(), name="train", backend="sbatch", nodes=1,
                              gpus_per_node=1, time_limit="00:10:00", log_dir=str(d), config=None, overrides=[],
                              cwd=str(home), submitted_at=time.time() - 100, command=["python", "train.py"]),
                         {"DDP_HPC_HOME": str(home / "home")})
    return d


def test_no_none_and_the_exit_status_said_once(home):
    script_job(home)
    text = status(home, "901").stdout
    assert "None" not in text, text
    assert "Exited: " not in text and "exited with status 3" in text, text
    assert "First failure: rank 0 on h (restart 0, from error event): exited with status 3" in text, text
    # the end event's unknown step is left out; what it knows stays
    assert "end status=failed exit_code=3 duration_s=5.1" in text, text
    js = json.loads(status(home, "901", "--json").stdout)
    assert js["failure"]["exc_type"] == "Exited"    # the JSON keeps the raw fields


def test_the_table_fits_columns_cutting_the_log_dir_first(home):
    deep = home / ("very-long-directory-name-" * 6) / "train-20260101-120000-abcdef"
    script_job(home, "902", log_dir=deep)
    wide = status(home, "--wide").stdout.splitlines()
    assert max(map(len, wide)) > 150 and str(deep) in wide[1]    # --wide: no limit
    piped = status(home).stdout.splitlines()    # into a pipe: 100 columns, the log dir left out and said so
    assert max(map(len, piped)) <= 100 and piped[1].split()[:2] == ["902", "train"], piped
    assert piped[-1] == "more with --wide: LOG DIR", piped
    narrow = status(home, columns=120).stdout.splitlines()
    assert max(map(len, narrow)) <= 120, narrow
    cell = narrow[1].split()[-1]
    assert "..." in cell and cell.endswith("abcdef") and cell.startswith(str(home)[:5]), cell
    assert narrow[1].split()[:2] == ["902", "train"]    # the other columns whole


def test_cut_middle_keeps_both_ends_of_a_path():
    assert cut_middle("/scratch/user/runs/job-1", 12) == "/sc.../job-1"


def test_logs_of_a_script_job_show_its_own_output(home):
    script_job(home)
    p = status(home, "901", "--logs")
    assert p.stdout.splitlines() == ["[rank 0 out] loading data", "[rank 0 out] epoch 1 loss 0.5",
                                     "[rank 0 out] bad config, giving up"]
    assert "--all-files" in p.stderr
    # the guide names the script's own output first, and the log for what it is
    assert p.stderr.startswith("rank{R}.out = your script's output: prints and tracebacks, read it first; "
                               "rank{R}.log = ddp_hpc's notes (exec: lines)"), p.stderr
    both = status(home, "901", "--logs", "--all-files").stdout
    assert "[rank 0] exec: started python train.py" in both and "[rank 0 out] bad config" in both


def test_a_restart_line_names_the_rank_once():
    from ddp_hpc.judge.restarts import restart_lines
    row = {"restart": 1, "detected_at": time.time(), "trigger": "exited", "rank": 3, "node": "n2",
           "why": "rank 3 on n2 killed by signal 9 (SIGKILL)", "basis": "error event", "world_before": 4,
           "world_after": 4, "nodes_after": ["n1", "n2"]}
    line = restart_lines([row])[1]
    assert line.endswith("(exited): rank 3 on n2 killed by signal 9 (SIGKILL)"), line
    other = restart_lines([dict(row, why="stalled past the collective timeout")])[1]
    assert other.endswith("(exited): rank 3 on n2: stalled past the collective timeout"), other
