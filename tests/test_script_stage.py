"""``ddp-hpc submit --stage SRC[=NAME]`` for a script, and ``ddp_hpc.data``'s API for scripts: the
items and their checks, what each backend is handed (the batch script's quoting, sbcast), real
local jobs of examples/fast_data.py and examples/lightning_data.py on 2 pretend nodes (one copy,
the path in the variable, the copy gone after the job, the staging in ``ddp-hpc status``), and
docs/scripts.md's script with the LMDB dataset and the broadcast loader, run as written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddp_hpc.data.errors import StageError
from ddp_hpc.data.scriptstage import SPEC_VAR, decode_items, encode_items, parse_stage_items, run_staged
from ddp_hpc.exits import EX_TEMPFAIL
from ddp_hpc.judge.nodefiles import log_events

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
FAST = str(ROOT / "examples" / "fast_data.py")
LIGHTNING = str(ROOT / "examples" / "lightning_data.py")


def _env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDP_HPC_"))}
    env.update(DDP_HPC_HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path / "local"),
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    (tmp_path / "local").mkdir(exist_ok=True)
    return env


def _cli(args, tmp_path, module="ddp_hpc.submit", timeout=180):
    return subprocess.run([PY, "-m", module, *args], cwd=tmp_path, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """96 small PNGs in a class-per-folder tree and their packed LMDB (the 'shared' data)."""
    from ddp_hpc.data.pack import pack
    from ddp_hpc.examples.images import make_images

    shared = tmp_path_factory.mktemp("shared")
    make_images(shared / "imgs", count=96, classes=4, size=8, progress=False)
    pack(str(shared / "imgs"), str(shared / "imgs.lmdb"), progress=False)
    return shared


def test_items_names_and_their_checks(images, tmp_path):
    folder, lmdb = images / "imgs", images / "imgs.lmdb"
    (tmp_path / "a=b").mkdir()
    got = parse_stage_items([str(folder), f"{lmdb}=train", "a=b"], workdir=str(tmp_path))
    assert [(i.src, i.variable, i.kind) for i in got] == [
        (str(folder), "DDP_HPC_STAGE_IMGS", "dir"), (str(lmdb), "DDP_HPC_STAGE_TRAIN", "lmdb"),
        (str(tmp_path / "a=b"), "DDP_HPC_STAGE_A_B", "dir")]  # a path that exists keeps its '='
    [named] = parse_stage_items(["a=b=x_1"], workdir=str(tmp_path))
    assert (named.src, named.name) == (str(tmp_path / "a=b"), "X_1")
    assert decode_items(encode_items(got)) == got
    bad = {f"{lmdb}=tr ain": "NAME 'tr ain' is not letters", str(tmp_path / "nope"): "does not exist",
           f"{folder}\nx": "control character"}
    for item, needle in bad.items():
        with pytest.raises(StageError, match=needle):
            parse_stage_items([item])
    with pytest.raises(StageError, match="give the same variable DDP_HPC_STAGE_IMGS"):
        parse_stage_items([str(folder), f"{lmdb}=imgs"])
    with pytest.raises(StageError, match="give the same source"):
        parse_stage_items([str(folder), f"{folder}=OTHER"])


def test_the_batch_script_quotes_the_request_and_sbcasts_files_lmdbs_and_folders(images, tmp_path):
    odd = tmp_path / "it's $(touch pwned) `x`"
    odd.mkdir()
    (odd / "f.bin").write_bytes(b"x" * 10)
    p = _cli(["--backend", "sbatch", "-N", "2", "--dry-run", "--stage", f"{images / 'imgs.lmdb'}=TRAIN",
              "--stage", str(odd), "--stage", f"{odd / 'f.bin'}=F", FAST], tmp_path)
    assert p.returncode == 0, p.stderr
    [export] = [ln for ln in p.stdout.splitlines() if ln.startswith(f"export {SPEC_VAR}=")]
    shown = subprocess.run(["bash", "-c", f'{export}; printf %s "${SPEC_VAR}"'], cwd=tmp_path,
                           capture_output=True, text=True, check=True).stdout
    items = decode_items(shown)
    assert [(i.src, i.name) for i in items] == [(str(images / "imgs.lmdb"), "TRAIN"),
                                                (str(odd), "IT_S___TOUCH_PWNED___X_"), (str(odd / "f.bin"), "F")]
    sb = [ln for ln in p.stdout.splitlines() if "-m ddp_hpc.data sbcast" in ln]
    assert len(sb) == 3 and "--stage TRAIN failed" in sb[0] and "--stage F failed" in sb[2]
    assert "--stage IT_S___TOUCH_PWNED___X_ failed" in sb[1]    # the folder too, as one archive
    assert not (tmp_path / "pwned").exists()
    one = _cli(["--backend", "sbatch", "--dry-run", "--stage", str(images / "imgs.lmdb"), FAST], tmp_path)
    assert one.returncode == 0 and "sbcast" not in one.stdout  # one node: nothing to fan out


@pytest.mark.parametrize("args, needle", [
    (["--stage", "nope", FAST], "--stage 'nope': "),
    (["--stage", "x=a-b", FAST], "NAME 'a-b' is not letters"),
])
def test_bad_stage_requests_exit_2_with_a_hint(tmp_path, args, needle):
    (tmp_path / "imgs").mkdir()
    p = _cli(["--dry-run", *args], tmp_path)
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr and "HINT:" in p.stderr and "Traceback" not in p.stderr


def _yaml(tmp_path, stage) -> str:
    """A tiny config job whose dataset factory (``stagecheck:dataset``) records what it was staged."""
    (tmp_path / "stagecheck.py").write_text(
        "import json, os\n"
        "from ddp_hpc.data import ImageFolderDataset, staged_path\n"
        "def dataset(shared):\n"
        "    got = {k: v for k, v in os.environ.items() if k.startswith('DDP_HPC_STAGE')}\n"
        "    if got:\n"
        "        os.makedirs('seen', exist_ok=True)\n"
        "        with open(f\"seen/rank{os.environ['RANK']}.json\", 'w') as f:\n"
        "            json.dump({k: [v, os.path.exists(v)] for k, v in got.items()}, f)\n"
        "    return ImageFolderDataset(staged_path('IMGS', shared))\n")
    path = tmp_path / "staged.yaml"
    path.write_text(json.dumps({  # JSON is YAML
        "name": "staged", "model": {"name": "ddp_hpc.examples.images:small_cnn",
                                    "kwargs": {"num_classes": 4, "width": 4}},
        "data": {"dataset": "stagecheck:dataset", "kwargs": {"shared": "unused"}},
        "train": {"batch_size": 8, "max_steps": 2, "eval_every_epochs": 0},
        "log": {"progress": "off"}, "slurm": {"stage": stage}}))
    return str(path)


def test_the_yaml_stage_key_adds_to_the_flags_and_a_clash_or_a_missing_source_is_refused(images, tmp_path):
    lmdb, folder = images / "imgs.lmdb", images / "imgs"
    cfg = _yaml(tmp_path, [f"{lmdb}=TRAIN"])
    p = _cli(["--backend", "sbatch", "--dry-run", "-N", "2", cfg, "--stage", str(folder)], tmp_path)
    assert p.returncode == 0, p.stderr
    [export] = [ln for ln in p.stdout.splitlines() if ln.startswith(f"export {SPEC_VAR}=")]
    shown = subprocess.run(["bash", "-c", f'{export}; printf %s "${SPEC_VAR}"'], capture_output=True,
                           text=True, check=True).stdout
    assert [(i.src, i.name) for i in decode_items(shown)] == [(str(lmdb), "TRAIN"), (str(folder), "IMGS")]
    assert "ddp_hpc.run" in p.stdout and "--stage TRAIN failed" in p.stdout  # the LMDB goes by sbcast
    clash = _cli(["--dry-run", cfg, "--stage", f"{folder}=train"], tmp_path)
    assert clash.returncode == 2, clash.stderr
    assert (f"{cfg}: slurm.stage '{lmdb}=TRAIN' and --stage '{folder}=train' give the same variable "
            "DDP_HPC_STAGE_TRAIN" in clash.stderr and "HINT:" in clash.stderr), clash.stderr
    missing = _cli(["--dry-run", _yaml(tmp_path, ["nope"])], tmp_path)
    assert missing.returncode == 2 and f"{cfg}: slurm.stage 'nope': " in missing.stderr, missing.stderr
    assert "does not exist" in missing.stderr and "Traceback" not in missing.stderr
    typed = _cli(["--dry-run", _yaml(tmp_path, 5)], tmp_path)
    assert typed.returncode == 2 and "slurm.stage must be a list" in typed.stderr and cfg in typed.stderr


def test_a_config_job_trains_on_what_its_yaml_and_its_flags_staged(images, tmp_path):
    cfg = _yaml(tmp_path, [f"{images / 'imgs.lmdb'}=TRAIN"])
    p = _cli(["--backend", "local", "-N", "2", "-G", "1", "--wait", cfg, "--stage", str(images / "imgs"),
              "log.dir=runs"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    seen = [json.loads(f.read_text()) for f in sorted((tmp_path / "seen").glob("rank*.json"))]
    assert len(seen) == 2
    for got in seen:   # both variables, node-local copies that existed while the job trained
        assert sorted(got) == ["DDP_HPC_STAGE_IMGS", "DDP_HPC_STAGE_TRAIN"]
        assert all(path.startswith(str(tmp_path / "local")) and there for path, there in got.values())
    [log_dir] = (tmp_path / "runs").iterdir()
    by_var = sorted((e["variable"], e["method"]) for e in _stage_events(log_dir))
    assert by_var == [("DDP_HPC_STAGE_IMGS", "copy"), ("DDP_HPC_STAGE_IMGS", "reused"),
                      ("DDP_HPC_STAGE_TRAIN", "copy"), ("DDP_HPC_STAGE_TRAIN", "reused")], by_var
    assert _staged_left(tmp_path) == []   # gone after the job


def test_the_python_api_stages_for_a_function_one_copy_per_node(images, tmp_path):
    (tmp_path / "fns.py").write_text(
        "import os\n"
        "import torch.distributed as dist\n"
        "def where():\n"
        "    dist.init_process_group('gloo')\n"
        "    dist.barrier()   # both pretend nodes hold the copy here (they share this machine's disk)\n"
        "    dist.destroy_process_group()\n"
        "    path = os.environ['DDP_HPC_STAGE_TRAIN']\n"
        "    return [path, os.path.isfile(os.path.join(path, 'data.mdb')), os.environ['RANK']]\n")
    train = f"{images / 'imgs.lmdb'}=train"
    code = ("import json, ddp_hpc\n"
            "from fns import where\n"
            "if __name__ == '__main__':\n"
            f"    job = ddp_hpc.submit_job(where, nodes=2, gpus=1, backend='local', stage=[{train!r}])\n"
            "    print('RESULT', json.dumps(job.result(timeout=120)), job.log_dir)\n"
            "    try:\n"
            "        ddp_hpc.submit_job(where, backend='local', stage=['nope'])\n"
            "    except ValueError as e:\n"
            "        print('REFUSED', str(e).splitlines()[0])\n")
    p = subprocess.run([PY, "-c", code], cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    [line] = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    value, log_dir = line[len("RESULT "):].rsplit(" ", 1)
    path, there, rank = json.loads(value)
    assert path.startswith(str(tmp_path / "local")) and there and rank == "0"
    assert sorted(e["method"] for e in _stage_events(Path(log_dir))) == ["copy", "reused"]  # one per node
    assert _staged_left(tmp_path) == []
    assert "REFUSED ddp_hpc.submit_job(stage=...) 'nope': " in p.stdout and "does not exist" in p.stdout


def _staged_left(tmp_path) -> list[str]:
    """Stage folders and locks left in the pretend nodes' TMPDIR (torch keeps its own files there)."""
    return [n for n in os.listdir(tmp_path / "local") if n.startswith("ddp_hpc-stage-")]


