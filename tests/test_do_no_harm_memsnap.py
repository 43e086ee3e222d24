"""Issue 38, bug 6: memory snapshots do no harm (train/memsnap.py, train/memroom.py).

Before the first snapshot the node's writer checks that two snapshots fit the store's filesystem
and that they and the copy kept between snapshots fit the job's memory (its cgroup's limit); a
state that does not fit, and a write that finds the filesystem full, step back for the run: one
warning, one ``memsnap`` event that ``ddp-hpc status`` shows, no file half-written, the copy's
buffers freed, and training goes on. A real small tmpfs where user namespaces allow one
(``unshare -rm``), a fake cgroup tree for the memory limit."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from ddp_hpc import records
from ddp_hpc.env import memory
from ddp_hpc.train import memroom
from ddp_hpc.train.memsnap import MemSnapshots, NodeStore

MB = 1 << 20


def _can_mount() -> bool:
    if not shutil.which("unshare"):
        return False
    p = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt || "
                        "mount -t tmpfs -o size=1m tmpfs /tmp"], capture_output=True, timeout=30)
    return p.returncode == 0


needs_mount = pytest.mark.skipif(not _can_mount(), reason="needs user namespaces (unshare -rm) for a small tmpfs")

PRELUDE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    from ddp_hpc.train import memroom
    from ddp_hpc.train.memsnap import MemSnapshots, NodeStore
    memroom.MARGIN_BYTES = 0
    root = Path(sys.argv[1])
    warned, events = [], []

    class Log:                                   # the loop's run log: its warning and its events
        def warning(self, msg):
            warned.append(msg)

        def event(self, name, **fields):
            events.append({"event": name, **fields})
    store = NodeStore(root / "n0", "n0")
    snaps = MemSnapshots(store, rank=0, local_rank=0, every=1, device=torch.device("cpu"),
                         distributed=False, warn=Log().warning)

    def state(mb):
        return {"model": {"w": torch.ones(int(mb * (1 << 20)) // 4)}, "optimizer": None,
                "epoch": 0, "batch_in_epoch": 0}

    def files():
        return sorted(p.name for p in store.folder.iterdir() if p.name != ".write.lock")
""")


def _in_small_tmpfs(tmp_path: Path, size: str, body: str) -> dict:
    """Run ``body`` (after `PRELUDE`) in a process whose ``sys.argv[1]`` is a tmpfs of ``size``;
    its last line of output is JSON."""
    mnt, script = tmp_path / "small", tmp_path / "inner.py"
    mnt.mkdir()
    script.write_text(PRELUDE + textwrap.dedent(body))
    p = subprocess.run(["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size="$1" tmpfs "$2" && exec "$3" "$4" "$2"',
                        "sh", size, str(mnt), sys.executable, str(script)],
                       capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent.parent)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.splitlines()[-1])


@needs_mount
def test_a_state_that_does_not_fit_the_filesystem_steps_back_before_any_write(tmp_path):
    out = _in_small_tmpfs(tmp_path, "2m", """
        snaps.take(1, lambda: state(1.5))        # two of 1.5 MB do not fit 2 MB
        snaps.wait()
        snaps.take(2, lambda: state(1.5))
        snaps.close()
        print(json.dumps({"files": files(), "warned": warned, "events": events, "kept": snaps.copies.nbytes}))
    """)
    assert out["files"] == [], out                       # nothing written, nothing half-written
    assert len(out["warned"]) == 1 and out["warned"][0].startswith(
        "memory snapshots off: the state (1.6 MB x 2) does not fit "), out["warned"]
    assert "MB free); file checkpoints go on" in out["warned"][0], out["warned"]
    assert [(e["event"], e["status"], e["step"]) for e in out["events"]] == [("memsnap", "off", 1)], out["events"]
    assert out["warned"][0].startswith(out["events"][0]["why"])
    assert out["kept"] == 0


