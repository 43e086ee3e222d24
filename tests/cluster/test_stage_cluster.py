"""``ddp-hpc submit --stage`` on the real test cluster: a plain script (examples/fast_data.py) reads
a staged LMDB (sbatch backend, 2 nodes x 2 tasks: the batch script sbcasts it and each node adopts
the copy) while a Lightning DataModule (examples/lightning_data.py) reads a staged image folder
(submitit backend, 2 nodes x 1 task: the batch script sbcasts it as one archive, each node
unpacks it).  Each node's TMPDIR is the cluster's
node-local folder (the same path on every node, each node's own disk behind it): one copy per
node, the path in DDP_HPC_STAGE_TRAIN, and no copy left on any node's disk after the job."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ddp_hpc import records
from ddp_hpc.judge.nodefiles import log_events

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def _job(c, d: Path, env: dict, args: list[str]) -> tuple[str, str, dict]:
    """Submit and wait; -> (output, the record's log dir, the record's id)."""
    home = d / "home"
    p = c.run([PY, "-m", "ddp_hpc.submit", *args], cwd=str(d), env={**env, "DDP_HPC_HOME": str(home)},
              timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    (rec,) = records.list_records({"DDP_HPC_HOME": str(home)})
    return p.stdout + p.stderr, rec.log_dir, rec.id


def _stage_events(log_dir: str) -> list[dict]:
    return [e for _, s in sorted(log_events(log_dir).items()) for e in s.events
            if e["event"] == "stage"]


def test_a_plain_script_and_a_lightning_datamodule_read_staged_data_on_two_nodes(slurm_cluster):
    """Only test of ``submit --stage`` end to end on real nodes, for a plain script (2 x 2) and a
    Lightning DataModule (2 x 1): one copy per node, and nothing left on the nodes."""
    pytest.importorskip("lightning")
    from ddp_hpc.data.pack import pack
    from ddp_hpc.examples.images import make_images

    c = slurm_cluster
    base = c.shared_dir / f"stage-{time.monotonic_ns()}"
    make_images(base / "imgs", count=128, classes=4, size=8, progress=False)
    pack(str(base / "imgs"), str(base / "imgs.lmdb"), progress=False)
    env = {**c.env, "PYTHONPATH": str(ROOT), "TMPDIR": str(c.local_dir)}
    jobs = {"plain": (base / "plain", ["--backend", "sbatch", "-N", "2", "-G", "2", "-t", "10", "--wait",
                                       "--wait-timeout", "240", "--stage", f"{base / 'imgs.lmdb'}=TRAIN",
                                       str(ROOT / "examples" / "fast_data.py"), "--batch-size", "16"]),
            "lightning": (base / "lightning", ["--backend", "submitit", "-N", "2", "-G", "1", "-t", "10",
                                               "--wait", "--wait-timeout", "240", "--stage",
                                               f"{base / 'imgs'}=TRAIN", str(ROOT / "examples" / "lightning_data.py")])}
    for d, _ in jobs.values():
        d.mkdir()
    with ThreadPoolExecutor(2) as pool:   # independent jobs: side by side
        done = {k: pool.submit(_job, c, d, env, args) for k, (d, args) in jobs.items()}
        results = {k: f.result() for k, f in done.items()}
    for kind, tag, methods in (("plain", "fast_data", ["sbcast", "sbcast"]), ("lightning", "lightning_data",
                                                                              ["sbcast", "sbcast"])):
        _, log_dir, job_id = results[kind]
        out = (Path(log_dir) / "rank0.out").read_text()
        [line] = [x for x in out.splitlines() if x.startswith(f"{tag}: ")]
        seen = json.loads(line.split(": ", 1)[1])
        # node-local scratch that other users can write to (as the nodes see it) gets this user's
        # private folder first (ddp_hpc.data.stagedir.private_root), as a shared /tmp does
        private = re.escape(str(c.local_dir)) + rf"(/ddp_hpc-{os.getuid()})?/ddp_hpc-stage-"
        assert seen["samples"] == 128 and re.match(private, seen["data"]), (private, seen)
        events = _stage_events(log_dir)
        assert sorted(e["method"] for e in events) == methods, events  # one per node, each on its own disk
        assert {e["variable"] for e in events} == {"DDP_HPC_STAGE_TRAIN"} and len({e["host"] for e in events}) == 2
        # nothing left on any node's disk: the copies go into this user's private folder of the
        # shared scratch (stagedir.private_root), sbcast's file and manifest into the scratch itself
        for node in ("n1", "n2", "n3", "n4"):
            backing = c.state_dir / "local" / node
            left = [str(p.relative_to(backing)) for d in (backing, backing / f"ddp_hpc-{os.getuid()}")
                    for pat in ("ddp_hpc-stage-*", ".ddp_hpc-stage-*") for p in d.glob(pat)]
            assert left == [], (node, left)
        status = c.run([PY, "-m", "ddp_hpc.status", job_id], cwd="/", timeout=120,
                       env={**env, "DDP_HPC_HOME": str(jobs[kind][0] / "home")})
        lines = [x for x in status.stdout.splitlines() if "$DDP_HPC_STAGE_TRAIN" in x]
        assert len(lines) == 2 and all(f" {m} " in x for m, x in zip(methods, lines)), status.stdout
