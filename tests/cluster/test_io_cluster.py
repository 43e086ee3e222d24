"""IO techniques on the real test cluster: 2 nodes x 2 tasks train jobs/images.yaml with direct
reads, with stage+lmdb and with group broadcast, and reach the same final metrics.  Each node
stages into its own folder (TMPDIR=<shared>/nodelocal/$SLURMD_NODENAME, standing in for a
node-local disk), so the staging markers show one verified copy per node."""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from ddp_hpc.judge.nodefiles import rank_events

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]


def _script(run_dir: Path, data: Path, overrides: list[str]) -> str:
    argv = [sys.executable, "-m", "ddp_hpc.run", str(REPO / "jobs" / "images.yaml"),
            f"data.kwargs.root={data / 'train'}", f"data.eval_kwargs.root={data / 'eval'}",
            f"checkpoint.dir={run_dir / 'ckpt'}", "train.epochs=2", "log.progress=lines",
            "log.every_n_steps=4", *overrides]
    task = ('export TMPDIR="$0/$SLURMD_NODENAME"; mkdir -p "$TMPDIR"; exec "$@"')
    return (
        "#!/bin/bash\n"
        f"export DDP_HPC_LOG_DIR={shlex.quote(str(run_dir / 'logs'))}\n"
        'mkdir -p "$DDP_HPC_LOG_DIR"\n'
        f"cd {shlex.quote(str(REPO))}\n"
        'srun --output="$DDP_HPC_LOG_DIR/rank%t.out" bash -c '
        + shlex.quote(task) + " " + shlex.quote(str(run_dir / "nodelocal")) + " "
        + " ".join(shlex.quote(a) for a in argv) + "\n")


def _final_eval(run_dir: Path) -> dict:
    evals = [e for e in rank_events(run_dir / "logs", 0).events if e.get("event") == "eval"]
    assert evals, f"no eval event in {run_dir / 'logs'}"
    return evals[-1]["metrics"]


def _diag(c, jid: str, run_dir: Path) -> str:
    outs = "".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((run_dir / "logs").glob("rank*.out")))
    return f"{c.output(jid)[-1500:]}\n{outs}"


def test_stage_lmdb_and_broadcast_train_to_the_same_metrics_as_direct(slurm_cluster):
    """Only test that staged LMDB and group broadcast reads train to the very metrics of direct
    reads on real nodes (2 x 2: broadcast groups are per node)."""
    from ddp_hpc.data.pack import pack
    from ddp_hpc.examples.images import make_images

    c = slurm_cluster
    data = c.shared_dir / "io-images"
    make_images(data / "train", count=512, classes=10, size=16, seed=0, progress=False)
    make_images(data / "eval", count=128, classes=10, size=16, seed=1, progress=False)
    pack(data / "train", data / "train.lmdb", progress=False)
    runs = {
        "direct": ["data.io=direct"],
        "stage_lmdb": ["data.io=stage", f"data.lmdb_path={data / 'train.lmdb'}", "data.stage_to=tmpdir",
                       "data.stage_cleanup=false"],
        "broadcast": ["data.io=broadcast", "data.broadcast_groups=node"],
    }
    metrics = {}
    jobs = {name: c.sbatch(_script(c.shared_dir / f"io-{name}", data, overrides), "-N2",
                           "--ntasks-per-node=2", "--time=10")
            for name, overrides in runs.items()}   # side by side: 3 jobs of 2 nodes fit 4 nodes
    for name, jid in jobs.items():
        run_dir = c.shared_dir / f"io-{name}"
        assert c.wait(jid, timeout=400) == "COMPLETED", _diag(c, jid, run_dir)
        metrics[name] = _final_eval(run_dir)
        if name == "stage_lmdb":
            nodes = sorted(p.name for p in (run_dir / "nodelocal").iterdir())
            assert len(nodes) == 2, nodes
            for node in nodes:  # one verified copy per node, made by this job
                markers = list((run_dir / "nodelocal" / node).glob("ddp_hpc-stage-*/COMPLETE.json"))
                assert len(markers) == 1, (node, markers)
                marker = json.loads(markers[0].read_text())
                assert marker["kind"] == "lmdb" and marker["attempt"] == f"{jid}:0"
                assert marker["bytes"] == (data / "train.lmdb" / "data.mdb").stat().st_size
    base = metrics["direct"]
    assert base["count"] == 128
    for name in ("stage_lmdb", "broadcast"):
        assert metrics[name]["correct"] == base["correct"], metrics
        assert metrics[name]["loss"] == pytest.approx(base["loss"], rel=1e-5, abs=1e-6), metrics


