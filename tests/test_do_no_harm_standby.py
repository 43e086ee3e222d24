"""The warm standby trusts only its own supervisor (issue 38, bug 9): a real standby process
(``python -m ddp_hpc.supervise.standby``) that reaches something else on its port (another local
user can bind it once the supervisor closed it: the standby retries for a minute) runs nothing,
opens nothing, does not give the job's token away and says so in one line; the supervisor side
(`Warm`) takes no standby that cannot prove it knows the token, and sends no go the standby would
refuse. A standby takes no memory the job has not got room for (`supervise.standroom`). The whole
hand-over with real standby ranks: tests/test_supervise_warm.py."""

import json
import os
import socket
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ddp_hpc.env import memory
from ddp_hpc.supervise import standroom
from ddp_hpc.supervise.standby import IMPORTS_VAR, LOGS_VAR, TOKEN_VAR, proof
from ddp_hpc.supervise.warm import Warm

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "5ec2e7" * 5

#: the user's script: leaves a mark when it runs
TRAIN = textwrap.dedent("""
    import os, sys
    open(os.path.join(os.path.dirname(sys.argv[0]), "ran"), "w").write(os.environ.get("LD_PRELOAD", ""))
""")


def _line(obj) -> bytes:
    return (json.dumps(obj) + "\n").encode()


@pytest.fixture
def start_standby(tmp_path):
    """Start a real standby rank (task 0 of a 1-task step on n1) that connects to ``port``."""
    (tmp_path / "train.py").write_text(TRAIN)
    logs = tmp_path / "logs"
    logs.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), TOKEN_VAR: TOKEN, LOGS_VAR: str(logs), IMPORTS_VAR: "json",
           "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "5", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
           "SLURM_NODEID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_NODELIST": "n1", "SLURM_JOB_NODELIST": "n1",
           "SLURM_STEP_TASKS_PER_NODE": "1", "SLURMD_NODENAME": "n1"}

    def start(port: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "ddp_hpc.supervise.standby", "--go", f"127.0.0.1:{port}",
                                 "--", sys.executable, str(tmp_path / "train.py")],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return start, tmp_path, logs


def _listen():
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(60)
    return server, server.getsockname()[1]


def _accept(server, proc):
    """The connection of ``proc`` and its hello line. Another test's standby may reach this port
    too: a standby retries its supervisor's port for a minute, and the system may give that port
    to this test once the supervisor closed it (the very case the hand-shake guards against). Such
    a stranger's connection is closed, and the test waits for its own standby's."""
    while True:
        conn, _ = server.accept()
        conn.settimeout(60)
        f = conn.makefile("rb")
        hello = f.readline()
        try:
            pid = json.loads(hello).get("pid")
        except ValueError:
            pid = None
        if pid == proc.pid:
            return conn, f, hello
        f.close()
        conn.close()


def test_a_supervisor_that_goes_away_mid_hand_shake_leaves_one_line_and_no_traceback(start_standby):
    """At a job's end the supervisor's process ends with its standby connections open: the kernel
    resets them (RST), and each standby rank read "Connection reset by peer" in the middle of its
    hand-shake and printed a traceback into standby.out. It is the supervisor going away: one line,
    exit 0, nothing run."""
    start, tmp_path, logs = start_standby
    server, port = _listen()
    proc = start(port)
    conn, f, _ = _accept(server, proc)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))   # close = RST
    f.close()
    conn.close()
    server.close()
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    assert "went away (Connection reset by peer); ran nothing" in out and "Traceback" not in out, out
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("answer", ["go", "forged challenge"])
def test_a_standby_that_reached_an_impostor_runs_nothing_and_opens_nothing(start_standby, answer):
    """Whoever holds the port sends an env with LD_PRELOAD and PYTHONPATH and an output file
    outside the log directory, with or without a made-up proof first: the standby refuses it in
    one line, exits 0, and its hello did not carry the token."""
    start, tmp_path, logs = start_standby
    server, port = _listen()
    outside = tmp_path / "elsewhere" / "pwned.out"
    outside.parent.mkdir()
    proc = start(port)
    try:
        conn, _, hello = _accept(server, proc)
        if answer == "forged challenge":
            conn.sendall(_line({"nonce": "00" * 16, "proof": "ab" * 32}))
        conn.sendall(_line({"rank": 0, "env": {"LD_PRELOAD": "/nonexistent/evil.so", "PYTHONPATH": str(tmp_path)},
                            "out": str(outside)}))
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        server.close()
    assert not (tmp_path / "ran").exists(), out                # the command did not run
    assert not outside.exists()                                # the file was not opened
    assert TOKEN not in hello.decode(), hello                  # the secret is never sent
    refused = [ln for ln in out.splitlines() if "refused" in ln]
    assert len(refused) == 1 and f"127.0.0.1:{port}" in refused[0], out
    assert "Traceback" not in out and proc.returncode == 0, out