@needs_mount
def test_a_snapshot_write_that_finds_the_filesystem_full_steps_back_and_leaves_no_partial_file(tmp_path):
    out = _in_small_tmpfs(tmp_path, "4m", """
        snaps.take(1, lambda: state(1))
        snaps.wait()
        first = files()
        filler = root / "filler"                 # a DataLoader's worker takes the rest
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"x" * 65536)
                    f.flush()
            except OSError:
                pass
        snaps.take(2, lambda: state(1))          # ENOSPC in the writer
        snaps.wait()
        after = files()
        filler.unlink()
        snaps.take(3, lambda: state(1))          # stepped back for the run: no more snapshots
        snaps.close()
        loads = torch.load(store.folder / "ckpt-000000001.pt", weights_only=True)["step"]
        print(json.dumps({"first": first, "after": after, "end": files(), "warned": warned, "events": events,
                          "kept": snaps.copies.nbytes, "loads": loads}))
    """)
    assert out["first"] == ["ckpt-000000001.pt", "rank0-000000001.pt"], out
    assert out["after"] == out["end"] == out["first"], out      # no temporary file left, step 1 whole
    assert out["loads"] == 1
    assert len(out["warned"]) == 1 and out["warned"][0].startswith("memory snapshots off: cannot write "), out
    assert [(e["event"], e["status"], e["step"]) for e in out["events"]] == [("memsnap", "off", 2)], out
    assert out["kept"] == 0


class _Log:
    """The loop's run log as MemSnapshots sees it: ``warn`` is its ``warning``, events go beside."""

    def __init__(self, warned: list, events: list) -> None:
        self.warned, self.events = warned, events

    def warning(self, msg: str) -> None:
        self.warned.append(msg)

    def event(self, name: str, **fields) -> None:
        self.events.append({"event": name, **fields})


def _snaps(tmp_path: Path, warned: list, events: list) -> MemSnapshots:
    store = NodeStore(tmp_path / "shm" / "n0", "n0")
    return MemSnapshots(store, rank=0, local_rank=0, every=1, device=torch.device("cpu"), distributed=False,
                        warn=_Log(warned, events).warning)


