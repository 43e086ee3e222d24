"""ddp_hpc.slurm.cli without a running cluster: the argv each method builds (through a recording
runner), job-id and signal validation, error messages from real failing Slurm commands (no
controller, no accounting), and show_hostnames through the real scontrol. Parsing of live squeue /
sacct / sinfo output is in tests/cluster/test_slurmcli_cluster.py."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess

import pytest

from ddp_hpc.errors import HintError
from ddp_hpc.slurm.cli import SEP, SlurmArgumentError, SlurmCLI, SlurmError, gpus_in_gres, validate_job_id
from ddp_hpc.slurm.times import duration_seconds, format_duration, normalize_duration, timestamp

SCRIPT = "#!/bin/bash\n#SBATCH --nodes=1\nsrun hostname\n"


class Recorder:
    """A runner that records each call and answers with canned process results."""

    def __init__(self, stdout="", returncode=0, stderr=""):
        self.calls = []
        self.answer = (stdout, returncode, stderr)

    def __call__(self, argv, *, input=None, cwd=None, env=None, timeout=None):
        self.calls.append({"argv": argv, "input": input, "cwd": cwd, "env": env, "timeout": timeout})
        stdout, returncode, stderr = self.answer
        return subprocess.CompletedProcess(argv, returncode, stdout, stderr)

    @property
    def argv(self):
        return self.calls[-1]["argv"]


# -- job ids --------------------------------------------------------------------------------------


@pytest.mark.parametrize("good, text", [("12", "12"), (12, "12"), ("12_3", "12_3"), (" 7 ", "7")])
def test_validate_job_id_accepts(good, text):
    assert validate_job_id(good) == text


@pytest.mark.parametrize(
    "bad", ["", "abc", "12;rm -rf ~", "--all", "-1", "12_", "_3", "1_2_3", "12.batch", "12 13",
            "12,13", "$(id)", "12\n13", None, 1.5, ["12"]],
)
def test_validate_job_id_refuses(bad):
    with pytest.raises(ValueError) as info:
        validate_job_id(bad)
    assert repr(bad) in str(info.value) and "1234_7" in str(info.value)


def test_every_job_id_method_validates_before_running_anything():
    rec = Recorder()
    cli = SlurmCLI(runner=rec)
    for call in (lambda: cli.requeue("1;reboot"), lambda: cli.cancel("--all"),
                 lambda: cli.squeue(["5", "x"]), lambda: cli.sacct(["5", "6 7"]),
                 lambda: cli.sacct([])):
        with pytest.raises(ValueError):
            call()
    assert rec.calls == []


# -- argv building --------------------------------------------------------------------------------


def test_sbatch_passes_script_on_stdin_and_parses_parsable_output(tmp_path):
    conf = tmp_path / "slurm.conf"   # SLURM_CONF must name a file, or no command starts
    conf.write_text("ClusterName=x\n")
    rec = Recorder(stdout="4242\n")
    cli = SlurmCLI(runner=rec, env={"PATH": "/usr/bin", "SLURM_CONF": str(conf)})
    job = cli.sbatch(SCRIPT, args=["--nodes=2", "--job-name=a b;c"], cwd="/tmp",
                     env={"DDP_HPC_LOG_DIR": "/logs"})
    assert job == "4242"
    call = rec.calls[0]
    assert call["argv"] == ["sbatch", "--parsable", "--nodes=2", "--job-name=a b;c"]
    assert call["input"] == SCRIPT and call["cwd"] == "/tmp"
    # per-call variables are added to the CLI's environment, which is not changed
    assert call["env"] == {"PATH": "/usr/bin", "SLURM_CONF": str(conf),
                           "DDP_HPC_LOG_DIR": "/logs"}
    assert cli.env == {"PATH": "/usr/bin", "SLURM_CONF": str(conf)}


def test_sbatch_federated_output_and_warnings():
    rec = Recorder(stdout="77;clusterA\n", stderr="sbatch: warning: something\n")
    assert SlurmCLI(runner=rec).sbatch(SCRIPT) == "77"


@pytest.mark.parametrize("stdout", ["", "Submitted batch job 5\n", "abc;x\n"])
def test_sbatch_without_a_job_id_is_an_error(stdout):
    with pytest.raises(SlurmError, match="no job id"):
        SlurmCLI(runner=Recorder(stdout=stdout)).sbatch(SCRIPT)


def test_sbatch_refuses_a_string_of_args_and_a_script_without_interpreter():
    rec = Recorder(stdout="1\n")
    with pytest.raises(TypeError, match="not the string '--nodes=2'"):
        SlurmCLI(runner=rec).sbatch(SCRIPT, args="--nodes=2")
    with pytest.raises(ValueError, match="#!/bin/bash"):
        SlurmCLI(runner=rec).sbatch("srun hostname\n")
    assert rec.calls == []


@pytest.mark.parametrize("src, dest", [("", "/tmp/x"), ("-rf", "/tmp/x"), ("/a", "/tmp/x\ny"), ("/a", None)])
def test_sbcast_refuses_unusable_paths_with_a_hint(src, dest):
    rec = Recorder()
    with pytest.raises(SlurmArgumentError) as info:
        SlurmCLI(runner=rec).sbcast(src, dest)
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, HintError)
    assert err.hint == "pass an absolute path" and str(err).endswith("\nHINT: pass an absolute path")
    assert "is not a usable path" in err.problem and "; HINT" not in str(err)
    assert rec.calls == []


def test_requeue_and_cancel_argv():
    rec = Recorder()
    cli = SlurmCLI(runner=rec)
    cli.requeue(31)
    assert rec.argv == ["scontrol", "requeue", "31"]
    cli.cancel("31_2")
    assert rec.argv == ["scancel", "31_2"]
    cli.cancel("31", signal="usr1", batch=True)
    assert rec.argv == ["scancel", "--signal=USR1", "--batch", "31"]
    cli.cancel("31", signal=10)
    assert rec.argv == ["scancel", "--signal=10", "31"]
    with pytest.raises(ValueError, match="invalid signal 'USR1; reboot'"):
        cli.cancel("31", signal="USR1; reboot")


def test_squeue_argv_uses_unlimited_width_fields_with_a_separator():
    rec = Recorder()
    assert SlurmCLI(runner=rec).squeue(["5", "6_1"], user="alice") == []
    argv = rec.argv
    assert argv[:3] == ["squeue", "--noheader", "--array"]
    fmt = argv[3]
    assert fmt.startswith("--Format=JobArrayID:" + SEP + ",")
    assert fmt.endswith(",Name:" + SEP)
    assert "--states=all" in argv and "--jobs=5,6_1" in argv and "--user=alice" in argv
    with pytest.raises(ValueError, match="invalid user name"):
        SlurmCLI(runner=rec).squeue(user="-x")


def test_squeue_unknown_job_is_an_empty_list_not_an_error():
    rec = Recorder(returncode=1, stderr="slurm_load_jobs error: Invalid job id specified\n")
    assert SlurmCLI(runner=rec).squeue(["999"]) == []


def test_sacct_argv():
    rec = Recorder()
    cli = SlurmCLI(runner=rec)
    assert cli.sacct("12") == []
    assert rec.argv[:4] == ["sacct", "--parsable2", "--noheader", f"--delimiter={SEP}"]
    assert rec.argv[4].startswith("--format=JobID,") and rec.argv[-1] == "--jobs=12"
    cli.sacct(["12", "13_1"], completion=True, duplicates=True)
    assert "--completion" in rec.argv and "--duplicates" in rec.argv
    assert rec.argv[-1] == "--jobs=12,13_1"


def test_unexpected_output_shape_is_a_slurm_error():
    rec = Recorder(stdout="12" + SEP + "COMPLETED\n")
    with pytest.raises(SlurmError, match="cannot parse output line"):
        SlurmCLI(runner=rec).sacct(["12"])


@pytest.mark.parametrize(
    "gres, gpus",
    [("gpu:4", 4), ("gpu:a100:2(S:0-1)", 2), ("gpu:a100:2(S:0-1),gpu:v100:1", 3),
     ("(null)", 0), ("", 0), ("mps:100,gpu:2", 2), ("gpu", 1), ("shard:8", 0)],
)
def test_gpus_in_gres(gres, gpus):
    assert gpus_in_gres(gres) == gpus


def test_available_looks_on_the_given_path(tmp_path):
    fake = tmp_path / "sbatch"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert SlurmCLI(env={"PATH": str(tmp_path)}).available() is True
    assert SlurmCLI(env={"PATH": str(tmp_path / "none")}).available() is False


# -- errors from real processes -------------------------------------------------------------------


def test_missing_command_names_it_and_hints(tmp_path):
    cli = SlurmCLI(env={"PATH": str(tmp_path)})
    with pytest.raises(SlurmError) as info:
        cli.requeue("5")
    assert info.value.command == "scontrol requeue 5"
    assert "could not be started" in str(info.value) and "HINT: is Slurm installed" in str(info.value)


def test_timeout_names_the_command(tmp_path):
    slow = tmp_path / "scontrol"
    slow.write_text("#!/bin/sh\nexec /bin/sleep 30\n")
    slow.chmod(0o755)
    cli = SlurmCLI(env={"PATH": str(tmp_path)}, timeout=0.5)
    with pytest.raises(SlurmError, match=r"`scontrol requeue 8` did not finish within 0.5 s"):
        cli.requeue(8)


@pytest.fixture
def no_controller_env(tmp_path):
    """A valid slurm.conf whose controller is not running (MessageTimeout=1: fail fast)."""
    if shutil.which("scontrol") is None:
        pytest.skip("Slurm client commands are not installed (apt-get install slurm-wlm)")
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=clitest\nSlurmctldHost=localhost\nSlurmctldPort=9\nMessageTimeout=1\n"
        "NodeName=n[1-2] CPUs=1 State=UNKNOWN\nPartitionName=debug Nodes=n[1-2] Default=YES\n"
    )
    return {**os.environ, "SLURM_CONF": str(conf)}


def test_real_sbatch_without_controller_raises_with_command_status_and_stderr(no_controller_env):
    cli = SlurmCLI(env=no_controller_env)
    with pytest.raises(SlurmError) as info:
        cli.sbatch(SCRIPT, args=["--job-name=x y"])
    err = info.value
    assert err.argv == ["sbatch", "--parsable", "--job-name=x y"]
    assert err.returncode == 1
    assert "Unable to contact slurm controller" in err.stderr
    assert str(err).startswith("`" + shlex.join(err.argv) + "` exited with status 1: ")


def test_real_squeue_and_scontrol_without_controller(no_controller_env):
    cli = SlurmCLI(env=no_controller_env)
    for call in (lambda: cli.squeue(), lambda: cli.cluster_name(), lambda: cli.sinfo_partitions()):
        with pytest.raises(SlurmError, match="Unable to contact slurm controller"):
            call()


def test_real_sacct_without_accounting_hints_at_the_fix(no_controller_env):
    cli = SlurmCLI(env=no_controller_env)
    with pytest.raises(SlurmError) as info:
        cli.sacct(["5"])
    assert "accounting storage is disabled" in str(info.value)
    assert "\nHINT: sacct needs slurmdbd" in str(info.value)
    assert isinstance(info.value, HintError) and isinstance(info.value, RuntimeError)
    assert info.value.hint.startswith("sacct needs slurmdbd") and "HINT" not in info.value.problem
    with pytest.raises(SlurmError, match="job completion is disabled"):
        cli.sacct(["5"], completion=True)


def test_show_hostnames_uses_real_scontrol(no_controller_env):
    cli = SlurmCLI(env=no_controller_env)
    assert cli.show_hostnames("gpu[001-003,010],r[1-2]n[01-02]") == [
        "gpu001", "gpu002", "gpu003", "gpu010", "r1n01", "r1n02", "r2n01", "r2n02"]
    with pytest.raises(SlurmError) as info:
        cli.show_hostnames("n[3-1]")  # scontrol exits 0 here; its stderr says what is wrong
    assert "Invalid hostlist: n[3-1]" in str(info.value)
    assert info.value.command == "scontrol show hostnames 'n[3-1]'"
    for bad in ("", "--help", "-a"):
        with pytest.raises(ValueError, match="empty or starts with '-'"):
            cli.show_hostnames(bad)


# -- parsing of output captured from Slurm 22.05.8 on the test cluster ----------------------------
# (tests/cluster/test_slurmcli_cluster.py parses the same commands live; these lines pin the
# format so a parser change that breaks it fails on any machine).

SQUEUE_22_05 = (
    "2_0\x1f2\x1f2\x1f0\x1fPENDING\x1fJobHeldUser\x1f0:00\x1fUNLIMITED\x1f1\x1f0\x1f\x1fdebug\x1f"
    "root\x1f2026-11-22T15:43:19\x1fN/A\x1fN/A\x1farr\x1f\n"
    "1\x1f1\x1f1\x1fN/A\x1fRUNNING\x1fNone\x1f0:02\x1f2:00\x1f2\x1f0\x1fn[1-2]\x1fdebug\x1froot\x1f"
    "2026-11-22T15:43:19\x1f2026-11-22T15:43:19\x1f2026-11-22T15:45:19\x1frun x\x1f\n"
)
SACCT_22_05 = (
    "1\x1f1\x1fCOMPLETED\x1f0:0\x1f00:00:01\x1f00:02:00\x1f1\x1fn1\x1fdebug\x1f2026-11-22T15:42:21"
    "\x1f2026-11-22T15:42:22\x1f2026-11-22T15:42:23\x1fa b|c\n"
    "1.batch\x1f1.batch\x1fCOMPLETED\x1f0:0\x1f00:00:01\x1f\x1f1\x1fn1\x1f\x1f2026-11-22T15:42:22"
    "\x1f2026-11-22T15:42:22\x1f2026-11-22T15:42:23\x1fbatch\n"
)
#: sinfo --exact of tests/cluster's test cluster (nodes: CPUs=8 RealMemory=4000 Gres=gpu:4)
SINFO_22_05 = "debug\x1fdebug*\x1fup\x1finfinite\x1f4\x1fidle\x1fn[1-4]\x1fgpu:4\x1f8\x1f4000\n"


def test_parse_real_squeue_output():
    rows = SlurmCLI(runner=Recorder(stdout=SQUEUE_22_05)).squeue()
    assert rows[0] == {
        "JobArrayID": "2_0", "JobID": "2", "ArrayJobID": "2", "ArrayTaskID": "0",
        "State": "PENDING", "Reason": "JobHeldUser", "TimeUsed": "0:00", "TimeLimit": "UNLIMITED",
        "NumNodes": "1", "RestartCnt": "0", "NodeList": "", "Partition": "debug",
        "UserName": "root", "SubmitTime": "2026-11-22T15:43:19", "StartTime": "N/A",
        "EndTime": "N/A", "Name": "arr",
    }
    assert rows[1]["JobArrayID"] == "1" and rows[1]["NodeList"] == "n[1-2]"
    assert rows[1]["Name"] == "run x" and rows[1]["EndTime"] == "2026-11-22T15:45:19"


def test_parse_real_sacct_output():
    rows = SlurmCLI(runner=Recorder(stdout=SACCT_22_05)).sacct(["1"])
    assert [r["JobID"] for r in rows] == ["1", "1.batch"]
    assert rows[0]["JobName"] == "a b|c" and rows[0]["State"] == "COMPLETED"
    assert rows[0]["Timelimit"] == "00:02:00" and rows[0]["ExitCode"] == "0:0"
    assert rows[1]["Partition"] == "" and rows[1]["JobName"] == "batch"


def test_parse_real_sinfo_output_and_aggregate_lines_per_partition():
    (part,) = SlurmCLI(runner=Recorder(stdout=SINFO_22_05)).sinfo_partitions()
    assert part == {"name": "debug", "default": True, "available": "up", "time_limit": "infinite",
                    "nodes": 4, "node_list": "n[1-4]", "node_states": {"idle": 4},
                    "gpus_per_node": 4, "cpus_per_node": 8, "mem_per_node_mb": 4000}
    # the same partition split over node states and GRES, plus a second partition
    two = ("debug\x1fdebug*\x1fup\x1finfinite\x1f1\x1fmixed\x1fn1\x1fgpu:4\x1f64\x1f256000\n"
           "debug\x1fdebug*\x1fup\x1finfinite\x1f3\x1fidle\x1fn[2-4]\x1fgpu:a100:8(S:0-1)\x1f32\x1f512000\n"
           "cpu\x1fcpu\x1fdown\x1f1:00:00\x1f2\x1fdown*\x1fc[01-02]\x1f(null)\x1f2\x1f1000\n")
    parts = {p["name"]: p for p in SlurmCLI(runner=Recorder(stdout=two)).sinfo_partitions()}
    assert parts["debug"]["nodes"] == 4 and parts["debug"]["node_list"] == "n[1-4]"
    assert parts["debug"]["node_states"] == {"mixed": 1, "idle": 3}
    assert parts["debug"]["gpus_per_node"] == 8
    assert (parts["debug"]["cpus_per_node"], parts["debug"]["mem_per_node_mb"]) == (64, 512000)
    assert parts["cpu"] == {"name": "cpu", "default": False, "available": "down",
                            "time_limit": "1:00:00", "nodes": 2, "node_list": "c[01-02]",
                            "node_states": {"down*": 2}, "gpus_per_node": 0,
                            "cpus_per_node": 2, "mem_per_node_mb": 1000}
    # nodes listed by state (busy ones first) read in the partition's own order: one answer
    # whatever the jobs are doing
    busy = ("debug\x1fdebug*\x1fup\x1finfinite\x1f2\x1fallocated\x1fn[3-4]\x1fgpu:4\x1f8\x1f4000\n"
            "debug\x1fdebug*\x1fup\x1finfinite\x1f2\x1fidle\x1fn[1-2,10]\x1fgpu:4\x1f8\x1f4000\n")
    (part,) = SlurmCLI(runner=Recorder(stdout=busy)).sinfo_partitions()
    assert part["node_list"] == "n[1-4,10]"


def test_sinfo_asks_for_exact_sizes_and_an_inexact_one_is_unknown():
    rec = Recorder(stdout="gpu\x1fgpu\x1fup\x1finfinite\x1f2\x1fidle\x1fg[1-2]\x1fgpu:2\x1f16+\x1f64000\n"
                          "gpu\x1fgpu\x1fup\x1finfinite\x1f1\x1fmixed\x1fg3\x1fgpu:2\x1f8\x1fN/A\n")
    (part,) = SlurmCLI(runner=rec).sinfo_partitions()
    assert rec.calls[0]["argv"][:3] == ["sinfo", "--noheader", "--exact"]
    assert rec.calls[0]["argv"][3].endswith("%G\x1f%c\x1f%m")
    # "16+" is a minimum (sinfo without --exact): the largest node could be bigger, so unknown
    assert (part["cpus_per_node"], part["mem_per_node_mb"]) == (0, 0)


# -- Slurm time strings ---------------------------------------------------------------------------


@pytest.mark.parametrize("text, seconds", [
    ("10", 600), ("1:05", 65), ("00:01:05", 65), ("2:00:00", 7200), ("1-0", 86400),
    ("1-2:03", 93780), ("2-03:04:05", 183845), (" 5 ", 300), (7, 420),
    ("UNLIMITED", None), ("INVALID", None), ("Partition_Limit", None), ("", None), (None, None),
    ("1:2:3:4", None), ("-5", None)])
def test_duration_seconds_reads_every_slurm_spelling(text, seconds):
    assert duration_seconds(text) == seconds


def test_one_duration_format_for_every_spelling():
    # squeue (M:SS), sacct (HH:MM:SS) and sacct -c (minutes) spell the same 10 minutes
    assert {normalize_duration(t) for t in ("10:00", "00:10:00", "10")} == {"00:10:00"}
    assert normalize_duration("2-03:04:05") == "2-03:04:05"
    assert normalize_duration("UNLIMITED") == "UNLIMITED"
    assert normalize_duration("") is None and normalize_duration(None) is None
    assert format_duration(59.6) == "00:01:00" and format_duration(-3) == "00:00:00"
    assert format_duration(None) is None


def test_timestamp():
    assert timestamp("Unknown") is None and timestamp("N/A") is None and timestamp("garbage") is None
    assert timestamp("2026-11-22T15:00:01") - timestamp("2026-11-22T15:00:00") == 1.0


def test_a_controller_that_does_not_answer_is_asked_once(monkeypatch):
    """After one command found slurmctld unreachable (each such command retries for ~9 s),
    later commands that need it fail at once; sacct (slurmdbd) is still tried."""
    import subprocess as sp
    calls = []

    def runner(argv, **kw):
        calls.append(argv[0])
        return sp.CompletedProcess(argv, 1, "", "slurm_load_partitions: Unable to contact slurm "
                                                 "controller (connect failure)\n")

    cli = SlurmCLI(runner=runner)
    with pytest.raises(SlurmError, match="Unable to contact"):
        cli.sinfo_partitions()
    with pytest.raises(SlurmError) as exc:
        cli.squeue(["12"])
    assert "not run: the controller did not answer an earlier command" in str(exc.value)
    assert calls == ["sinfo"]
    with pytest.raises(SlurmError):
        cli.sacct(["12"])
    assert calls == ["sinfo", "sacct"]


def test_a_slow_command_is_named_while_it_runs(monkeypatch):
    import subprocess as sp
    import time as _time

    import ddp_hpc.slurm.cli as slurm_cli
    monkeypatch.setattr(slurm_cli, "SLOW_S", 0.05)
    notes = []

    def runner(argv, **kw):
        _time.sleep(0.3)
        return sp.CompletedProcess(argv, 0, "", "")

    SlurmCLI(runner=runner, slow_note=notes.append).squeue(["12"])
    assert len(notes) == 1 and notes[0].startswith("`squeue") and "has not answered for 0.05 s" in notes[0]
    notes.clear()
    SlurmCLI(runner=lambda argv, **kw: sp.CompletedProcess(argv, 0, "", ""),
             slow_note=notes.append).squeue(["12"])
    _time.sleep(0.1)
    assert notes == []
