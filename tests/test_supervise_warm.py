"""The warm standby (ddp_hpc.supervise.warm and .standby): real standby processes, started by a
stand-in for srun that places tasks on pretend nodes the way srun does (block distribution, one
output file, srun's exit report on its stderr), handed a new step on some of those nodes. The
real-cluster run is tests/cluster/test_warm_cluster.py."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ddp_hpc.env.sources import derive
from ddp_hpc.judge.srun import task_reports
from ddp_hpc.supervise.standby import GO_ENV_KEYS, IMPORTS_VAR, eligible, preload
from ddp_hpc.supervise.warm import Relay, Warm, step_variables

ROOT = Path(__file__).resolve().parents[1]

#: srun in small: tasks on the --nodelist's nodes, --ntasks-per-node each, every task's output to
#: --output, and srun's report of a task that failed on its own stderr
MINI_SRUN = textwrap.dedent("""
    import os, subprocess, sys
    from ddp_hpc.slurm.hostlist import compress, expand
    opts, cmd = {}, sys.argv[1:]
    while cmd and cmd[0].startswith("--"):
        key, _, value = cmd.pop(0)[2:].partition("=")
        opts[key] = value
    nodes, g = expand(opts["nodelist"]), int(opts["ntasks-per-node"])
    out = open(opts["output"], "a")
    procs = []
    for i, node in enumerate(nodes):
        for local in range(g):
            env = dict(os.environ, SLURM_JOB_ID="77", SLURM_STEP_ID="5", SLURM_PROCID=str(i * g + local),
                       SLURM_LOCALID=str(local), SLURM_NODEID=str(i), SLURM_NTASKS=str(len(nodes) * g),
                       SLURM_STEP_NODELIST=compress(nodes), SLURM_STEP_TASKS_PER_NODE=f"{g}(x{len(nodes)})",
                       SLURM_JOB_NODELIST=compress(nodes), SLURMD_NODENAME=node)
            procs.append((node, i * g + local, subprocess.Popen(cmd, env=env, stdout=out, stderr=out,
                                                                 start_new_session=True)))
    worst = 0
    for node, task, p in procs:
        rc = p.wait()
        if rc:
            print(f"srun: error: {node}: task {task}: Exited with exit code {rc}", file=sys.stderr, flush=True)
            worst = max(worst, rc)
    sys.exit(worst)
""")

#: the user's script: what it saw of its place, and a failure on request
TRAIN = textwrap.dedent("""
    import json, os, sys
    from ddp_hpc.env.sources import derive
    from ddp_hpc.runlogs.startup import PROC_START_VAR
    env = derive(os.environ)
    seen = {"rank": env.rank, "local": env.local_rank, "node_rank": env.node_rank, "world": env.world_size,
            "hosts": list(env.hostnames), "restart": env.restart_count, "argv": sys.argv,
            "proc_start": os.environ.get(PROC_START_VAR), "warm": os.environ.get("DDP_HPC_WARM_START"),
            "token": os.environ.get("DDP_HPC_STANDBY_TOKEN")}
    open(os.path.join(os.path.dirname(sys.argv[0]), f"seen{env.rank}.json"), "w").write(json.dumps(seen))
    print(f"hello from rank {env.rank}", flush=True)
    if "--fail-rank" in sys.argv and env.rank == int(sys.argv[sys.argv.index("--fail-rank") + 1]):
        sys.exit(3)