def _state(mb: float) -> dict:
    return {"model": {"w": torch.ones(int(mb * MB) // 4)}, "optimizer": None, "epoch": 0, "batch_in_epoch": 0}


def test_a_state_that_does_not_fit_the_free_space_steps_back_without_a_mount(tmp_path, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(memroom.shutil, "disk_usage", lambda p: real(p)._replace(free=3 * MB))
    monkeypatch.setattr(memroom, "MARGIN_BYTES", 0)
    warned, events = [], []
    snaps = _snaps(tmp_path, warned, events)
    snaps.take(1, lambda: _state(2))
    snaps.close()
    assert list(snaps.store.folder.iterdir()) == []
    assert warned and warned[0].startswith("memory snapshots off: the state (2.1 MB x 2) does not fit /"), warned
    assert "(3.1 MB free)" in warned[0], warned
    assert events[0]["why"] in warned[0]


def _cgroup_v2(root: Path, path: str, limits: dict[str, tuple[str, int]], stat: str = "") -> tuple[Path, Path]:
    proc = root / "proc-cgroup"
    proc.write_text(f"0::{path}\n")
    for where, (limit, current) in limits.items():
        d = root / "fs" / where.lstrip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.max").write_text(limit + "\n")
        (d / "memory.current").write_text(f"{current}\n")
        (d / "memory.stat").write_text(stat)
    return proc, root / "fs"


def test_the_job_memory_limit_is_read_from_the_process_cgroup_v2_and_its_parents(tmp_path):
    # Slurm puts the limit on the job's cgroup; the task's own says "max"
    proc, fs = _cgroup_v2(tmp_path, "/system.slice/slurmstepd.scope/job_7/step_0/user/task_0",
                          {"/system.slice/slurmstepd.scope/job_7": (str(16 << 30), 10 << 30),
                           "/system.slice/slurmstepd.scope/job_7/step_0/user/task_0": ("max", 3 << 30)},
                          stat=f"anon 100\nfile {4 << 30}\nshmem {1 << 30}\n")
    got = memory.cgroup_memory(proc_cgroup=proc, cgroup_fs=fs)
    # the page cache (file, less shmem) is no use: the kernel frees it for the snapshots
    assert got == (16 << 30, 7 << 30, "cgroup memory.max"), got


def test_the_job_memory_limit_is_read_from_cgroup_v1(tmp_path):
    proc = tmp_path / "proc-cgroup"
    proc.write_text("5:devices:/x\n4:cpuacct,memory:/slurm/uid_1/job_9/step_0\n0::/\n")
    for where, limit, usage in (("slurm/uid_1/job_9", 8 << 30, 6 << 30),
                                ("slurm/uid_1/job_9/step_0", 9223372036854771712, 5 << 30)):
        d = tmp_path / "fs" / "memory" / where
        d.mkdir(parents=True)
        (d / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (d / "memory.usage_in_bytes").write_text(f"{usage}\n")
        (d / "memory.stat").write_text(f"cache {2 << 30}\nshmem {1 << 30}\n")
    got = memory.cgroup_memory(proc_cgroup=proc, cgroup_fs=tmp_path / "fs")
    assert got == (8 << 30, 5 << 30, "cgroup memory.limit_in_bytes"), got
    assert memory.cgroup_memory(proc_cgroup=tmp_path / "none", cgroup_fs=tmp_path / "fs") == (None, None, "")


def test_slurm_memory_hints_stand_in_for_a_cgroup_without_a_limit():
    assert memory.slurm_memory({"SLURM_MEM_PER_NODE": "4096"}) == 4096 * MB
    assert memory.slurm_memory({"SLURM_MEM_PER_CPU": "1000", "SLURM_CPUS_ON_NODE": "8"}) == 8000 * MB
    assert memory.slurm_memory({"SLURM_MEM_PER_NODE": "0"}) is None        # 0: the whole node
    assert memory.slurm_memory({}) is None


def test_a_state_that_does_not_fit_the_job_memory_steps_back(tmp_path, monkeypatch):
    proc, fs = _cgroup_v2(tmp_path, "/job", {"/job": (str(100 * MB), 98 * MB)})
    monkeypatch.setattr(memory, "PROC_CGROUP", proc)
    monkeypatch.setattr(memory, "CGROUP_FS", fs)
    monkeypatch.setattr(memroom, "MARGIN_BYTES", 0)
    warned, events = [], []
    snaps = _snaps(tmp_path, warned, events)
    snaps.take(1, lambda: _state(1))
    snaps.close()
    assert list(snaps.store.folder.iterdir()) == []
    assert warned and warned[0].startswith(
        "memory snapshots off: the state (1.0 MB x 3: two in /"), warned
    assert "does not fit the job's memory (2.1 MB of 104.9 MB free, cgroup memory.max)" in warned[0], warned


def test_the_snapshots_buffers_are_freed_when_they_stop(tmp_path):
    warned, events = [], []
    snaps = _snaps(tmp_path, warned, events)
    snaps.take(1, lambda: _state(1))
    snaps.wait()
    assert snaps.copies.nbytes >= MB and warned == []
    snaps.close()
    assert snaps.copies.nbytes == 0


def test_status_says_why_memory_snapshots_stepped_back(tmp_path):
    job, d = "904", tmp_path / "logs" / "904"
    d.mkdir(parents=True)
    t0 = time.time() - 100
    why = "memory snapshots off: the state (3.2 GB x 2) does not fit /dev/shm (1.1 GB free); file checkpoints go on"
    for rank in range(2):
        head = {"rank": rank, "job_id": job, "restart": 0, "host": "n1"}
        evs = [{**head, "time": t0, "event": "start", "world_size": 2, "num_nodes": 1, "local_rank": rank,
                "pid": 100 + rank}]
        if rank == 0:
            evs.append({**head, "time": t0 + 1, "event": "memsnap", "status": "off", "why": why, "step": 1})
        evs += [{**head, "time": t0 + s, "event": "step", "epoch": 0, "step": s, "total_steps": 10, "loss": 1.0}
                for s in range(1, 5)]
        (d / f"rank{rank}.events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))
    records.write_record(dict(id=job, cluster=socket.gethostname(), name="demo", backend="sbatch", nodes=1,
                              gpus_per_node=2, time_limit="00:10:00", log_dir=str(d), config=None, overrides=[],
                              cwd=str(tmp_path), submitted_at=t0 - 5,
                              final={"state": "COMPLETED", "state_name": "COMPLETED", "source": "sacct",
                                     "seen_at": time.time(), "exit_code": "0:0"}),
                         {"DDP_HPC_HOME": str(tmp_path / "home")})
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "COLUMNS"}
    env.update(DDP_HPC_HOME=str(tmp_path / "home"), PATH=str(Path(sys.executable).parent))
    p = subprocess.run([sys.executable, "-m", "ddp_hpc.status", job], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert sum(why in line for line in p.stdout.splitlines()) == 1, p.stdout
