"""Node-local staging: racing copiers copy once, a killed copy is never used, too little space
fails cleanly, a requeue reuses the copy, waiters see the copier's failure."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_hpc.data import fsio
from ddp_hpc.data.stage import StageError, cleanup_staged, resolve_stage_dir, stage
from ddp_hpc.judge.nodefiles import log_events, rank_events

FAST = "forkserver"  # ranks fork from one server that imported torch (tests/conftest.py)


def _big_file(path, mib):
    with open(path, "wb") as f:
        for _i in range(mib):
            f.write(os.urandom(1 << 16) * 16)
    return str(path)


def _race(src, dest, barrier, q):
    fsio.watch(os.path.dirname(src))
    barrier.wait()
    path = stage(src, dest, job_id="race")
    q.put((path, fsio.snapshot()["opens"]))


def test_racing_copiers_copy_once_and_agree(tmp_path):
    src = _big_file(tmp_path / "shared.bin", 64)
    dest = tmp_path / "local"
    dest.mkdir()
    ctx = mp.get_context("fork")
    barrier, q = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(src, str(dest), barrier, q)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert got[0][0] == got[1][0]
    assert sorted(opens for _, opens in got) == [0, 1]  # exactly one process read the shared file
    assert open(got[0][0], "rb").read() == open(src, "rb").read()


def test_waiter_polls_until_copier_is_done(tmp_path):
    src = _big_file(tmp_path / "shared.bin", 16)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    waiter = ctx.Process(target=lambda: q.put(stage(src, str(tmp_path), job_id="w", copier=False, poll_s=0.05)))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive()  # nothing to use yet
    path = stage(src, str(tmp_path), job_id="w")
    assert q.get(timeout=30) == path
    waiter.join(10)


KILLED_CHILD = r"""
import sys, time
from ddp_hpc.data import copy as C, stage as S
C.CHUNK = C.KERNEL_CHUNK = 1 << 16
orig = C.CopyProgress.__call__
def slow(self, n):
    time.sleep(0.01)
    orig(self, n)
