"""Issue 30 item 4 on real run logs: a real local run (gloo, 2 pretend nodes x 2 ranks, each rank
under ``ddp_hpc.exec``'s instrumentation) whose rank 3 is frozen with SIGSTOP, with a short
collective timeout. The others' watchdogs write their stacks while they wait, then their
collectives time out. The frozen rank is the one to blame, the waiting ranks are its victims,
whatever words gloo's timeout chose for them."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_hpc.judge.nodefiles import rank_events
from ddp_hpc.judge.reader import RunLogs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "frozen_rank.py"
DDP_HPC = str(Path(sys.executable).with_name("ddp-hpc"))
#: rank and job variables of an enclosing launcher that must not leak into the run
DROP = re.compile(r"^(SLURM_\w+|SUBMITIT_\w+|TORCHELASTIC_\w+|TORCH_NCCL_\w+|TORCH_FR_\w+|RANK|LOCAL_RANK|WORLD_SIZE"
                  r"|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_\w+|MASTER_ADDR|MASTER_PORT|DDP_HPC_\w+)$")


@pytest.fixture(scope="module")
def frozen_run(tmp_path_factory) -> Path:
    log_dir = tmp_path_factory.mktemp("frozen") / "logs"
    env = {k: v for k, v in os.environ.items() if not DROP.match(k)}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    p = subprocess.run([DDP_HPC, "launch", "--nodes", "2", "--procs-per-node", "2", "--log-dir", str(log_dir),
                        "--", sys.executable, "-m", "ddp_hpc.exec", "--", sys.executable, str(SCRIPT), "12"],
                       env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode != 0, p.stdout + p.stderr      # the others' collectives timed out
    return log_dir


@pytest.mark.timeout(300)
def test_the_frozen_rank_is_blamed_and_the_waiting_ranks_are_its_victims(frozen_run):
    """Pays for the module's one real run (2 x 2: three victims, whose timeouts race): a SIGSTOPped
    rank, which writes nothing, is blamed from the others' real gloo timeouts and stacks."""
    stacks = {r: [e for e in rank_events(frozen_run, r).events if e["event"] == "stack"]
              for r in range(4)}
    # the stall, as it was written: the waiting ranks' stacks. (Rank 3 may have written one too,
    # before it froze: on a loaded machine its own wait for the previous step's all-reduce, right
    # before the SIGSTOP, can outlast the watchdog's 7 s; twice in CI. The blame must hold anyway.)
    assert all(stacks[r] for r in range(3)), stacks
    failure = RunLogs(frozen_run).first_failure(assume_failed=True)
    assert failure.rank == 3 and failure.kind == "stuck", failure.summary
    assert failure.summary.startswith("rank 3 on ") and " stuck" in failure.summary
    # each other rank timed out waiting for rank 3, or the launcher stopped it once one had failed
    said = {r: c["text"] for c in failure.consequences for r in c["ranks"]}
    assert sorted(said) == [0, 1, 2], said
    # (which victim's collective fails first, and with which words, is a race that load decides:
    # every one of them is a consequence of rank 3, none is blamed for an error of its own)
    victim = ("timed out waiting for rank 3 (", "lost its peer rank 3", "lost a peer too",
              "stopped after rank 3 failed")
    assert all(t.startswith(victim) for t in said.values()), said
    assert any(t.startswith(victim[:2]) for t in said.values()), said


@pytest.mark.timeout(300)
def test_a_stack_the_frozen_rank_writes_on_waking_at_the_teardown_does_not_clear_it(frozen_run, tmp_path):
    """What a loaded machine showed: the launcher's teardown woke rank 3, whose watchdog wrote a
    stack after the others had timed out. The blame stays with rank 3."""
    logs = tmp_path / "logs"
    shutil.copytree(frozen_run, logs)
    rank0 = rank_events(logs, 0).events
    last = max(e["time"] for r in range(3) for e in rank_events(logs, r).events)
    late = dict(next(e for e in rank0 if e["event"] == "stack"), rank=3, time=last + 0.01,
                reason="stopped (SIGTERM)")
    with open(logs / "node1.events.jsonl", "a") as f:     # rank 3 ran on the second node
        f.write(json.dumps(late) + "\n")
    failure = RunLogs(logs).first_failure(assume_failed=True)
    assert failure.rank == 3 and failure.kind == "stuck", failure.summary


@pytest.mark.timeout(300)
def test_status_names_the_frozen_rank(frozen_run):
    env = {k: v for k, v in os.environ.items() if not DROP.match(k) and k != "COLUMNS"}
    env["DDP_HPC_HOME"] = str(frozen_run.parent / "home")
    job = rank_events(frozen_run, 0).events[0]["job_id"]
    p = subprocess.run([sys.executable, "-m", "ddp_hpc.status", job, "--log-dir", str(frozen_run)], env=env,
                       capture_output=True, text=True, timeout=60)
    print(p.stdout)
    first = next((ln for ln in p.stdout.splitlines() if ln.startswith("First failure:")), p.stdout + p.stderr)
    assert first.startswith("First failure: rank 3 on ") and " stuck" in first, first
    assert "timed out waiting for rank 3" in p.stdout