def _stage_events(log_dir: Path) -> list[dict]:
    return [e for _, s in sorted(log_events(log_dir).items()) for e in s.events if e["event"] == "stage"]


def _result(stdout: str, tag: str) -> dict:
    [line] = [ln for ln in stdout.splitlines() if ln.startswith(f"{tag}: ")]
    return json.loads(line.split(": ", 1)[1])


def test_a_plain_script_reads_a_staged_lmdb_on_two_pretend_nodes_and_status_shows_it(images, tmp_path):
    p = _cli(["--backend", "local", "-N", "2", "-G", "2", "--stage", f"{images / 'imgs.lmdb'}=TRAIN",
              "--log-dir", "runs", "--wait", FAST, "--batch-size", "8"], tmp_path)
    assert p.returncode == 0, p.stderr
    out = _result(p.stdout, "fast_data")
    assert out["kind"] == "LMDBDataset" and out["samples"] == 96 and out["ranks"] == 4
    assert out["data"].startswith(str(tmp_path / "local" / "ddp_hpc-stage-")) and out["data"].endswith("/imgs.lmdb")
    assert _staged_left(tmp_path) == []  # the last rank out removed the copy and its lock
    [log_dir] = (tmp_path / "runs").iterdir()
    events = _stage_events(log_dir)
    # one copy, 2 nodes: whichever node leader (rank 0 or 2) comes first copies, the other reuses it
    assert sorted(e["rank"] for e in events) == [0, 2]
    assert sorted(e["method"] for e in events) == ["copy", "reused"]
    assert {e["path"] for e in events} == {out["data"]} and {e["variable"] for e in events} == {"DDP_HPC_STAGE_TRAIN"}
    job = json.loads(next((tmp_path / "home" / "jobs").glob("*.json")).read_text())["id"]
    s = _cli([job], tmp_path, module="ddp_hpc.status")
    assert s.returncode == 0, s.stderr
    staging = [ln.strip() for ln in s.stdout.splitlines() if "$DDP_HPC_STAGE_TRAIN" in ln]
    assert staging[0].startswith("Staging: ") and len(staging) == 2, staging
    lines = sorted([staging[0][len("Staging: "):].strip(), staging[1]], key=lambda ln: " reused " in ln)
    assert re.match(rf"node[01]@\S+ +copy +{re.escape(str(images))}/imgs.lmdb -> \$DDP_HPC_STAGE_TRAIN +"
                    r"[\d.]+ MB in [\d.]+ s \(\d+ MB/s\)$", lines[0]), staging
    assert re.match(r"node[01]@\S+ +reused .* \(made by attempt local-\S+:\d\)$", lines[1]), staging
    assert {ln.split("@")[0] for ln in lines} == {"node0", "node1"}, staging