""")


class MiniSrunCLI:
    def __init__(self, path: Path):
        self.path = path

    def start_step(self, args, env, stderr=None):
        return subprocess.Popen([sys.executable, str(self.path), *args], env=dict(env), stderr=stderr,
                                text=True if stderr is not None else None)


@pytest.fixture
def standby(tmp_path):
    (tmp_path / "srun.py").write_text(MINI_SRUN)
    (tmp_path / "train.py").write_text(TRAIN)
    logs = tmp_path / "logs"
    logs.mkdir()
    said: list[str] = []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SLURMD_NODENAME": "127.0.0.1", "SLURM_JOB_ID": "77",
           IMPORTS_VAR: "json"}     # no torch: these standby ranks run a plain script

    def make(*args, extra=None):
        warm = Warm(MiniSrunCLI(tmp_path / "srun.py"), [sys.executable, str(tmp_path / "train.py"), *args],
                    str(logs), 2, say=said.append)
        warm.start(["n1", "n2", "n3"], {**env, **(extra or {})})
        return warm
    yield make, tmp_path, logs, said


def _seen(tmp_path, rank):
    return json.loads((tmp_path / f"seen{rank}.json").read_text())


def test_the_standby_ranks_on_the_new_steps_nodes_become_its_ranks(standby):
    make, tmp_path, logs, said = standby
    warm = make("--lr", "0.1")
    proc = warm.take(["n1", "n3"], {"DDP_HPC_ALLOC_RESTARTS": "1"})
    assert proc is not None and proc.wait(60) == 0, said
    assert sorted(p.name for p in tmp_path.glob("seen*.json")) == [f"seen{r}.json" for r in range(4)]
    for rank, (node, local) in enumerate([("n1", 0), ("n1", 1), ("n3", 0), ("n3", 1)]):
        seen = _seen(tmp_path, rank)
        assert (seen["local"], seen["node_rank"], seen["world"]) == (local, rank // 2, 4)
        assert seen["hosts"] == ["n1", "n3"] and seen["hosts"][seen["node_rank"]] == node
        assert seen["restart"] == 1                       # the supervisor's restart count reached it
        assert seen["argv"][1:] == ["--lr", "0.1"] and seen["warm"] == "1"
        assert float(seen["proc_start"]) > 0 and seen["token"] is None   # the secret is not passed on
        assert (logs / f"rank{rank}.out").read_text() == f"hello from rank {rank}\n"
    assert said == []


def test_srun_reports_of_a_handed_task_name_the_rank_it_became(standby, capsys):
    make, tmp_path, logs, said = standby
    warm = make("--fail-rank", "3")
    proc = warm.take(["n1", "n3"], {"DDP_HPC_ALLOC_RESTARTS": "1"})
    assert proc.wait(60) == 3
    err = ""
    for _ in range(100):                                  # the relay thread writes it
        err += capsys.readouterr().err
        if "Exited" in err:
            break
        time.sleep(0.05)
    # the standby's task 5 (n3's second) became rank 3: the batch output says task 3, as a cold step would
    assert "srun: error: n3: task 3: Exited with exit code 3" in err
    (logs / "slurm-77.out").write_text(err)
    assert {t: r.exit_code for t, r in task_reports([logs / "slurm-77.out"]).items()} == {3: 3}


#: an import that holds node n2's standby ranks until the gate file exists
GATED_IMPORT = textwrap.dedent("""
    import os, pathlib, time
    if os.environ.get("SLURMD_NODENAME") == "n2":
        while not pathlib.Path(os.environ["GATE"]).exists():
            time.sleep(0.05)
