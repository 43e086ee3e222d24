"""ddp_hpc.launch: real local processes; failures must surface as the first failing rank and
never hang (every multi-process test has a generous pytest timeout instead of a time assert)."""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from loadscale import scaled

from ddp_hpc.judge.nodefiles import rank_events
from ddp_hpc.launch import (
    RankFailedError,
    launch_distributed,
    local_rank_env,
    node_layout,
    run_local,
)

FAST = "forkserver"  # ranks fork from one server that imported torch (tests/conftest.py)

RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
             "MASTER_PORT", "DDP_HPC_LAUNCHER", "DDP_HPC_NUM_NODES", "DDP_HPC_JOB_ID")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_for(paths, timeout=60.0):
    end = time.monotonic() + timeout
    while not all(Path(p).exists() for p in paths):
        assert time.monotonic() < end, f"never appeared: {paths}"
        time.sleep(0.05)


# ----------------------------------------------------------------------------- launch_distributed
def _report_env(rank, world_size, extra):
    from ddp_hpc.env import detect

    env = detect()
    return {k: os.environ[k] for k in RANK_VARS}, env, extra, os.getpid()


@pytest.mark.timeout(120)
def test_rank_variables_and_return_values_default_spawn():
    out = launch_distributed(_report_env, 4, ({"x": [1, 2]},), nodes=2, timeout=90)
    ports = {o[0]["MASTER_PORT"] for o in out}
    jobs = {o[0]["DDP_HPC_JOB_ID"] for o in out}
    assert len(ports) == 1 and len(jobs) == 1 and jobs.pop().startswith("local-")
    assert len({o[3] for o in out}) == 4  # four distinct processes
    for r, (vars_, env, extra, _) in enumerate(out):
        assert extra == {"x": [1, 2]}
        assert (vars_["RANK"], vars_["LOCAL_RANK"], vars_["GROUP_RANK"]) == (str(r), str(r % 2),
                                                                               str(r // 2))
        assert (vars_["WORLD_SIZE"], vars_["LOCAL_WORLD_SIZE"], vars_["DDP_HPC_NUM_NODES"]) == \
               ("4", "2", "2")
        assert vars_["DDP_HPC_LAUNCHER"] == "local" and vars_["MASTER_ADDR"] == "127.0.0.1"
        assert (env.rank, env.local_rank, env.node_rank, env.world_size, env.local_world_size,
                env.num_nodes, env.launcher) == (r, r % 2, r // 2, 4, 2, 2, "local")
        assert env.master_port == int(vars_["MASTER_PORT"])


@pytest.mark.timeout(120)
def test_uneven_pretend_nodes():
    out = launch_distributed(_report_env, 4, (None,), nodes=(3, 1), start_method=FAST,
                             timeout=90)
    assert [(o[1].node_rank, o[1].local_rank, o[1].local_world_size) for o in out] == \
           [(0, 0, 3), (0, 1, 3), (0, 2, 3), (1, 0, 1)]


def _raise_on_2(rank, world_size, pid_dir):
    Path(pid_dir, f"pid{rank}").write_text(str(os.getpid()))
    if rank == 2:
        while len(list(Path(pid_dir).iterdir())) < world_size:  # all pids written first
            time.sleep(0.01)
        raise ValueError(f"bad shard on rank {rank}")
    time.sleep(600)  # the others never finish on their own


@pytest.mark.timeout(60)
def test_rank_2_raises_others_are_killed(tmp_path):
    with pytest.raises(RankFailedError) as e:
        launch_distributed(_raise_on_2, 4, (str(tmp_path),), start_method=FAST)
    err = e.value
    assert (err.rank, err.exc_type, err.message) == (2, "ValueError", "bad shard on rank 2")
    assert "in _raise_on_2" in err.traceback_text and "ValueError: bad shard" in err.traceback_text
    assert str(err).startswith("rank 2 failed: ValueError: bad shard on rank 2")
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(4)]
    assert all(_gone(p) for p in pids)


def _hang_in_collective(rank, world_size):
    import torch
    import torch.distributed as dist

    from ddp_hpc.dist import setup_ddp

    setup_ddp()
    t = torch.ones(1)
    dist.all_reduce(t)  # everyone met once
    if rank == 3:
        raise RuntimeError("rank 3 gives up")
    dist.all_reduce(t)  # blocks forever: rank 3 never joins (the default timeout is 30 min)
    return t.item()


@pytest.mark.timeout(60)
def test_rank_blocked_in_collective_is_killed_when_another_raises():
    with pytest.raises(RankFailedError) as e:
        launch_distributed(_hang_in_collective, 4, start_method=FAST)
    assert (e.value.rank, e.value.exc_type, e.value.message) == (3, "RuntimeError",
                                                                 "rank 3 gives up")


def _first_by_time(rank, world_size, marker):
    if rank == 0:   # fails after rank 3 did, however late rank 3 started (a loaded machine: > 3 s)
        deadline = time.monotonic() + 50
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(2)
        raise KeyError("late rank 0")
    if rank == 3:
        open(marker, "w").close()
        raise ZeroDivisionError("early rank 3")
    time.sleep(600)


@pytest.mark.timeout(60)
def test_first_failure_in_time_wins_over_lower_rank(tmp_path):
    with pytest.raises(RankFailedError) as e:
        launch_distributed(_first_by_time, 4, (str(tmp_path / "rank3-failed"),), start_method=FAST)
    assert (e.value.rank, e.value.exc_type) == (3, "ZeroDivisionError")


def _die(rank, world_size, how):
    if rank == 1:
        if how == "exit":
            os._exit(7)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how, exc_type, exitcode, words", [
    ("exit", "ProcessExited", 7, "exited with code 7 without a Python exception"),
    ("kill", "ProcessKilled", -9, "killed by SIGKILL"),
])
def test_rank_dying_without_exception(how, exc_type, exitcode, words):
    with pytest.raises(RankFailedError) as e:
        launch_distributed(_die, 3, (how,), start_method=FAST)
    assert (e.value.rank, e.value.exc_type, e.value.exitcode) == (1, exc_type, exitcode)
    assert words in str(e.value)


