"""Staging on a node other users share: in a folder others can write to (``/tmp``, ``/dev/shm``)
copies go to this user's own subfolder (0700, its owner and mode checked before use), nothing
another user left there is reused or adopted, and a copy keeps its source's permissions, never
wider. Real files, real modes; the tests that plant files as another user need root (chown)."""
from __future__ import annotations

import json
import os
import stat

import pytest

from ddp_hpc.data.hashing import file_hash
from ddp_hpc.data.stage import StageError, StageRequest, sbcast_paths, stage, stage_key, stage_result

OTHER_UID = 54321     # "another user" (no account needed: chown takes a number)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="planting files as another user needs root (chown)")


@pytest.fixture(autouse=True)
def _umask():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _shared(tmp_path):
    """A folder like /tmp: everybody may write, the sticky bit on."""
    d = tmp_path / "tmp"
    d.mkdir()
    os.chmod(d, 0o1777)
    return d


def _file(path, data: bytes, mode: int = 0o600) -> str:
    path.write_bytes(data)
    os.chmod(path, mode)
    return str(path)


def test_in_a_shared_folder_copies_go_to_a_private_subfolder_of_this_user(tmp_path):
    src = _file(tmp_path / "train.bin", os.urandom(4096), 0o640)
    shared = _shared(tmp_path)
    path = stage(src, str(shared), job_id="5")
    root = shared / f"ddp_hpc-{os.getuid()}"
    assert path.startswith(str(root) + "/") and open(path, "rb").read() == open(src, "rb").read()
    assert _mode(root) == 0o700 and os.lstat(root).st_uid == os.getuid()
    assert _mode(path) == 0o640     # the source's permissions


def test_a_stage_folder_planted_where_copies_went_before_is_not_used(tmp_path):
    """Another user made the folder that an earlier version would reuse (a predictable name
    under /tmp) with a marker that matches their own data: never read."""
    src = _file(tmp_path / "train.bin", b"real" * 1024)
    shared = _shared(tmp_path)
    planted = shared / stage_key(src, "5")
    planted.mkdir()
    fake = _file(planted / "train.bin", b"evil" * 1024, 0o644)
    nbytes, digest = file_hash(fake)
    (planted / "COMPLETE.json").write_text(json.dumps({"name": "train.bin", "kind": "file", "bytes": nbytes,
                                                       "xxh3_64": digest, "attempt": "5:0"}))
    path = stage(src, str(shared), job_id="5")
    assert open(path, "rb").read() == b"real" * 1024 and not path.startswith(str(planted))


@pytest.mark.parametrize("how", ["mode", "symlink"])
def test_a_private_subfolder_that_others_can_enter_is_refused(tmp_path, how):
    src = _file(tmp_path / "train.bin", b"x" * 100)
    shared = _shared(tmp_path)
    root = shared / f"ddp_hpc-{os.getuid()}"
    if how == "mode":
        root.mkdir(mode=0o755)
        os.chmod(root, 0o755)
    else:
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        root.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(StageError) as e:
        stage(src, str(shared), job_id="5")
    assert str(root) in e.value.problem and "remove" in e.value.hint


@needs_root
def test_a_private_subfolder_of_another_owner_is_refused(tmp_path):
    src = _file(tmp_path / "train.bin", b"x" * 100)
    shared = _shared(tmp_path)
    root = shared / f"ddp_hpc-{os.getuid()}"
    root.mkdir(mode=0o700)
    os.chown(root, OTHER_UID, OTHER_UID)
    with pytest.raises(StageError, match=f"owned by uid {OTHER_UID}"):
        stage(src, str(shared), job_id="5")


@needs_root
def test_sbcast_files_of_another_user_are_not_adopted(tmp_path):
    src = _file(tmp_path / "train.bin", b"real" * 1024)
    shared = _shared(tmp_path)
    data, manifest = sbcast_paths(str(shared), stage_key(src, "77"))
    with open(data, "wb") as f:
        f.write(b"evil" * 1024)
    nbytes, digest = file_hash(data)
    with open(manifest, "w") as f:
        json.dump({"src": src, "kind": "file", "bytes": nbytes, "xxh3_64": digest}, f)
    for p in (data, manifest):
        os.chown(p, OTHER_UID, OTHER_UID)
    res = stage_result(StageRequest(src, str(shared), job_id="77"))
    assert res.method == "copy" and open(res.path, "rb").read() == b"real" * 1024
    assert os.path.exists(data) and os.path.exists(manifest)     # left alone: not this user's to remove


def test_copies_keep_the_sources_permissions(tmp_path):
    dest = tmp_path / "local"
    dest.mkdir()
    shared = tmp_path / "shared"
    shared.mkdir()
    f = _file(shared / "private.bin", b"p" * 1000, 0o600)
    lmdb = shared / "d.lmdb"
    lmdb.mkdir(mode=0o750)
    os.chmod(lmdb, 0o750)
    _file(lmdb / "data.mdb", b"m" * 1000, 0o640)
    tree = shared / "hf_cache"
    (tree / "sub").mkdir(parents=True)
    os.chmod(tree / "sub", 0o700)
    os.chmod(tree, 0o750)
    _file(tree / "sub" / "a.bin", b"a" * 10, 0o600)
    _file(tree / "run.sh", b"#!/bin/sh\n", 0o755)
    got = {name: stage(p, str(dest), job_id="9") for name, p in
           (("file", f), ("lmdb", str(lmdb)), ("tree", str(tree)))}
    assert _mode(got["file"]) == 0o600
    assert (_mode(got["lmdb"]), _mode(os.path.join(got["lmdb"], "data.mdb"))) == (0o750, 0o640)
    assert [_mode(os.path.join(got["tree"], p)) for p in ("", "sub", "sub/a.bin", "run.sh")] == \
        [0o750, 0o700, 0o600, 0o755]


def test_copies_are_never_wider_than_the_umask_allows(tmp_path):
    dest = tmp_path / "local"
    dest.mkdir()
    src = _file(tmp_path / "open.bin", b"o" * 100, 0o666)
    os.umask(0o077)
    assert _mode(stage(src, str(dest), job_id="9")) == 0o600


def test_sbcast_never_overwrites_in_a_shared_folder(tmp_path):
    """Into a folder others may write to, the sbcast copies' names can be foreseen: Slurm's sbcast
    runs without --force there (it then fails on a file or link already there, and the nodes
    copy), with it into a folder of this user's own (a rerun replaces its own leftovers)."""
    import subprocess

    from ddp_hpc.data.sbcast import sbcast_stage
    from ddp_hpc.slurm.cli import SlurmCLI

    calls: list[list[str]] = []

    def runner(argv, **kw):
        calls.append(list(argv))
        return subprocess.CompletedProcess(argv, 0, "", "")

    src = _file(tmp_path / "train.bin", b"x" * 100)
    own = tmp_path / "own"
    own.mkdir(mode=0o700)
    for dest, force in ((_shared(tmp_path), False), (own, True)):
        calls.clear()
        out = sbcast_stage(src, str(dest), cli=SlurmCLI(runner=runner), environ={"SLURM_JOB_ID": "7"})
        assert [c[0] for c in calls] == ["sbcast", "sbcast"] and out["data"].startswith(str(dest) + "/")
        assert all(("--force" in c) == force for c in calls), (dest, calls)