def test_a_lightning_datamodule_reads_a_staged_folder(images, tmp_path):
    pytest.importorskip("lightning")
    p = _cli(["--backend", "local", "-N", "2", "-G", "1", "--stage", f"{images / 'imgs'}=TRAIN",
              "--log-dir", "runs", "--wait", LIGHTNING, "--batch-size", "16"], tmp_path)
    assert p.returncode == 0, p.stderr
    out = _result(p.stdout, "lightning_data")
    assert out["kind"] == "ImageFolderDataset" and out["samples"] == 96 and out["ranks"] == 2
    assert out["data"].startswith(str(tmp_path / "local" / "ddp_hpc-stage-")) and out["data"].endswith("/imgs")
    assert _staged_left(tmp_path) == []
    events = _stage_events(next((tmp_path / "runs").iterdir()))
    assert sorted(e["method"] for e in events) == ["copy", "reused"] and events[0]["files"] == 96 + 1


def _docs_script(lmdb: Path) -> str:
    """docs/scripts.md's complete torchrun-style script, reading ``lmdb`` through the broadcast loader."""
    text = (ROOT / "docs" / "scripts.md").read_text()
    block = text[text.index("A complete torchrun-style script"):].split("```python\n", 1)[1].split("```", 1)[0]
    assert "broadcast = False" in block and '"/shared/imgs.lmdb"' in block
    return block.replace("broadcast = False", "broadcast = True").replace('"/shared/imgs.lmdb"', repr(str(lmdb)))