def _authenticated(conn, f, hello) -> tuple[str, str]:
    """The supervisor's side of the hand-shake after the standby's ``hello``, as a test's
    stand-in: (their nonce, ours)."""
    theirs = json.loads(hello)["nonce"]
    ours = "12" * 16
    conn.sendall(_line({"nonce": ours, "proof": proof(TOKEN, "supervisor", theirs, ours)}))
    answer = json.loads(f.readline())
    assert answer["proof"] == proof(TOKEN, "standby", theirs, ours)      # the standby proved itself
    return theirs, ours


@pytest.mark.parametrize("go", [
    {"rank": 0, "env": {"LD_PRELOAD": "/nonexistent/evil.so"}, "out": "LOGS/rank0.out"},
    {"rank": 0, "env": {"SLURM_PROCID": "0"}, "out": "ELSEWHERE/rank0.out"},
    {"rank": 0, "env": {}, "out": "LOGS/../rank0.out"},
    {"rank": 0, "env": {}, "out": "LOGS/rank1.out"},
])
def test_even_the_supervisors_go_carries_only_the_steps_variables_and_an_output_in_the_log_dir(start_standby, go):
    start, tmp_path, logs = start_standby
    (tmp_path / "elsewhere").mkdir()
    go = json.loads(json.dumps(go).replace("LOGS", str(logs)).replace("ELSEWHERE", str(tmp_path / "elsewhere")))
    server, port = _listen()
    proc = start(port)
    try:
        conn, f, hello = _accept(server, proc)
        theirs, ours = _authenticated(conn, f, hello)
        text = json.dumps(go)
        conn.sendall(_line({"go": text, "mac": proof(TOKEN, "go", theirs, ours, text)}))
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        server.close()
    assert not (tmp_path / "ran").exists(), out
    assert not list((tmp_path / "elsewhere").iterdir()) and not (tmp_path / "rank0.out").exists()
    assert not list(logs.iterdir())
    refused = [ln for ln in out.splitlines() if "refused" in ln]
    assert len(refused) == 1 and proc.returncode == 2, out


def test_the_authenticated_go_runs_the_command(start_standby):
    """The same stand-in supervisor, with a go it may send: the command runs, its output in the
    log directory's rank file."""
    start, tmp_path, logs = start_standby
    server, port = _listen()
    proc = start(port)
    try:
        conn, f, hello = _accept(server, proc)
        theirs, ours = _authenticated(conn, f, hello)
        text = json.dumps({"rank": 0, "env": {"SLURM_PROCID": "0", "DDP_HPC_ALLOC_RESTARTS": "1"},
                           "out": str(logs / "rank0.out")})
        conn.sendall(_line({"go": text, "mac": proof(TOKEN, "go", theirs, ours, text)}))
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        server.close()
    assert proc.returncode == 0 and (tmp_path / "ran").read_text() == "", out
    assert (logs / "rank0.out").exists()


class _NoSrun:
    def start_step(self, args, env, stderr=None):
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stderr=stderr,
                                text=True if stderr is not None else None)


def test_the_supervisor_takes_no_standby_that_cannot_prove_it_knows_the_token(tmp_path):
    """A peer that says hello on the supervisor's port gets a challenge (and the supervisor's own
    proof), but no place among the standby ranks without the standby's proof."""
    warm = Warm(_NoSrun(), [sys.executable, "train.py"], str(tmp_path), 1, say=lambda _: None)
    warm.start(["n1"], {})
    try:
        port = warm.server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            c.sendall(_line({"token": "guess", "node": "n1", "local": 0, "task": 0, "nonce": "ab" * 16})
                      + _line({"proof": "00" * 32}))
            warm._accept()
            challenge = json.loads(c.makefile("rb").readline())
        assert challenge["proof"] == proof(warm.token, "supervisor", "ab" * 16, challenge["nonce"])
        assert warm.ranks == {}
    finally:
        warm.drop()


