"""The health check of a step's nodes (ddp_hpc.supervise.nodecheck on each node,
ddp_hpc.supervise.health in the supervisor): each check by itself (the GPUs through NVML, absent and
stood in for at its Python boundary; scratch and the checkpoint folder; the rendezvous address),
the check as a process, and the supervisor's exclusion through a stand-in ``srun`` that runs the
real check once per pretend node. The same on the real test cluster:
tests/cluster/test_health_cluster.py."""

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from ddp_hpc.slurm.cli import SlurmCLI
from ddp_hpc.supervise import nodecheck
from ddp_hpc.supervise.health import NO_CHECKPOINT_NEED_BYTES, Seen, check_nodes, checkpoint_need, failures, health_row
from ddp_hpc.supervise.plan import NodePlan, Policy

REPO = Path(__file__).resolve().parents[1]


# -- GPUs ----------------------------------------------------------------------------------------

def test_gpu_check_is_skipped_without_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)   # import pynvml raises ImportError
    assert nodecheck.gpu_problems(None) == ([], ["GPU: nvidia-ml-py not installed"], {})
    assert nodecheck.gpu_problems([]) == ([], ["GPU: none visible to the step"], {})


def _fake_nvml(devices: dict, init_error: str | None = None) -> types.ModuleType:
    """pynvml's Python surface as the check calls it; ``devices``: index -> None (lost: every call
    on it raises), or {"ecc": N, "pending": bool}."""
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    m.NVMLError, m.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, m.NVML_VOLATILE_ECC = NVMLError, 1, 0
    m.calls = []

    def init():
        m.calls.append("init")
        if init_error:
            raise NVMLError(init_error)

    def handle(i):
        if devices.get(i) is None:
            raise NVMLError("GPU is lost")
        return devices[i]

    m.nvmlInit, m.nvmlShutdown = init, lambda: m.calls.append("shutdown")
    m.nvmlDeviceGetCount = lambda: len(devices)
    m.nvmlDeviceGetHandleByIndex = handle
    m.nvmlDeviceGetHandleByUUID = lambda u: handle(int(u.rsplit("-", 1)[1]))
    m.nvmlDeviceGetMemoryInfo = lambda h: (1, 2, 3)
    m.nvmlDeviceGetTotalEccErrors = lambda h, kind, counter: h["ecc"]
    m.nvmlDeviceGetRetiredPagesPendingStatus = lambda h: int(h["pending"])
    return m


def test_gpu_check_names_a_lost_gpu_and_pending_pages_and_counts_ecc_errors(monkeypatch):
    nvml = _fake_nvml({0: {"ecc": 0, "pending": False}, 1: None, 2: {"ecc": 3, "pending": True},
                       3: {"ecc": 5, "pending": False}})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    problems, skipped, ecc = nodecheck.gpu_problems(None)
    assert skipped == []
    # a volatile ECC count is no problem by itself (since the driver loaded): the supervisor
    # compares it with the node's last check (health.ecc_problems; issue 38, bug 5)
    assert problems == ["GPU 1 does not answer (NVML: GPU is lost)",
                        "GPU 2: retired memory pages pending (the GPU needs a reset)"]
    assert ecc == {"0": 0, "2": 3, "3": 5}
    assert nvml.calls == ["init", "shutdown"]
    # only the GPUs the step sees (CUDA_VISIBLE_DEVICES), by index or UUID
    assert nodecheck.gpu_problems(["0"]) == ([], [], {"0": 0})
    assert nodecheck.gpu_problems(["GPU-x-1"])[0] == ["GPU GPU-x-1 does not answer (NVML: GPU is lost)"]


def test_gpu_check_is_skipped_when_nvml_finds_no_driver(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml({}, init_error="Driver Not Loaded"))
    assert nodecheck.gpu_problems(None) == ([], ["GPU: NVML not available (Driver Not Loaded)"], {})


# -- scratch, checkpoint folder, rendezvous ------------------------------------------------------