def _sys_exit(rank, world_size, code):
    sys.exit(code if rank == 1 else 0)


@pytest.mark.timeout(60)
def test_sys_exit():
    assert launch_distributed(_sys_exit, 2, (0,), start_method=FAST) == [None, None]
    with pytest.raises(RankFailedError) as e:
        launch_distributed(_sys_exit, 2, (4,), start_method=FAST)
    assert (e.value.rank, e.value.exc_type, e.value.message) == (1, "SystemExit", "exit code 4")


def _tensor(rank, world_size):
    import torch

    return {"rank": rank, "weights": torch.full((1000,), float(rank))}


@pytest.mark.timeout(60)
def test_tensor_results_arrive_by_value():
    # shared-memory tensors of an exiting process arrive (not a failure "exited with code 0")
    out = launch_distributed(_tensor, 2, start_method=FAST)
    assert [o["rank"] for o in out] == [0, 1] and float(out[1]["weights"].sum()) == 1000.0


def _unpicklable(rank, world_size):
    return lambda: rank


@pytest.mark.timeout(60)
def test_unpicklable_result_is_a_rank_failure():
    with pytest.raises(RankFailedError) as e:
        launch_distributed(_unpicklable, 2, start_method=FAST)
    assert "could not send rank" in e.value.message


def _return_but_never_exit(rank, world_size, pid_dir):
    import threading

    Path(pid_dir, f"pid{rank}").write_text(str(os.getpid()))
    threading.Thread(target=time.sleep, args=(600,)).start()  # non-daemon: blocks the exit
    return rank * 10


@pytest.mark.timeout(60)
def test_rank_that_returned_but_cannot_exit_is_reaped(tmp_path, monkeypatch):
    import ddp_hpc.launch.spawn

    monkeypatch.setattr(ddp_hpc.launch.spawn, "EXIT_GRACE_S", 1.0)
    assert launch_distributed(_return_but_never_exit, 2, (str(tmp_path),),
                              start_method=FAST) == [0, 10]
    assert all(_gone(int((tmp_path / f"pid{r}").read_text())) for r in range(2))


def _sleep(rank, world_size):
    time.sleep(600)