def test_sbcast_copies_are_adopted_and_a_damaged_one_is_recopied(slurm_cluster):
    """bench/sbcast.py on 2 nodes (sbcast + adopt vs per-node copy, both verified by each node's
    marker), then: sbcast an LMDB, damage node 2's copy, stage; node 1 adopts, node 2 copies."""
    c = slurm_cluster
    work = c.shared_dir / "sbcast"
    (work / "db.lmdb").mkdir(parents=True)
    (work / "db.lmdb" / "data.mdb").write_bytes(bytes(range(256)) * 4096)
    local = c.local_dir / "sbcast-test"
    py = shlex.quote(sys.executable)
    script = f"""#!/bin/bash
set -euo pipefail
cd {shlex.quote(str(REPO))}
{py} bench/sbcast.py --to {shlex.quote(str(c.local_dir))} --shared {shlex.quote(str(work))} --mib 4 --reps 1 \\
    --warm --json {shlex.quote(str(work / 'bench.json'))}
srun -N2 --ntasks-per-node=1 mkdir -p {shlex.quote(str(local))}
{py} -m ddp_hpc.data sbcast {shlex.quote(str(work / 'db.lmdb'))} --to {shlex.quote(str(local))} --json
srun -N1 -w n2 sh -c 'printf X | dd of="$(ls -d {shlex.quote(str(local))}/.*.sbcast)" bs=1 seek=100 conv=notrunc'
srun -N2 --ntasks-per-node=1 --output={shlex.quote(str(work / 'stage%t.out'))} \\
    {py} -m ddp_hpc.data stage {shlex.quote(str(work / 'db.lmdb'))} --to {shlex.quote(str(local))} --json
"""
    jid = c.sbatch(script, "-N2", "-w", "n1,n2", "--time=5")   # the script names n1 and n2
    assert c.wait(jid, timeout=300) == "COMPLETED", c.output(jid)[-3000:]
    bench = json.loads((work / "bench.json").read_text())
    assert bench["nodes"] == 2 and set(bench["best"]) == {"copy", "sbcast"}
    print(f"sbcast bench on the test cluster: {bench}")
    methods = {}
    for t, node in ((0, "n1"), (1, "n2")):
        out = (work / f"stage{t}.out").read_text().splitlines()  # stderr (warnings) is in it too
        path = Path(json.loads(next(x for x in reversed(out) if x.startswith("{")))["path"])
        backing = c.state_dir / "local" / node / path.relative_to(c.local_dir)  # that node's own disk
        assert (backing / "data.mdb").read_bytes() == (work / "db.lmdb" / "data.mdb").read_bytes(), node
        methods[node] = json.loads((backing.parent / "COMPLETE.json").read_text())["method"]
        assert not list(backing.parent.parent.glob(".*.sbcast*")), "sbcast leftovers not cleaned up"
    assert methods == {"n1": "sbcast", "n2": "copy"}
    assert "ignoring the sbcast copy" in (work / "stage1.out").read_text()


def test_a_folder_staged_for_three_nodes_is_read_once_whatever_the_node_count(slurm_cluster):
    """bench/stage_folder.py with 300 small images on 1, 2 and 3 nodes: every node's copy has the
    source's bytes, the copies are gone afterwards, and the shared folder saw one open per file
    (inotify, any process) for each node count: sbcast's one archive on 2 and 3 nodes."""
    c = slurm_cluster
    work = c.shared_dir / "stagefolder"
    work.mkdir(exist_ok=True)
    p = c.run([sys.executable, str(REPO / "bench" / "stage_folder.py"), "--shared", str(work), "--local",
               str(c.local_dir), "--files", "300", "--json", str(work / "out.json")], cwd=str(REPO),
              env={**c.env, "PYTHONPATH": str(REPO)}, timeout=400)
    assert p.returncode == 0, p.stdout + p.stderr
    out = json.loads((work / "out.json").read_text())
    print(p.stdout)
    assert out["files"] >= 300          # the images and make-images' own note of them
    for row in out["rows"]:
        assert not row["overflow"], row
        assert row["shared_opens"] == out["files"], row
        assert row["methods"] == (["copy"] if row["nodes"] == 1 else ["sbcast"] * row["nodes"]), row
        assert row["digests"] == [out["source_digest"]] * row["nodes"] and all(row["gone"]), row
    ours = "-imgs-300-"   # the bench's source folder: other tests' jobs stage on the same nodes meanwhile
    for node in ("n1", "n2", "n3", "n4"):   # no archive or copy of ours left on any node's disk
        backing = c.state_dir / "local" / node
        left = [p.name for pat in ("ddp_hpc-stage-*", ".ddp_hpc-stage-*", "*/ddp_hpc-stage-*", "*/.ddp_hpc-stage-*")
                for p in backing.glob(pat) if ours in p.name]
        assert left == [], (node, left)