def test_space_check_writable_unwritable_and_full(tmp_path):
    assert nodecheck.space_problem(str(tmp_path), 1) is None
    assert list(tmp_path.iterdir()) == []           # the probe file is gone
    blocked = tmp_path / "scratch"
    blocked.write_text("a file where a folder should be")   # unwritable even for root
    assert nodecheck.space_problem(str(blocked), 1) == f"{blocked} not writable (Not a directory)"
    why = nodecheck.space_problem(str(tmp_path), 10**16)
    assert why.startswith(f"{tmp_path} full (") and why.endswith(" GB free, a checkpoint needs 10000000.0 GB)")


def test_reach_check():
    assert nodecheck.reach_problem("127.0.0.1", 29500) is None
    why = nodecheck.reach_problem("no-such-node.invalid", 29500)
    assert why.startswith("rendezvous host no-such-node.invalid does not resolve (")


def _task_env(node: str, tmpdir: str, **extra) -> dict:
    return {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), "SLURM_JOB_ID": "7", "SLURM_PROCID": "0",
            "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NNODES": "1",
            "SLURM_JOB_NODELIST": node, "SLURM_STEP_NODELIST": node, "SLURMD_NODENAME": node,
            "MASTER_ADDR": "127.0.0.1", "TMPDIR": tmpdir, **extra}


def test_check_process_reports_its_node_in_one_json_line(tmp_path):
    (tmp_path / "tmp").write_text("")    # a scratch that takes no file
    cmd = [sys.executable, "-m", "ddp_hpc.supervise.nodecheck", "--dir", str(tmp_path), "--need-bytes", "10",
           f"--stage=10:{tmp_path / 'tmp' / 'ddp_hpc-stage-7-x'}"]
    ok = subprocess.run(cmd[:-1], env=_task_env("n4", str(tmp_path)), capture_output=True, text=True, timeout=60)
    rec = json.loads(ok.stdout)
    assert ok.returncode == 0 and rec["node"] == "n4" and rec["ok"] and rec["problems"] == []
    bad = subprocess.run(cmd, env=_task_env("n4", str(tmp_path)), capture_output=True, text=True, timeout=60)
    rec = json.loads(bad.stdout)
    # exit 0 all the same: a failed check step would read as a failed job step in sacct and status
    assert bad.returncode == 0 and not rec["ok"]
    assert rec["problems"] == [f"{tmp_path / 'tmp'} not writable (Not a directory)"]


def test_the_check_task_sees_every_gpu_of_its_node_and_passes(tmp_path):
    """The check step runs one task per node, which sees all the node's GPUs: not the training
    step's one-task-per-GPU layout that `ddp_hpc.env.detect` insists on (it failed every GPU node)."""
    cmd = [sys.executable, "-m", "ddp_hpc.supervise.nodecheck", "--dir", str(tmp_path)]
    env = _task_env("n4", str(tmp_path), CUDA_VISIBLE_DEVICES="0,1", SLURM_GPUS_ON_NODE="2",
                    SLURM_JOB_GPUS="0,1", SLURM_GPUS_PER_NODE="2")
    rec = json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60).stdout)
    assert rec["node"] == "n4" and rec["ok"], rec["problems"]


# -- the supervisor's side -----------------------------------------------------------------------

