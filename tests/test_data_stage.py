"""Node-local staging: racing copiers copy once, a killed copy is never used, too little space
fails cleanly, a requeue reuses the copy, waiters see the copier's failure."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

import pytest

from ddp_hpc.data import fsio
from ddp_hpc.data.stage import StageError, cleanup_staged, resolve_stage_dir, stage


def _big_file(path, mib):
    with open(path, "wb") as f:
        for i in range(mib):
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
orig = C.Progress.__call__
def slow(self, n):
    time.sleep(0.01)
    orig(self, n)
C.Progress.__call__ = slow
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


def test_sbcast_refuses_outside_an_allocation_and_for_folders(tmp_path):
    from ddp_hpc.data.sbcast import sbcast_stage
    from ddp_hpc.slurm.cli import SlurmCLI

    f = tmp_path / "a.bin"
    f.write_bytes(b"x" * 100)
    with pytest.raises(StageError, match="SLURM_JOB_ID is not set\nHINT: run"):
        sbcast_stage(f, str(tmp_path), environ={})
    (tmp_path / "folder").mkdir()
    with pytest.raises(StageError, match="folder\nHINT: pack it into one LMDB"):
        sbcast_stage(tmp_path / "folder", str(tmp_path), environ={"SLURM_JOB_ID": "7"})
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run([sys.executable, "-m", "ddp_hpc.data", "sbcast", str(f), "--to", str(tmp_path)],
                          env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "SLURM_JOB_ID is not set" in done.stderr
    for bad in ("-rf", "", "a\nb"):
        with pytest.raises(ValueError, match="not a usable path"):
            SlurmCLI().sbcast(bad, "/tmp/x")