def test_the_documented_script_trains_on_the_lmdb_dataset_through_the_broadcast_loader(images, tmp_path):
    (tmp_path / "train.py").write_text(_docs_script(images / "imgs.lmdb"))
    p = _cli(["--backend", "local", "-N", "1", "-G", "2", "--log-dir", "runs", "--wait", "train.py"], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert re.search(r"^rank 0: loss \d+\.\d+$", p.stdout, re.M), p.stdout


def _one_rank(tmp_path, spec: str, exit_status: int):
    env = SimpleNamespace(rank=0, local_rank=0, local_world_size=1, node_rank=0, job_id="j1", restart_count=0)
    child = {SPEC_VAR: spec, "TMPDIR": str(tmp_path / "local")}
    (tmp_path / "local").mkdir(exist_ok=True)
    logged = []
    log = SimpleNamespace(info=logged.append, warning=logged.append, event=lambda name, **f: logged.append((name, f)))
    seen = {}

    def script():
        seen.update(child)
        return exit_status

    return run_staged(env, child, log, script), seen, logged


def test_a_preempted_script_keeps_its_copy_for_the_requeue_and_a_failed_staging_runs_nothing(images, tmp_path):
    spec = encode_items(parse_stage_items([f"{images / 'imgs.lmdb'}=TRAIN"]))
    status, seen, _ = _one_rank(tmp_path, spec, EX_TEMPFAIL)
    assert status == EX_TEMPFAIL and os.path.isfile(os.path.join(seen["DDP_HPC_STAGE_TRAIN"], "data.mdb"))
    assert SPEC_VAR not in seen  # the request is the wrapper's, not the script's
    again, seen2, logged = _one_rank(tmp_path, spec, 0)  # the requeue (same job) reuses it, then removes it
    assert again == 0 and seen2["DDP_HPC_STAGE_TRAIN"] == seen["DDP_HPC_STAGE_TRAIN"]
    assert [f["method"] for name, f in (x for x in logged if isinstance(x, tuple))] == ["reused"]
    assert _staged_left(tmp_path) == []
    gone = spec.replace(str(images / "imgs.lmdb"), str(tmp_path / "gone.lmdb"))
    status, seen, logged = _one_rank(tmp_path, gone, 0)
    assert status == 1 and seen == {}
    [(name, fields)] = [x for x in logged if isinstance(x, tuple)]
    assert name == "error" and fields["exc_type"] == "StageError" and "gone.lmdb" in fields["message"]


KEPT_LOADER = '''
import sys, weakref
import torch, torch.distributed as dist
from ddp_hpc.data import BroadcastLoader
from ddp_hpc.data.errors import IOConfigError

class Pairs(torch.utils.data.Dataset):
    def __len__(self): return 12
    def __getitem__(self, i): return torch.full((3,), float(i)), i % 2

dist.init_process_group("gloo")
loader = BroadcastLoader(Pairs(), batch_size=2, bucket_mb=0)   # kept to the end, never closed
for x, y in loader:
    pass
unfinished = iter(loader)
next(unfinished)                                                # an epoch left half-way
group = weakref.ref(loader.dataset.plan.level1[0])
dist.destroy_process_group()
try:
    iter(loader)
except IOConfigError:
    print("closed with the default group", flush=True)
print("its group freed:", group() is None, flush=True)
sys.exit(0 if group() is None else 3)
'''


def test_a_loader_kept_alive_through_destroy_process_group_exits_cleanly_every_time(tmp_path):
    """A script that never closes its BroadcastLoader (one epoch left half-way, its reader thread
    one bucket ahead): destroy_process_group() closes it and frees its group while the default group
    still exists, and every rank exits 0 -- 2 worlds of 2 gloo ranks side by side. (The close and
    the freed group are checked in every world: a loader left open fails each one; the repeats are
    for the exit, 4 ranks' teardown with the reader threads, each 2.5 s of CPU to start.)"""
    script = tmp_path / "kept.py"
    script.write_text(KEPT_LOADER)
    runs = [subprocess.Popen([PY, "-m", "ddp_hpc.launch", "--nodes", "1", "--procs-per-node", "2",
                              "--log-dir", str(tmp_path / f"w{i}"), "--", PY, str(script)],
                             cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [(p.communicate(timeout=240)[0], p.returncode) for p in runs]
    for out, rc in outs:
        assert rc == 0 and "OK: all 2 ranks exited 0" in out, out[-2000:]
        assert "closed with the default group" in out and "its group freed: True" in out, out[-2000:]