C.CopyProgress.__call__ = slow
S.stage(sys.argv[1], sys.argv[2], job_id="killed")
"""


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_copy_killed_half_way_is_never_used(tmp_path, kind):
    if kind == "file":
        src = _big_file(tmp_path / "shared.bin", 8)
    else:
        src = tmp_path / "tree"
        for i in range(40):
            (src / f"c{i % 4}").mkdir(parents=True, exist_ok=True)
            (src / f"c{i % 4}" / f"f{i}").write_bytes(os.urandom(100_000))
        src = str(src)
    dest = tmp_path / "local"
    dest.mkdir()
    child = subprocess.Popen([sys.executable, "-c", KILLED_CHILD, src, str(dest)])
    deadline = time.monotonic() + 60
    partial = None
    while partial is None and time.monotonic() < deadline:
        for dirpath, dirnames, names in os.walk(dest):
            tmps = [n for n in dirnames + names if n.startswith(".tmp-")]
            if tmps:
                partial = os.path.join(dirpath, tmps[0])
        time.sleep(0.02)
    assert partial is not None, "the copy never started"
    time.sleep(0.2)
    child.kill()
    child.wait()
    folder = os.path.dirname(partial)
    assert not os.path.exists(os.path.join(folder, "COMPLETE.json"))
    assert not os.path.exists(os.path.join(folder, os.path.basename(src)))
    with pytest.raises(StageError, match="waited"):  # a waiter never takes the partial copy
        stage(src, str(dest), job_id="killed", copier=False, wait_timeout=0.3, poll_s=0.05)
    path = stage(src, str(dest), job_id="killed")  # the next copier cleans up and copies afresh
    assert not os.path.exists(partial)
    if kind == "file":
        assert open(path, "rb").read() == open(src, "rb").read()
    else:
        for dirpath, _, names in os.walk(src):
            for n in names:
                rel = os.path.relpath(os.path.join(dirpath, n), src)
                assert open(os.path.join(path, rel), "rb").read() == open(os.path.join(src, rel), "rb").read()


def test_too_little_space_fails_cleanly(tmp_path):
    src = tmp_path / "huge.bin"
    with open(src, "wb") as f:  # sparse: claims far more than any disk here has free
        f.truncate(1 << 43)
    dest = tmp_path / "local"
    dest.mkdir()
    with pytest.raises(StageError, match=r"needs 8796093022208 bytes.*free\nHINT: set data.stage_to"):
        stage(str(src), str(dest))
    leftovers = [n for _, d, f in os.walk(dest) for n in d + f if n.startswith(".tmp-") or n == "COMPLETE.json"]
    assert leftovers == []
    # a waiter on another local rank learns why instead of waiting out its timeout
    with pytest.raises(StageError, match="copier on this node failed.*needs.*free\nHINT: set data.stage_to"):
        stage(str(src), str(dest), copier=False, wait_timeout=30)


def test_requeue_reuses_the_staged_copy_and_a_new_job_copies(tmp_path):
    src = tmp_path / "shared" / "data.lmdb"
    src.mkdir(parents=True)
    _big_file(src / "data.mdb", 2)
    dest = tmp_path / "local"
    dest.mkdir()
    fsio.watch(tmp_path / "shared")
    try:
        first = stage(str(src), str(dest), job_id="123", restart_count=0)
        assert fsio.snapshot()["opens"] == 1
        again = stage(str(src), str(dest), job_id="123", restart_count=1)  # the requeued job
        assert again == first and fsio.snapshot()["opens"] == 1
        other = stage(str(src), str(dest), job_id="124")
        assert other != first and fsio.snapshot()["opens"] == 2
    finally:
        fsio.unwatch()
    assert os.listdir(first) == ["data.mdb"]  # an LMDB is staged without its lock file
    marker = json.load(open(os.path.join(os.path.dirname(first), "COMPLETE.json")))
    assert marker["kind"] == "lmdb" and marker["bytes"] == 2 << 20 and marker["attempt"] == "123:0"
    # a damaged staged copy is not reused
    with open(os.path.join(first, "data.mdb"), "r+b") as f:
        f.seek(1000)
        f.write(b"XXXX")
    fsio.watch(tmp_path / "shared")
    try:
        fsio.reset()
        assert stage(str(src), str(dest), job_id="123", restart_count=2) == first
        assert fsio.snapshot()["opens"] == 1
    finally:
        fsio.unwatch()
    cleanup_staged(first)
    assert not os.path.exists(os.path.dirname(first))


def test_resolve_stage_dir():
    assert resolve_stage_dir("auto", {"SLURM_TMPDIR": "/a", "TMPDIR": "/b"}) == "/a"
    assert resolve_stage_dir("auto", {"TMPDIR": "/b"}) == "/b"
    assert resolve_stage_dir("tmpdir", {"SLURM_TMPDIR": "/a", "TMPDIR": "/b"}) == "/b"
    assert resolve_stage_dir("shm", {}) == "/dev/shm"
    assert resolve_stage_dir("/scratch/x", {}) == "/scratch/x"
    with pytest.raises(StageError, match="SLURM_TMPDIR is not set"):
        resolve_stage_dir("slurm_tmpdir", {})
    with pytest.raises(StageError, match="'relative' is not"):
        resolve_stage_dir("relative", {})


def test_cli_stage_prints_the_local_path(tmp_path, capsys):
    from ddp_hpc.data.cli import main as cli

    src = _big_file(tmp_path / "shared.bin", 1)
    dest = tmp_path / "local"
    dest.mkdir()
    assert cli(["stage", src, "--to", str(dest), "--json"]) == 0
    path = json.loads(capsys.readouterr().out)["path"]
    assert path.startswith(str(dest) + "/") and open(path, "rb").read() == open(src, "rb").read()
    assert cli(["stage", src, "--to", "relative/dir"]) == 2
    err = capsys.readouterr().err
    assert "data: error: data.stage_to='relative/dir' is not auto" in err and "\nHINT: set data.stage_to=auto" in err


@pytest.mark.parametrize("mib", [1, 40])  # one chunk; several in-kernel chunks with the hash trailing
def test_a_copy_damaged_while_written_is_refused(tmp_path, monkeypatch, mib):
    """A disk that returns other bytes than were written (simulated: a byte of the copy flipped
    right after each in-kernel chunk) fails the hash comparison: no marker, the error names it."""
    import ddp_hpc.data.copy as C

    src = _big_file(tmp_path / "shared.bin", mib)
    dest = tmp_path / "local"
    dest.mkdir()
    real = C._kernel_copy_chunk

    def faulty(sfd, dfd, off, count, mode):
        k = real(sfd, dfd, off, count, mode)
        byte = os.pread(dfd, 1, off + k - 1)
        os.pwrite(dfd, bytes([byte[0] ^ 0xFF]), off + k - 1)
        return k

    monkeypatch.setattr(C, "_kernel_copy_chunk", faulty)
    with pytest.raises(StageError, match=r"hash .* source .* hash \w+\nHINT: the node-local disk"):
        stage(src, str(dest), job_id="bad")
    folder = next(p for p in dest.iterdir() if p.is_dir())
    assert not (folder / "COMPLETE.json").exists()
    assert json.load(open(folder / "FAILED.json"))["attempt"] == "bad:0"
    monkeypatch.setattr(C, "_kernel_copy_chunk", real)  # the disk is healthy again: a retry succeeds
    good = stage(src, str(dest), job_id="bad", restart_count=1)
    assert open(good, "rb").read() == open(src, "rb").read()


def test_sbcast_refuses_outside_an_allocation(tmp_path):
    from ddp_hpc.data.sbcast import sbcast_stage
    from ddp_hpc.slurm.cli import SlurmCLI

    f = tmp_path / "a.bin"
    f.write_bytes(b"x" * 100)
    with pytest.raises(StageError, match="SLURM_JOB_ID is not set\nHINT: run"):
        sbcast_stage(f, str(tmp_path), environ={})
    (tmp_path / "folder").mkdir()
    with pytest.raises(StageError, match="SLURM_JOB_ID is not set"):
        sbcast_stage(tmp_path / "folder", str(tmp_path), environ={})
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run([sys.executable, "-m", "ddp_hpc.data", "sbcast", str(f), "--to", str(tmp_path)],
                          env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "SLURM_JOB_ID is not set" in done.stderr
    for bad in ("-rf", "", "a\nb"):
        with pytest.raises(ValueError, match="not a usable path"):
            SlurmCLI().sbcast(bad, "/tmp/x")


# ----------------------------------------------------------------------------- shared stage folders
def _small_lmdb(tmp_path):
    from ddp_hpc.data.pack import pack
    from ddp_hpc.examples.images import make_images

    imgs = make_images(tmp_path / "shared" / "imgs", count=24, classes=3, size=8, progress=False)
    pack(imgs, tmp_path / "shared" / "imgs.lmdb", progress=False)
    return str(tmp_path / "shared" / "imgs.lmdb")


def _shared_tmp_rank(rank, world_size, shared, tmp, logs):
    """One rank of a 2-pretend-node job whose nodes share one TMPDIR (one stage folder)."""
    import logging

    from ddp_hpc.config import DataConfig
    from ddp_hpc.data.io import close_train_data, open_train_data, take_stage_log
    from ddp_hpc.dist import cleanup_ddp, setup_ddp

    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("ddp_hpc").addHandler(handler)
    ctx = setup_ddp()
    os.environ["TMPDIR"] = tmp  # the same folder on both pretend nodes
    if ctx.env.node_rank == 0:  # node 0 knows its log directory at staging time, node 1 does not
        os.environ["DDP_HPC_LOG_DIR"] = logs
    fsio.watch(shared)
    cfg = DataConfig(io="stage", lmdb_path=os.path.join(shared, "imgs.lmdb"), stage_to="tmpdir", stage_cleanup=True)
    ds = open_train_data(cfg, ctx, list)
    opens = fsio.snapshot()["opens"]
    sample = ds[len(ds) - 1][1]
    pending = take_stage_log(ds)
    close_train_data(ds, cfg, ctx, completed=True)
    cleanup_ddp()
    return {"rank": rank, "node": ctx.env.node_rank, "opens": opens, "n": len(ds), "label": int(sample),
            "pending": pending, "warnings": warnings}


def test_two_node_leaders_sharing_a_stage_folder_copy_once_and_clean_up_once(tmp_path):
    """2 pretend nodes (one TMPDIR) must not end with 'stage cleanup ... failed: [Errno 2] ...
    .lock': one leader copies, the other reuses, the last one out removes the copy and
    its lock, nobody warns; each leader logs its staging (run log, or take_stage_log)."""
    from ddp_hpc.launch import launch_distributed

    src = _small_lmdb(tmp_path)
    tmp, logs = tmp_path / "tmp", tmp_path / "logs"
    tmp.mkdir()
    out = launch_distributed(_shared_tmp_rank, 4, args=(os.path.dirname(src), str(tmp), str(logs)),
                             nodes=2, timeout=240, start_method=FAST)
    assert sum(r["opens"] for r in out) == 1  # one copier for both nodes
    assert {r["n"] for r in out} == {24} and all(r["warnings"] == [] for r in out)
    assert os.listdir(tmp) == []  # the copy, its users file and its lock are gone
    events = rank_events(logs, 0).events
    (ev0,) = [e for e in events if e["event"] == "stage"]
    [(line2, ev2)] = out[2]["pending"]  # node 1 had no log directory: handed to the training core
    assert all(r["pending"] == [] for r in out if r["rank"] != 2)
    assert sorted([ev0["method"], ev2["method"]]) == ["copy", "reused"]
    assert ev0["path"] == ev2["path"] and ev0["bytes"] == ev2["bytes"] == os.path.getsize(os.path.join(src, "data.mdb"))
    assert {ev0["node"], ev2["node"]} == {f"node0@{os.uname().nodename}", f"node1@{os.uname().nodename}"}
    copy = ev0 if ev0["method"] == "copy" else ev2
    assert copy["mb_per_s"] > 0 and copy["seconds"] >= copy["copy_seconds"] > 0, (ev0, ev2)
    text = open(logs / "rank0.log").read()
    assert f"stage: {'copied' if ev0 is copy else 'reused the copy of'} {src} -> {ev0['path']}" in text
    assert "stage cleanup: " in text and "WARNING" not in text
    assert line2.startswith("stage: ") and ev2["path"] in line2
    assert 1 not in log_events(logs)  # only node leaders log the stage


def _leader(src, dest, user, barrier, q):
    from ddp_hpc.data.stage import StageRequest, stage_result

    fsio.watch(os.path.dirname(src))
    barrier.wait()
    res = stage_result(StageRequest(src, dest, job_id="share", user=user))
    barrier.wait()  # every leader staged (close_train_data's barrier)
    q.put((user, res.method, fsio.snapshot()["opens"], cleanup_staged(res.path, user), res.path))


def test_racing_node_leaders_on_one_folder_the_last_one_out_removes_it(tmp_path):
    src = _big_file(tmp_path / "shared.bin", 8)
    dest = tmp_path / "local"
    dest.mkdir()
    ctx = mp.get_context("fork")
    barrier, q = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_leader, args=(src, str(dest), f"node{i}", barrier, q)) for i in range(3)]
    for p in procs:
        p.start()
    got = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert sorted(m for _, m, _, _, _ in got) == ["copy", "reused", "reused"]
    assert sum(opens for _, _, opens, _, _ in got) == 1
    outcomes = sorted(o for _, _, _, (o, _), _ in got)
    assert outcomes == ["kept", "kept", "removed"]
    assert os.listdir(dest) == []
    assert cleanup_staged(got[0][4], "node0") == ("gone", [])  # late and repeated calls are no error
    assert os.listdir(dest) == []


def test_a_lock_file_deleted_under_a_waiter_is_locked_afresh(tmp_path):
    """The remover deletes the lock file while holding it; a process that waited on the deleted
    file must not think it holds the lock: it locks the file now at the path."""
    from ddp_hpc.data.stagefolder import folder_lock

    folder = str(tmp_path / "ddp_hpc-stage-x")
    ctx = mp.get_context("fork")
    q, go = ctx.Queue(), ctx.Event()

    def waiter():
        go.wait()
        with folder_lock(folder):  # held on a deleted file, the path would not exist now
            q.put(os.path.getsize(folder + ".lock") if os.path.exists(folder + ".lock") else None)

    child = ctx.Process(target=waiter)  # forked first: it must not inherit our locked file
    child.start()
    with folder_lock(folder):
        with open(folder + ".lock", "w") as f:
            f.write("old")  # tells the old file from the new one (inode numbers get reused)
        go.set()
        time.sleep(0.5)  # the child opened the old file and waits in flock
        os.remove(folder + ".lock")
    assert q.get(timeout=30) == 0  # it locked a new, empty file at the path
    child.join(10)
    assert child.exitcode == 0


def test_a_cleanup_that_really_fails_says_what_is_left_and_what_to_do(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import ddp_hpc.data.stagefolder as F
    from ddp_hpc.config import DataConfig
    from ddp_hpc.data.io import close_train_data, open_train_data, take_stage_log

    src = _small_lmdb(tmp_path)
    size = os.path.getsize(os.path.join(src, "data.mdb"))
    logs = tmp_path / "logs"
    env = SimpleNamespace(rank=0, local_rank=0, local_world_size=1, node_rank=0, job_id="j9", restart_count=0)
    cfg = DataConfig(io="stage", lmdb_path=src, stage_to=str(tmp_path), stage_cleanup=True)
    monkeypatch.delenv("DDP_HPC_LOG_DIR", raising=False)
    ds = open_train_data(cfg, SimpleNamespace(env=env), list)
    [(line, fields)] = take_stage_log(ds)  # no log directory yet: the training core writes them
    assert fields["method"] == "copy" and fields["bytes"] == size and line.startswith(f"stage: copied {src} -> ")
    assert take_stage_log(ds) == []

    def refuse(path, *a, **k):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(F.shutil, "rmtree", refuse)
    with pytest.raises(StageError, match=r"could not remove .*ddp_hpc-stage-j9-\S+ \(2\d{4} bytes left\): .*"
                                         r"Permission denied.*\nHINT: remove it by hand \(rm -rf "):
        cleanup_staged(fields["path"])
    monkeypatch.setenv("DDP_HPC_LOG_DIR", str(logs))
    close_train_data(ds, cfg, SimpleNamespace(env=env), completed=True)
    text = open(logs / "rank0.log").read()
    assert "WARNING: stage cleanup of " in text and "could not remove" in text and "HINT: remove it by hand" in text
    monkeypatch.undo()
    assert cleanup_staged(fields["path"], "node0@x") == ("kept", [fields["node"]])  # not a user: nothing removed
    assert cleanup_staged(fields["path"], fields["node"]) == ("removed", [])  # the failed leader, again
    assert [n for n in os.listdir(tmp_path) if n.startswith("ddp_hpc-stage-")] == []


def test_stage_result_names_copy_sbcast_and_reuse_and_waiters_wait_for_their_leader(tmp_path):
    from ddp_hpc.data.hashing import file_hash
    from ddp_hpc.data.stage import StageRequest, sbcast_paths, stage_key, stage_result

    src = _big_file(tmp_path / "shared.bin", 2)
    dest = tmp_path / "local"
    dest.mkdir()
    data, manifest = sbcast_paths(str(dest), stage_key(src, "77"))
    with open(data, "wb") as f:
        f.write(open(src, "rb").read())
    nbytes, digest = file_hash(src)
    with open(manifest, "w") as f:
        json.dump({"src": src, "kind": "file", "bytes": nbytes, "xxh3_64": digest}, f)
    first = stage_result(StageRequest(src, str(dest), job_id="77", user="n0"))
    assert (first.method, first.bytes, first.users) == ("sbcast", 2 << 20, ("n0",)) and first.mb_per_s > 0
    # a requeue: the copy of attempt 0 is there, but n0's ranks wait until n0 re-verified it
    with pytest.raises(StageError, match="waited"):
        stage_result(StageRequest(src, str(dest), job_id="77", restart_count=1, copier=False, user="n0",
                                  wait_timeout=0.3, poll_s=0.05))
    again = stage_result(StageRequest(src, str(dest), job_id="77", restart_count=1, user="n0"))
    assert (again.method, again.path, again.made_by, again.users, again.mb_per_s) == \
        ("reused", first.path, "77:0", ("n0",), None)
    waited = stage_result(StageRequest(src, str(dest), job_id="77", restart_count=1, copier=False, user="n0",
                                       wait_timeout=5))
    assert (waited.method, waited.path) == ("waited", first.path)
    plain = stage_result(StageRequest(src, str(dest), job_id="78"))
    assert plain.method == "copy" and plain.users == () and plain.copy_seconds > 0


def _local_sbcast(nodes):
    """A SlurmCLI whose ``sbcast`` writes the file to the same path below each pretend node's
    own folder (what Slurm's sbcast does across real nodes; the real one runs in
    tests/cluster/test_io_cluster.py)."""
    import shutil

    from ddp_hpc.slurm.cli import SlurmCLI

    def runner(argv, **kw):
        src, dst = argv[-2], argv[-1]
        for node in nodes:
            shutil.copyfile(src, dst.replace(str(nodes[0]), str(node)))
        return subprocess.CompletedProcess(argv, 0, "", "")
    return SlurmCLI(runner=runner)


def test_a_folder_goes_by_sbcast_as_one_archive_read_once_and_each_node_unpacks_it(tmp_path):
    """sbcast of a folder: the shared files are opened once in all (counted), each pretend node
    adopts the archive (same bytes, same file count, no shared open) and a node whose archive
    was damaged on the way copies from the source instead."""
    from ddp_hpc.data.sbcast import sbcast_stage
    from ddp_hpc.data.stage import StageRequest, stage_result

    src = tmp_path / "shared" / "imgs"
    for i in range(30):
        (src / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        (src / f"c{i % 3}" / f"{i}.bin").write_bytes(os.urandom(100 + i * 37))
    (src / "top.txt").write_text("top")
    os.symlink(src / "top.txt", src / "link.txt")          # links stay behind, as a copy leaves them
    nodes = [tmp_path / f"node{k}" for k in range(3)]
    for n in nodes:
        n.mkdir(mode=0o700)
    fsio.watch(tmp_path / "shared")
    try:
        out = sbcast_stage(src, str(nodes[0]), cli=_local_sbcast(nodes), environ={"SLURM_JOB_ID": "5"})
        assert out["kind"] == "dir" and fsio.snapshot()["opens"] == 31
        with open(out["data"].replace(str(nodes[0]), str(nodes[2])), "r+b") as f:
            f.seek(700)
            f.write(b"X")                                  # damaged on node 2's way
        fsio.reset()
        got = {}
        for k, n in enumerate(nodes[:2]):
            res = stage_result(StageRequest(src, str(n), job_id="5", user=f"node{k}"))
            got[k] = res
        assert fsio.snapshot()["opens"] == 0               # adopting reads no shared file
        third = stage_result(StageRequest(src, str(nodes[2]), job_id="5", user="node2"))
        assert fsio.snapshot()["opens"] > 0                # that one copied from the source
    finally:
        fsio.unwatch()
    want = {p.relative_to(src): p.read_bytes() for p in src.rglob("*") if p.is_file() and not p.is_symlink()}
    for res in (got[0], got[1], third):
        copy = Path(res.path)
        assert {p.relative_to(copy): p.read_bytes() for p in copy.rglob("*") if p.is_file()} == want
        assert not (copy / "link.txt").exists() and res.files == 31
    assert [r.method for r in (got[0], got[1], third)] == ["sbcast", "sbcast", "copy"]
    assert got[0].bytes == sum(len(b) for b in want.values())
    assert [n.name for n in nodes if list(n.glob(".*.sbcast*"))] == []   # archives gone once adopted
    for res, k in ((got[0], 0), (got[1], 1), (third, 2)):
        assert cleanup_staged(res.path, f"node{k}") == ("removed", [])