@pytest.mark.timeout(60)
def test_timeout_names_unfinished_ranks():
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] still running after timeout=1"):
        launch_distributed(_sleep, 2, start_method=FAST, timeout=1)


def test_unpicklable_function_is_refused_with_a_hint():
    def nested(rank, world_size):
        return rank

    with pytest.raises(TypeError, match="cannot send fn=") as e:
        launch_distributed(nested, 2)
    assert "HINT: use a function defined at module level" in str(e.value)


def _write_pid_and_sleep(rank, world_size, pid_dir):
    tmp = Path(pid_dir, f".pid{rank}")
    tmp.write_text(str(os.getpid()))
    tmp.rename(Path(pid_dir, f"pid{rank}"))   # whole when it appears: the test reads it at once
    time.sleep(600)


LAUNCHER = ("import sys; sys.path.insert(0, sys.argv[1]); import test_launch\n"
            "from ddp_hpc.launch import launch_distributed\n"
            "launch_distributed(test_launch._write_pid_and_sleep, 2, (sys.argv[2],), "
            "start_method=sys.argv[3])\n")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_ranks_end_when_the_launcher_is_killed(tmp_path, method):
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(Path(__file__).parent),
                             str(tmp_path), method])
    try:
        _wait_for([tmp_path / "pid0", tmp_path / "pid1"], timeout=90)
    finally:
        proc.kill()
        proc.wait()
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    end = time.monotonic() + 60  # no orphan may stay behind (they would sleep 600 s)
    while not all(_gone(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.1)
    left = [p for p in pids if not _gone(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"ranks {left} outlived their launcher"


def test_rank_failed_error_pickles():
    err = RankFailedError(2, "ValueError", "boom", "Traceback...", None)
    back = pickle.loads(pickle.dumps(err))
    assert (back.rank, back.exc_type, back.message, back.traceback_text) == \
           (2, "ValueError", "boom", "Traceback...")


@pytest.mark.parametrize("world, nodes, words", [
    (5, 2, "world_size=5 does not split evenly over nodes=2"),
    (4, (3, 2), "nodes=(3, 2) must be positive per-node counts summing to world_size=4"),
    (4, (4, 0), "must be positive"),
])
def test_node_layout_errors(world, nodes, words):
    with pytest.raises(ValueError, match=r"HINT: ") as e:
        node_layout(world, nodes)
    assert words in str(e.value)


def test_local_rank_env_layout():
    envs = local_rank_env([2, 1], 29999, "j1")
    assert [(e["RANK"], e["LOCAL_RANK"], e["GROUP_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs] \
        == [("0", "0", "0", "2"), ("1", "1", "0", "2"), ("2", "0", "1", "1")]
    assert {(e["WORLD_SIZE"], e["DDP_HPC_NUM_NODES"], e["MASTER_PORT"], e["DDP_HPC_JOB_ID"])
            for e in envs} == {("3", "2", "29999", "j1")}


# ----------------------------------------------------------------------------- run_local and CLI
PRINT_ENV = ("import os; print(' '.join(f'{k}={os.environ[k]}' for k in "
             "('RANK','LOCAL_RANK','GROUP_RANK','WORLD_SIZE','DDP_HPC_JOB_ID')))")


@pytest.mark.timeout(60)
def test_run_local_success_writes_per_rank_logs_and_appends(tmp_path):
    (tmp_path / "rank0.out").write_text("earlier run\n")
    res = run_local([sys.executable, "-c", PRINT_ENV], nodes=2, procs_per_node=2,
                    log_dir=tmp_path, job_id="j42", poll=0.05)
    assert res.ok and res.returncodes == [0, 0, 0, 0] and res.first_failed_rank is None
    assert res.exitcode == 0 and res.job_id == "j42" and len(res.pids) == 4
    assert (tmp_path / "rank0.out").read_text() == \
        "earlier run\nRANK=0 LOCAL_RANK=0 GROUP_RANK=0 WORLD_SIZE=4 DDP_HPC_JOB_ID=j42\n"
    assert (tmp_path / "rank3.out").read_text() == \
        "RANK=3 LOCAL_RANK=1 GROUP_RANK=1 WORLD_SIZE=4 DDP_HPC_JOB_ID=j42\n"


FAIL_RANK_1 = ("import os, sys, time\n"
               "open(os.path.join(sys.argv[1], 'pid' + os.environ['RANK']), 'w')"
               ".write(str(os.getpid()))\n"
               "if os.environ['RANK'] == '1':\n"
               "    print('rank 1 is broken', file=sys.stderr); sys.exit(3)\n"
               "time.sleep(600)\n")


@pytest.mark.timeout(60)
def test_run_local_failing_rank_kills_the_rest(tmp_path):
    logs = tmp_path / "logs"
    res = run_local([sys.executable, "-c", FAIL_RANK_1, str(tmp_path)], nodes=1,
                    procs_per_node=3, log_dir=logs, poll=0.05)
    assert res.first_failed_rank == 1 and res.returncodes[1] == 3 and res.exitcode == 3
    assert res.returncodes[0] == res.returncodes[2] == -signal.SIGTERM
    assert not res.ok
    assert "rank 1 is broken" in (logs / "rank1.out").read_text()
    assert all(_gone(p) for p in res.pids)


def test_run_local_refuses_empty_command(tmp_path):
    with pytest.raises(ValueError, match="empty command"):
        run_local([], nodes=1, procs_per_node=1, log_dir=tmp_path)


def _cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "ddp_hpc.launch", *args], capture_output=True,
                          text=True, timeout=scaled(120), **kw)


@pytest.mark.timeout(120)
def test_cli_command_failure_exit_code_names_rank(tmp_path):
    p = _cli("--nodes", "1", "--procs-per-node", "3", "--log-dir", str(tmp_path / "l"), "--",
             sys.executable, "-c", FAIL_RANK_1, str(tmp_path))
    assert p.returncode == 3, p.stderr
    assert f"FAILED: rank 1 exited with 3; see {tmp_path}/l/rank1.out\n" \
           f"logs: {tmp_path}/l/rank0.out ... rank2.out\n" in p.stderr


# rank 0 waits for the test to touch `go`: its first lines must reach the terminal while it runs
TALK = ("import os, sys, time\n"
        "r, t0 = os.environ['RANK'], time.monotonic()\n"
        "print(f'rank {r} says hello'); print(f'rank {r} to stderr', file=sys.stderr)\n"
        "while r == '0' and not os.path.exists(sys.argv[1]) and time.monotonic() - t0 < 300:\n"
        "    time.sleep(0.05)\n"
        "print(f'rank {r} done')\n")


@pytest.mark.timeout(120)
def test_cli_shows_rank_0_as_it_runs_and_where_every_rank_logs(tmp_path):
    """As torchrun with --local-ranks-filter 0: rank 0's output on the terminal while it runs,
    the others' only in their files; at the end, where the files are."""
    logs, go = tmp_path / "l", tmp_path / "go"
    logs.mkdir()
    (logs / "rank0.out").write_text("an earlier run\n")  # appended to, but not shown again
    proc = subprocess.Popen([sys.executable, "-m", "ddp_hpc.launch", "--nodes", "2",
                             "--procs-per-node", "1", "--log-dir", str(logs), "--",
                             sys.executable, "-c", TALK, str(go)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = [proc.stdout.readline()]
        while not lines[-1].startswith("rank 0's output follows"):  # after the (multi-line) command
            assert lines[-1], f"the launcher ended early: {lines} {proc.stderr.read()}"
            lines.append(proc.stdout.readline())
        assert lines[0].startswith("ddp_hpc launch: 2 ranks (2 pretend nodes x 1) of ")
        assert lines[-1] == f"rank 0's output follows; every rank's goes to {logs}/rankR.out\n"
        lines += [proc.stdout.readline(), proc.stdout.readline()]  # rank 0 waits for `go`: it runs
        assert sorted(lines[-2:]) == ["rank 0 says hello\n", "rank 0 to stderr\n"]
    finally:
        go.touch()            # rank 0 ends whatever happened above: no process outlives the test
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out == f"rank 0 done\nOK: all 2 ranks exited 0\nlogs: {logs}/rank0.out ... rank1.out\n"
    assert "rank 1" not in "".join(lines) + out + err
    assert (logs / "rank0.out").read_text().startswith("an earlier run\nrank 0 ")
    assert sorted((logs / "rank1.out").read_text().splitlines()) == \
        ["rank 1 done", "rank 1 says hello", "rank 1 to stderr"]


@pytest.mark.timeout(60)
def test_cli_one_rank_and_a_missing_program(tmp_path):
    p = _cli("--nodes", "1", "--procs-per-node", "1", "--log-dir", str(tmp_path), "--",
             sys.executable, "-c", "print('alone')")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("ddp_hpc launch: 1 rank (1 pretend node x 1) of ")  # no "1 ranks"
    assert p.stdout.splitlines()[2:] == ["alone", "OK: rank 0 exited 0", f"logs: {tmp_path}/rank0.out"]
    p = _cli("--nodes", "1", "--procs-per-node", "1", "--log-dir", str(tmp_path), "--",
             str(tmp_path / "no-such-program"))
    assert p.returncode == 2
    assert f"error: cannot start '{tmp_path}/no-such-program': No such file or directory\n" \
           "HINT: " in p.stderr


TRAP = ("import os, signal, sys, time\n"
        "def stop(sig, _):\n"
        "    open(os.path.join(sys.argv[1], 'got' + os.environ['RANK']), 'w')"
        ".write(signal.Signals(sig).name)\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGINT, stop); signal.signal(signal.SIGTERM, stop)\n"
        "pid = os.path.join(sys.argv[1], 'pid' + os.environ['RANK'])\n"
        "open(pid + '.tmp', 'w').write(str(os.getpid()))\n"
        "os.replace(pid + '.tmp', pid)  # whole, never seen empty\n"
        "time.sleep(600)\n")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cli_forwards_signals_to_the_ranks(tmp_path, sig):
    proc = subprocess.Popen([sys.executable, "-m", "ddp_hpc.launch", "--nodes", "1",
                             "--procs-per-node", "2", "--log-dir", str(tmp_path / "l"), "--",
                             sys.executable, "-c", TRAP, str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for([tmp_path / "pid0", tmp_path / "pid1"])
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert f"interrupted by {sig.name}" in err
    # each rank saw the forwarded signal itself (not a SIGKILL) and could clean up
    assert [(tmp_path / f"got{r}").read_text() for r in range(2)] == [sig.name] * 2
    assert all(_gone(p) for p in pids)


@pytest.mark.timeout(120)
def test_cli_bad_arguments():
    p = _cli("--nodes", "0")
    assert p.returncode == 2 and "--nodes=0 must be >= 1" in p.stderr
    p = _cli("--nodes", "1", "python", "train.py")
    assert p.returncode == 2
    assert "error: unrecognized arguments: python train.py\nHINT: put the command after `--`, e.g. " \
        "python -m ddp_hpc.launch --nodes 1 --procs-per-node 2 -- python train.py" in p.stderr
    p = _cli("--job-id", "../../etc", "--", "true")
    assert p.returncode == 2 and "--job-id='../../etc' may use only letters" in p.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cli_without_a_command_runs_the_ddp_demo():
    """The demo (no command after --) on 2 pretend nodes of one rank: every rank's steps with its
    node, and the ranks' agreement (2 ranks on a pretend node: launch_distributed's tests above)."""
    p = _cli("--nodes", "2", "--procs-per-node", "1")
    assert p.returncode == 0, p.stderr
    for r in range(2):
        assert f"[rank {r}/2 node {r}] step 4 loss" in p.stdout
    assert p.stdout.rstrip().splitlines()[-1] == \
        "OK: 2 ranks agreed on all_reduce and on the DDP parameters"


@pytest.mark.timeout(180)
def test_cli_puts_the_run_logs_beside_every_ranks_output(tmp_path):
    """`ddp-hpc launch -- python -m ddp_hpc.run CONFIG`: rankR.out and the run's own logs
    (rankR.log, nodeK.events.jsonl) in the one --log-dir, not the config's log.dir."""
    logs = tmp_path / "launch-logs"
    demo = Path(__file__).resolve().parents[1] / "jobs" / "demo.yaml"
    p = _cli("--nodes", "1", "--procs-per-node", "2", "--log-dir", str(logs), "--", sys.executable, "-m",
             "ddp_hpc.run", str(demo), f"log.dir={tmp_path / 'config-logs'}", "data.kwargs.size=256",
             "train.epochs=1", f"checkpoint.dir={tmp_path / 'ckpt'}", "log.progress=off")
    assert p.returncode == 0, p.stdout + p.stderr
    for r in (0, 1):
        assert {f"rank{r}.out", f"rank{r}.log", "node0.events.jsonl"} <= {f.name for f in logs.iterdir()}
        assert rank_events(logs, r).events[-1]["event"] == "end"
    assert not (tmp_path / "config-logs").exists()


#: rank 0 raises when rank 1's failure stops it (SIGTERM, as a gloo error reaches a real one);
#: with `own`, rank 0 fails first itself
VICTIM = ("import os, signal, sys, time\n"
          "def stopped(*_):\n"
          "    raise RuntimeError('rank 0 only lost its peer')\n"
          "signal.signal(signal.SIGTERM, stopped)\n"
          "rank, own = os.environ['RANK'], sys.argv[1] == 'own'\n"
          "if rank == '0' and own:\n"
          "    raise ValueError('rank 0 itself broke')\n"
          "if rank == '1' and not own:\n"
          "    time.sleep(0.5); raise ValueError('rank 1 broke')\n"
          "time.sleep(60)\n")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("who", ["own", "peer"])
def test_rank_0s_traceback_is_shown_when_it_failed_first_and_left_in_its_file_when_a_peer_did(tmp_path, who):
    p = _cli("--nodes", "1", "--procs-per-node", "2", "--log-dir", str(tmp_path / "l"), "--",
             sys.executable, "-c", VICTIM, who)
    assert p.returncode == 1, p.stdout + p.stderr
    rank0 = (tmp_path / "l" / "rank0.out").read_text()
    if who == "own":
        assert "ValueError: rank 0 itself broke" in p.stdout and "Traceback" in p.stdout
        assert "FAILED: rank 0 exited with 1" in p.stderr
    else:
        lost = "RuntimeError: rank 0 only lost its peer"
        assert lost in rank0                                   # it raised, in its file ...
        assert lost not in p.stdout and "Traceback" not in p.stdout       # ... not on the console
        assert "[ddp_hpc: rank 0's traceback (" in p.stdout and "rank0.out]" in p.stdout
        assert "FAILED: rank 1 exited with 1" in p.stderr


def test_rank_0s_traceback_of_a_lost_peer_stays_in_its_file_whoever_exited_first(tmp_path):
    """Rank 0's uncaught gloo error ("Connection closed by peer") is a consequence, even where the
    driver saw rank 0 exit first or rank 0 took longer than the hold to exit (a loaded machine: the
    culprit's wrapper still writing its end): the console gets the line saying where it is; a
    traceback rank 0 caught and went on from (no torch prefix) is still shown once the hold
    passed, even one in a lost peer's words."""
    import io as stdio

    from ddp_hpc.launch.local import HOLD_S, _Echo
    lost = ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"boom.py\", line 14, in <module>\n"
            "[rank0]: RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer "
            "[127.0.0.1]:6061.\n")
    caught = "Traceback (most recent call last):\n  File \"t.py\", line 8\nValueError: on purpose\n"
    caught_pipe = "Traceback (most recent call last):\n  File \"t.py\", line 9\nBrokenPipeError: Broken pipe\n"
    for text, shown in ((lost, False), (caught, True), (caught_pipe, True)):
        path = tmp_path / "rank0.out"
        path.write_text("step 100\n")
        alive = subprocess.Popen(["sleep", str(HOLD_S + 3)])     # rank 0's process, slow to exit
        out = stdio.StringIO()
        echo = _Echo(path, 0, out, alive, poll=0.05)
        echo.start()
        with open(path, "a") as f:
            f.write(text)
        time.sleep(HOLD_S + 1.5)          # past the hold, rank 0 still running, no failure seen
        echo.stopped.set()                # the run ended; the driver saw no other rank fail first
        echo.join()
        alive.kill()
        alive.wait()
        console = out.getvalue()
        assert console.startswith("step 100\n")
        assert (text in console) is shown, console
        assert ("[ddp_hpc: rank 0's traceback (" in console and "rank0.out]" in console) is not shown, console