def test_the_supervisor_sends_no_variable_a_standby_would_refuse(tmp_path):
    said = []
    warm = Warm(_NoSrun(), [sys.executable, "train.py"], str(tmp_path), 1, say=said.append)
    warm.start(["n1"], {})
    assert warm.take(["n1"], {"LD_PRELOAD": "/x.so"}) is None
    assert said == ["warm standby not used: it cannot carry LD_PRELOAD (a standby takes only the step's "
                    "Slurm variables and DDP_HPC_ALLOC_RESTARTS); starting the ranks cold"]


GB = 1 << 30


def _job_cgroup(tmp_path, monkeypatch, limit: int, current: int, stat: str = "") -> None:
    """This process in a cgroup v2 job cgroup of ``limit`` bytes that holds ``current``."""
    proc = tmp_path / "proc-cgroup"
    proc.write_text("0::/job_7/step_0\n")
    for where, lim in (("job_7", str(limit)), ("job_7/step_0", "max")):
        d = tmp_path / "fs" / where
        d.mkdir(parents=True)
        (d / "memory.max").write_text(lim + "\n")
        (d / "memory.current").write_text(f"{current}\n")
        (d / "memory.stat").write_text(stat)
    monkeypatch.setattr(memory, "PROC_CGROUP", proc)
    monkeypatch.setattr(memory, "CGROUP_FS", tmp_path / "fs")


def test_a_standby_steps_back_where_the_jobs_cgroup_has_no_room_for_it_and_its_margin(tmp_path, monkeypatch):
    # 16 GB job, 13.5 GB held: 4 standby ranks (1.6 GB) and the margin (a tenth: 1.6 GB) do not fit
    _job_cgroup(tmp_path, monkeypatch, 16 * GB, 14 * GB, stat=f"file {GB // 2}\nshmem 0\n")
    why = standroom.refusal(4, {}, available=64 * GB, total=128 * GB)
    assert why == ("the job's memory has 2.7 GB of 17.2 GB free (cgroup memory.max); 4 standby ranks need "
                   "about 1.7 GB and 1.7 GB stay free"), why
    # the page cache is the kernel's to free: with 8 GB of it the same ranks fit
    monkeypatch.undo()
    (tmp_path / "b").mkdir()
    _job_cgroup(tmp_path / "b", monkeypatch, 16 * GB, 14 * GB, stat=f"file {8 * GB}\nshmem 0\n")
    assert standroom.refusal(4, {}, available=64 * GB, total=128 * GB) is None


def test_a_standby_steps_back_where_the_node_has_too_little_memory_available(tmp_path, monkeypatch):
    _job_cgroup(tmp_path, monkeypatch, 512 * GB, 0)     # the job's limit leaves room; the node does not
    why = standroom.refusal(8, {}, available=4 * GB, total=16 * GB)   # 3.2 GiB + a tenth of 16: 4.8 GiB
    assert why == ("the node has 4.3 GB of 17.2 GB available; 8 standby ranks need about 3.4 GB and "
                   "1.7 GB stay free"), why
    assert standroom.refusal(8, {}, available=5 * GB, total=16 * GB) is None


def test_slurms_mem_without_a_cgroup_counts_what_the_jobs_processes_hold(tmp_path, monkeypatch):
    """No cgroup: Slurm's --mem is the budget, less the resident memory of the job's processes on
    the node (found by their SLURM_JOB_ID): a real process of "job 91" holding 1.5 GiB of 2 GiB here."""
    monkeypatch.setattr(memory, "PROC_CGROUP", tmp_path / "no-cgroup")
    env = {"SLURM_MEM_PER_NODE": str(2 * 1024), "SLURM_JOB_ID": "91"}
    assert standroom.refusal(1, env, available=64 * GB, total=128 * GB) is None   # 2 GiB: 0.4 + 1.0 fit
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; b = bytearray(3 << 29); b[::4096] = "
                               "b'x' * len(b[::4096]); print('held', flush=True); time.sleep(60)"],
                              env={**os.environ, "SLURM_JOB_ID": "91"}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        why = standroom.refusal(1, env, available=64 * GB, total=128 * GB)
    finally:
        holder.kill()
        holder.wait()
    assert why is not None and why.startswith("the job's memory has 5") and "of 2.1 GB free (Slurm's --mem)" in why, \
        why


def test_a_standby_that_cannot_read_the_nodes_memory_steps_back_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "PROC_CGROUP", tmp_path / "no-cgroup")

    def unreadable():
        raise OSError(13, "Permission denied", "/proc/meminfo")
    monkeypatch.setattr(standroom.psutil, "virtual_memory", unreadable)
    assert standroom.refusal(2, {}) == ("the node's memory could not be read (PermissionError: [Errno 13] "
                                        "Permission denied: '/proc/meminfo')")