def test_checkpoint_need_is_the_newest_checkpoints_size(tmp_path):
    assert checkpoint_need(tmp_path) == ([], NO_CHECKPOINT_NEED_BYTES)
    ck = tmp_path / "ckpt"
    ck.mkdir()
    (ck / "step2.pt").write_bytes(b"x" * 300)
    (ck / "step4.pt").write_bytes(b"x" * 500)
    lines = [{"event": "checkpoint", "rank": 0, "restart": 0, "step": s, "path": str(ck / f"step{s}.pt")}
             for s in (2, 4)]
    (tmp_path / "rank0.events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert checkpoint_need(tmp_path) == ([str(ck)], 500)


def test_failures_names_failed_and_silent_nodes():
    out = "\n".join([json.dumps({"node": "n1", "ok": True, "problems": []}), "srun: noise",
                     json.dumps({"node": "n2", "ok": False, "problems": ["/tmp full (0.1 GB free, the staged "
                                                                         "data needs 1.5 GB)"]})])
    assert failures(["n1", "n2", "n3"], 1, out) == {
        "n2": "/tmp full (0.1 GB free, the staged data needs 1.5 GB)",
        "n3": "no answer to the health check (srun exited with status 1)"}
    assert failures(["n1"], None, "") == {"n1": "no answer to the health check within 20 s"}


# a stand-in srun: runs the command after its options once per node of --nodelist, as that node's
# one task (the variables a real srun sets); FAKE_TMPDIR_<node> gives a node its own scratch
SRUN = textwrap.dedent("""
    import os, subprocess, sys
    from ddp_hpc.slurm.hostlist import expand
    args = sys.argv[1:]
    opts = {}
    while args and args[0].startswith("--"):
        k, _, v = args.pop(0)[2:].partition("=")
        opts[k] = v
    nodes = expand(opts["nodelist"])
    rc = 0
    for i, node in enumerate(nodes):
        env = dict(os.environ, SLURM_PROCID=str(i), SLURM_NTASKS=str(len(nodes)), SLURM_LOCALID="0",
                   SLURM_STEP_ID="1", SLURM_STEP_NUM_TASKS=str(len(nodes)),
                   SLURM_STEP_TASKS_PER_NODE=f"1(x{len(nodes)})", SLURM_NODEID=str(i),
                   SLURM_NNODES=str(len(nodes)), SLURM_STEP_NODELIST=opts["nodelist"],
                   SLURM_JOB_NODELIST=opts["nodelist"], SLURMD_NODENAME=node, MASTER_ADDR="127.0.0.1")
        env["TMPDIR"] = os.environ.get("FAKE_TMPDIR_" + node, env.get("TMPDIR", "/tmp"))
        rc = subprocess.run(args, env=env).returncode or rc
    sys.exit(rc)
""")


# a stand-in pynvml for the check processes the stand-in srun starts: each node's GPUs from
# FAKE_NVML_DIR/<node>.json ({index: {"ecc": N} or null: lost}), read at each check (so a count can
# grow between two); a node without a file has one healthy GPU
NVML = textwrap.dedent("""
    import json, os
    class NVMLError(Exception):
        pass
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC = 1, 0
    _f = os.path.join(os.environ["FAKE_NVML_DIR"], os.environ["SLURMD_NODENAME"] + ".json")
    _gpus = json.load(open(_f)) if os.path.exists(_f) else {"0": {"ecc": 0}}
    def nvmlInit(): pass
    def nvmlShutdown(): pass
    def nvmlDeviceGetCount(): return len(_gpus)
    def nvmlDeviceGetHandleByIndex(i):
        if _gpus.get(str(i)) is None:
            raise NVMLError("GPU is lost")
        return _gpus[str(i)]
    def nvmlDeviceGetMemoryInfo(h): return (1, 2, 3)
    def nvmlDeviceGetTotalEccErrors(h, kind, counter): return h["ecc"]
    def nvmlDeviceGetRetiredPagesPendingStatus(h): return 0
""")


@pytest.fixture
def fake_srun(tmp_path):
    bindir, nvml = tmp_path / "bin", tmp_path / "nvml"
    bindir.mkdir()
    nvml.mkdir()
    (bindir / "srun").write_text(f"#!{sys.executable}\n{SRUN}")
    (bindir / "srun").chmod(0o755)
    (nvml / "pynvml.py").write_text(NVML)
    return {"PATH": f"{bindir}:{os.environ['PATH']}", "PYTHONPATH": f"{nvml}:{REPO}", "SLURM_JOB_ID": "7",
            "TMPDIR": str(tmp_path), "FAKE_NVML_DIR": str(nvml)}


def _gpus(env: dict, node: str, gpus: dict) -> None:
    Path(env["FAKE_NVML_DIR"], f"{node}.json").write_text(json.dumps(gpus))


def test_check_nodes_swaps_a_failed_node_for_a_spare(tmp_path, fake_srun):
    _gpus(fake_srun, "n2", {"0": None})    # n2's GPU fell off the bus
    plan = NodePlan(active=["n1", "n2"], spare=["n3"])
    c = check_nodes(SlurmCLI(env=fake_srun), plan, Policy(nodes=2, tasks_per_node=1, spare_nodes=1), fake_srun,
                    False, str(tmp_path), Seen())
    assert c.failed == {"n2": "GPU 0 does not answer (NVML: GPU is lost)"}
    assert c.plan.active == ["n1", "n3"] and c.plan.excluded == ["n2"] and c.rounds == 2
    row = health_row(c, 0, "7")
    assert row["excluded"] == c.failed and row["nodes_after"] == ["n1", "n3"] and row["not_started"] is None


def test_check_nodes_shrinks_to_min_nodes_or_gives_up(tmp_path, fake_srun):
    _gpus(fake_srun, "n1", {"0": None})
    env, plan = fake_srun, NodePlan(active=["n1", "n2"], spare=[])
    c = check_nodes(SlurmCLI(env=env), plan, Policy(nodes=2, tasks_per_node=1, min_nodes=1), env, False, str(tmp_path),
                    Seen())
    assert c.plan.active == ["n2"] and list(c.failed) == ["n1"]
    c = check_nodes(SlurmCLI(env=env), NodePlan(active=["n1", "n2"], spare=[]), Policy(nodes=2, tasks_per_node=1),
                    env, False, str(tmp_path), Seen())
    assert c.plan is None and "fewer than --min-nodes 2" in c.change
    assert health_row(c, 0, "7")["not_started"] == c.change


def test_a_job_whose_scratch_is_tiny_but_unused_loses_no_node(tmp_path, fake_srun):
    """Issue 38, bug 5: a diskless node (its scratch takes no file) runs a job that stages nothing."""
    (tmp_path / "nodisk").write_text("")
    env = {**fake_srun, "FAKE_TMPDIR_n1": str(tmp_path / "nodisk"), "FAKE_TMPDIR_n2": str(tmp_path / "nodisk")}
    c = check_nodes(SlurmCLI(env=env), NodePlan(active=["n1", "n2"], spare=[]), Policy(nodes=2, tasks_per_node=1),
                    env, True, str(tmp_path), Seen())
    assert c.failed == {} and c.plan.active == ["n1", "n2"] and c.notes == ()


def test_a_checkpoint_folder_that_takes_no_file_excludes_no_node_and_is_said_once(tmp_path, fake_srun):
    """Issue 38, bug 5: the checkpoint folder is on the shared filesystem; its problem is every
    node's alike, so it is said (once) and no node is excluded for it."""
    (tmp_path / "blocked").write_text("")
    ev = {"event": "checkpoint", "rank": 0, "restart": 0, "step": 4, "path": str(tmp_path / "blocked" / "step4.pt")}
    (tmp_path / "rank0.events.jsonl").write_text(json.dumps(ev) + "\n")
    seen, cli = Seen(), SlurmCLI(env=fake_srun)
    c = check_nodes(cli, NodePlan(active=["n1", "n2"], spare=[]), Policy(nodes=2, tasks_per_node=1), fake_srun, True,
                    str(tmp_path), seen)
    assert c.failed == {} and c.plan.active == ["n1", "n2"]
    assert c.notes == (f"checkpoint folder {tmp_path / 'blocked'} not writable (Not a directory): "
                       "not a node's fault, no node excluded",)
    again = check_nodes(cli, c.plan, Policy(nodes=2, tasks_per_node=1), fake_srun, True, str(tmp_path), seen)
    assert again.failed == {} and again.notes == ()


def test_only_a_growing_ecc_count_excludes_a_node(tmp_path, fake_srun):
    """Issue 38, bug 5: a volatile ECC count that does not grow between two checks (an earlier
    job's error, since the driver loaded) is no reason to exclude; growth is."""
    _gpus(fake_srun, "n1", {"0": {"ecc": 3}})
    seen, cli = Seen(), SlurmCLI(env=fake_srun)
    policy, plan = Policy(nodes=2, tasks_per_node=1, spare_nodes=1), NodePlan(active=["n1", "n2"], spare=["n3"])
    first = check_nodes(cli, plan, policy, fake_srun, False, str(tmp_path), seen)
    assert first.failed == {} and first.plan.active == ["n1", "n2"]
    assert first.notes == ("n1: GPU 0 had 3 uncorrected ECC error(s) since the driver loaded "
                           "(excluded only if the count grows)",)
    second = check_nodes(cli, first.plan, policy, fake_srun, True, str(tmp_path), seen)
    assert second.failed == {} and second.notes == ()
    _gpus(fake_srun, "n1", {"0": {"ecc": 4}})
    third = check_nodes(cli, second.plan, policy, fake_srun, True, str(tmp_path), seen)
    assert third.failed == {"n1": "GPU 0: uncorrected ECC errors grew from 3 to 4 since the last health check"}
    assert third.plan.active == ["n2", "n3"] and third.plan.excluded == ["n1"]


def test_status_says_why_a_node_was_excluded(tmp_path):
    from ddp_hpc.judge.reader import RunLogs
    from ddp_hpc.judge.restarts import alloc_restarts, read_restarts, read_stops, restart_lines
    from ddp_hpc.runlogs.restarts import append_health

    why = "/tmp full (0.1 GB free, checkpoint needs 1.5 GB)"
    append_health(tmp_path, {"health_check": 0, "job_id": "7", "time": 1.0e9, "seconds": 1.234,
                             "excluded": {"n2": why}, "nodes_after": ["n1", "n3"], "not_started": None})
    rows = alloc_restarts(None, str(tmp_path), RunLogs(tmp_path))
    assert read_restarts(tmp_path) == [] and read_stops(tmp_path) == []   # no restart, no stop
    lines = restart_lines(rows)
    assert lines[0].startswith("Health check before the first start at ")
    assert lines[0].endswith(f"(1.2 s): n2 excluded: {why}") and lines[1] == "  started on n1, n3"


def test_status_says_what_a_check_noted_without_excluding_a_node(tmp_path, fake_srun):
    """A check that excluded no node but noted something (the checkpoint folder takes no file):
    a line of restarts.jsonl, and status says it in its words, with no node excluded."""
    from ddp_hpc.judge.reader import RunLogs
    from ddp_hpc.judge.restarts import alloc_restarts, restart_lines
    from ddp_hpc.runlogs.restarts import append_health

    (tmp_path / "blocked").write_text("")
    ev = {"event": "checkpoint", "rank": 0, "restart": 0, "step": 4, "path": str(tmp_path / "blocked" / "step4.pt")}
    (tmp_path / "rank0.events.jsonl").write_text(json.dumps(ev) + "\n")
    c = check_nodes(SlurmCLI(env=fake_srun), NodePlan(active=["n1", "n2"], spare=[]),
                    Policy(nodes=2, tasks_per_node=1), fake_srun, True, str(tmp_path), Seen())
    append_health(tmp_path, health_row(c, 1, "7"))
    lines = restart_lines(alloc_restarts(None, str(tmp_path), RunLogs(tmp_path)))
    assert lines[0].startswith("Health check before restart 1 at ") and lines[0].endswith("no node excluded")
    assert lines[1:] == [f"  noted: checkpoint folder {tmp_path / 'blocked'} not writable (Not a directory): "
                         "not a node's fault, no node excluded"]