""")


def test_standby_ranks_still_importing_on_a_node_the_new_step_leaves_out_neither_delay_nor_hold_it(standby):
    """Only test of a hand-over while another node's standby ranks still import: the new step
    gets its ranks at once (no wait for n2, no cold start), and n2's ranks, told "no rank" when
    they call, exit 0 and let the step end (not after `standby.CONNECT_S` = 60 s of calling a
    closed port)."""
    make, tmp_path, logs, said = standby
    (tmp_path / "gated.py").write_text(GATED_IMPORT)
    gate = tmp_path / "gate"
    warm = make(extra={IMPORTS_VAR: "json,gated", "GATE": str(gate),
                       "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])})
    proc = warm.take(["n1", "n3"], {"DDP_HPC_ALLOC_RESTARTS": "1"})
    assert proc is not None and said == [], said
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("seen*.json"))) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [_seen(tmp_path, r)["hosts"] for r in range(4)] == [["n1", "n3"]] * 4
    assert proc.poll() is None          # n2's standby ranks still import: the step (srun) waits for them
    gate.touch()
    assert proc.wait(45) == 0
    ready = (logs / "standby.out").read_text()
    assert "task 2 on n2 ready" in ready and "task 3 on n2 ready" in ready, ready
    assert not (tmp_path / "seen4.json").exists()    # no late rank ran the script


def test_a_standby_that_cannot_serve_is_dropped_and_says_why(standby):
    make, tmp_path, logs, said = standby
    warm = make()
    assert warm.take(["n1", "n4"], {}) is None
    assert said == ["warm standby not used: it does not cover n4; starting the ranks cold"]
    warm = make()
    assert warm.take(["n1", "n3"], {}, lost=["n2"]) is None
    assert said[-1] == "warm standby not used: a node of it was lost (n2); starting the ranks cold"
    warm.drop()
    assert not list(tmp_path.glob("seen*.json"))          # no standby rank ran the script


def test_a_standby_without_room_in_the_jobs_memory_steps_back_and_the_restart_starts_cold_at_once(standby):
    """Only test of the standby's memory check with real standby ranks: under a job memory budget
    that has no room for them (Slurm's --mem of 1 MB), every standby rank imports nothing, says
    why in one line and exits `BACK_STATUS`; the restart does not wait `READY_WAIT_S` for them but
    starts cold at once and says why; status's line names the node and the budget. A later
    standby that fits is the newest: the line goes."""
    from ddp_hpc.judge.restarts import standby_lines
    from ddp_hpc.supervise.standby import BACK_STATUS
    from ddp_hpc.supervise.warm import READY_WAIT_S
    make, tmp_path, logs, said = standby
    warm = make(extra={"SLURM_MEM_PER_NODE": "1"})
    assert warm.proc.wait(30) == BACK_STATUS
    t0 = time.monotonic()
    assert warm.take(["n1", "n3"], {"DDP_HPC_ALLOC_RESTARTS": "1"}) is None
    assert time.monotonic() - t0 < READY_WAIT_S / 3
    assert len(said) == 1 and said[0].startswith("warm standby not used: it ended: on n"), said
    assert "(Slurm's --mem); 2 standby ranks need about 838.9 MB" in said[0], said
    assert said[0].endswith("starts its ranks cold; starting the ranks cold"), said
    out = (logs / "standby.out").read_text()
    assert out.count("ddp_hpc standby: stepped back on n") == 6 and " ready in " not in out, out
    assert not list(tmp_path.glob("seen*.json"))
    lines = standby_lines(logs)
    assert len(lines) == 1 and lines[0].startswith("warm standby stepped back on n"), lines
    assert "the job's memory has" in lines[0] and lines[0].endswith("(5 more standby ranks said so)"), lines
    warm = make()                      # the next standby fits: it stands by, and status says nothing
    deadline = time.monotonic() + 60
    while (logs / "standby.out").read_text().count(" ready in ") < 6 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert standby_lines(logs) == []
    warm.drop()


def test_the_relay_renumbers_only_after_the_hand_over():
    relay = Relay(iter(()), "/dev/null")
    line = "srun: error: n3: tasks 4-5: Exited with exit code 1\n"
    assert relay.line(line) == ("standby", line)          # standing by: srun's words stay with it
    relay.ranks = {0: 0, 1: 1, 4: 2, 5: 3}
    assert relay.line(line) == ("step", "srun: error: n3: tasks 2-3: Exited with exit code 1\n")
    assert relay.line("srun: error: n1: task 0: Killed\n") == ("step", "srun: error: n1: task 0: Killed\n")
    assert relay.line("srun: error: n2: task 2: Exited with exit code 1\n")[0] == "standby"   # no rank
    assert relay.line("srun: error: Node failure on n2\n") == ("step", "srun: error: Node failure on n2\n")


def test_step_variables_give_the_place_srun_would():
    for node_index, local in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        env = {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "3", **step_variables(["n1", "n3"], 2, node_index, local)}
        d = derive(env)
        assert (d.rank, d.local_rank, d.node_rank, d.world_size, d.hostnames) == (
            node_index * 2 + local, local, node_index, 4, ("n1", "n3"))
    one = step_variables(["n5"], 4, 0, 3)
    assert one["SLURM_STEP_TASKS_PER_NODE"] == "4" and derive({"SLURM_STEP_ID": "1", **one}).rank == 3
    # a standby takes no variable but these (it refuses a go with any other: tests/test_do_no_harm_standby.py)
    assert set(step_variables(["n1", "n3"], 2, 1, 1)) | {"DDP_HPC_ALLOC_RESTARTS"} == GO_ENV_KEYS


def test_only_a_python_module_or_script_can_stand_by():
    assert eligible(["/venv/bin/python", "-m", "ddp_hpc.run", "jobs/demo.yaml"])
    assert eligible(["python3.11", "train.py", "--lr", "1"])
    for cmd in (["torchrun", "train.py"], ["python", "-u", "train.py"], ["bash", "run.sh"], ["python"],
                ["apptainer", "exec", "img", "python", "train.py"], ["python", "-m"]):
        assert not eligible(cmd), cmd


def test_preload_names_what_failed_and_leaves_the_process_priority_alone():
    before = os.getpriority(os.PRIO_PROCESS, 0)
    assert preload(["python", "-m", "pkg.train"], {IMPORTS_VAR: "json, no_such_module_here"}) == [
        "no_such_module_here"]
    assert os.getpriority(os.PRIO_PROCESS, 0) == before      # only the import thread was niced


@pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"), reason="no autogroups in this kernel")
def test_a_standby_sessions_autogroup_stands_back_and_is_given_back_at_the_hand_over():
    """In a session of its own (as srun starts a task), the standby's autogroup goes to nice 19
    while it stands by and back to 0 when it becomes a rank."""
    code = ("from ddp_hpc.supervise.standby import autogroup_nice\n"
            "def nice(): return open('/proc/self/autogroup').read().split()[-1]\n"
            "assert autogroup_nice(19); a = nice()\n"
            "assert autogroup_nice(0); print(a, nice())\n")
    ours = open("/proc/self/autogroup").read()
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=60, start_new_session=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["19", "0"]
    assert open("/proc/self/autogroup").read() == ours       # this session's untouched


@pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"), reason="no autogroups in this kernel")
def test_under_a_slurmstepd_the_steps_autogroup_stands_back(tmp_path):
    """srun's tasks do not lead their session (Slurm 22.05 here): their step's slurmstepd made it
    when it daemonized, and the process that made it has exited. As there: a session whose leader
    exits, a process named slurmstepd in it, and the standby its child. The standby niced that
    session's autogroup, the step's alone, and no other."""
    stepd = tmp_path / "slurmstepd"            # the kernel names a process after the file it runs
    stepd.symlink_to(sys.executable)
    task = ("from ddp_hpc.supervise.standby import autogroup_nice, own_session\n"
            "print(own_session(), autogroup_nice(19), open('/proc/self/autogroup').read().split()[-1])\n")
    step = ("import subprocess, time\n"
            "time.sleep(0.5)\n"                 # the session's leader is gone by now
            f"subprocess.run([{sys.executable!r}, '-c', {task!r}], check=True)\n"   # the venv's python
            "print(open('/proc/self/autogroup').read().split()[-1])\n")
    leader = f"import subprocess; subprocess.Popen([{str(stepd)!r}, '-c', {step!r}])\n"
    ours = open("/proc/self/autogroup").read()
    out = subprocess.run([sys.executable, "-c", leader], env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=60, start_new_session=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "19", "19"], out.stderr   # the task's, then the step's
    assert open("/proc/self/autogroup").read() == ours


@pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"), reason="no autogroups in this kernel")
def test_a_standby_that_shares_its_launchers_session_leaves_the_autogroup_alone():
    """Started without a session of its own, the standby's autogroup is its launcher's: niced, it
    would hold back the launcher and everything else of that session (a CI run's every test went
    ~2x slower that way). It leaves it as it is."""
    code = ("import json; from ddp_hpc.supervise.standby import autogroup_nice\n"
            "print(json.dumps([autogroup_nice(19), open('/proc/self/autogroup').read()]))\n")
    ours = open("/proc/self/autogroup").read()    # empty in the default autogroup (a session never set)
    try:
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == [False, ours]
        assert open("/proc/self/autogroup").read() == ours
    finally:        # a failure must not leave the rest of this test run niced
        if ours.split():
            with open("/proc/self/autogroup", "w") as f:
                f.write(ours.split()[-1])


def test_a_standby_stopped_while_it_waits_says_so_in_one_line_without_a_traceback(tmp_path):
    """At a job's end srun aborts the standby step (SIGINT) wherever its standby ranks are: still
    importing, or trying to reach a supervisor that is gone. That is no error: one line, exit 130,
    no traceback in standby.out (there was one, from the connect loop's sleep)."""
    (tmp_path / "train.py").write_text("print('the script ran')\n")
    with socket.socket() as s:          # a port nobody listens on: the connect loop retries
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), IMPORTS_VAR: "json", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "5",
           "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "1",
           "SLURM_STEP_NODELIST": "n1", "SLURM_JOB_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": "1",
           "SLURMD_NODENAME": "n1"}
    p = subprocess.Popen([sys.executable, "-m", "ddp_hpc.supervise.standby", "--go", f"127.0.0.1:{port}", "--",
                          sys.executable, str(tmp_path / "train.py")], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    out = ""
    deadline = time.monotonic() + 60
    while "ready in" not in out and time.monotonic() < deadline:
        out += p.stdout.readline()
    assert "ready in" in out, out
    time.sleep(0.3)                     # in the connect loop now
    p.send_signal(signal.SIGINT)
    out += p.communicate(timeout=30)[0]
    assert p.returncode == 130, out
    assert "stopped while standing by; ran nothing" in out and "Traceback" not in out, out
    assert "the script ran" not in out
