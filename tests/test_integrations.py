"""Lightning and Hugging Face Trainer scripts, unchanged, under ``ddp-hpc submit -N 2 -G 1 --wait``
(HF's: ``-N 1 -G 2``) on the local backend: ``ddp-hpc status`` shows their progress (total and loss included), rank 0
writes TensorBoard files (read back with TensorBoard's reader); Lightning's entry points act only
inside a job; the Trainer patch; W&B's run id per job (a restart's TensorBoard steps: test_tboard.py,
and a real requeue in tests/cluster/test_status_cluster.py)."""
from __future__ import annotations

import importlib.util
import os
import pickle
import re
import subprocess
import sys
import types
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ddp_hpc import records
from ddp_hpc.env.tracking import wandb_environ
from ddp_hpc.judge.nodefiles import rank_events
from ddp_hpc.runlogs import tboard

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
#: the exec wrapper's bootstrap calls ddp_hpc.integrations.register; a stand-in until it exists
BOOTSTRAP = ROOT / "tests" / "bootstrap_site"


def _env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "DDP_HPC_", "WANDB_", "TORCHELASTIC_"))}
    env.update({"PATH": os.path.dirname(PY), "DDP_HPC_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1",
                "PYTHONPATH": str(ROOT), **extra})
    return env


def _run(tmp_path, *args, env=None, timeout=240):
    return subprocess.run([PY, *args], cwd=tmp_path, env=env or _env(tmp_path), capture_output=True,
                          text=True, timeout=timeout)


def _scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _job(tmp_path) -> records.JobRecord:
    (rec,) = records.list_records({"DDP_HPC_HOME": str(tmp_path / "home")})
    return rec


def test_lightning_loads_the_callback_only_inside_a_job(tmp_path, monkeypatch):
    import lightning.pytorch as lp
    import pytorch_lightning as pl

    def names(package):
        trainer = package.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                  enable_progress_bar=False, enable_model_summary=False)
        return [type(cb).__name__ for cb in trainer.callbacks]

    monkeypatch.delenv("DDP_HPC_LOG_DIR", raising=False)
    assert names(lp) == [] and names(pl) == []
    monkeypatch.setenv("DDP_HPC_LOG_DIR", str(tmp_path))
    assert names(lp) == ["LightningProgress"] and names(pl) == ["PytorchLightningProgress"]
    from ddp_hpc.integrations.lightning import lightning_callbacks, pytorch_lightning_callbacks

    (cb,), (old,) = lightning_callbacks(), pytorch_lightning_callbacks()
    assert isinstance(cb, lp.Callback) and isinstance(old, pl.Callback) and not isinstance(cb, pl.Callback)
    assert type(pickle.loads(pickle.dumps(cb))) is type(cb)


def test_lightning_script_unchanged_2x1_status_and_tensorboard(tmp_path):
    """Lightning's multi-node layout on 2 pretend nodes of one rank each: nothing asserted here is
    about ranks sharing a node (the torchrun variables of a 2 x 2 job: tests/test_exec.py)."""
    script = str(ROOT / "examples" / "lightning_trainer.py")
    p = _run(tmp_path, "-m", "ddp_hpc.submit", "-N", "2", "-G", "1", "--wait", script,
             "--devices", "1", "--num-nodes", "2", "--epochs", "1", "--samples", "128")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rec = _job(tmp_path)
    # 128 samples / (16 per batch x 2 ranks) = 4 steps an epoch
    detail = _run(tmp_path, "-m", "ddp_hpc.status", rec.id).stdout
    assert re.search(r"Progress:   e0 s4/4 100%, loss [\d.]+, [\d.]+ samples/s", detail), detail
    assert re.search(r"Eval:       val_loss=[\d.]+ \(step 4\)", detail), detail
    assert f"TensorBoard: tensorboard --logdir {rec.log_dir}" in detail
    got = _scalars(rec.log_dir)
    assert [s for s, _ in got["train/loss"]][-1] == 4 and [s for s, _ in got["eval/val_loss"]] == [4]
    assert "train_loss" in got and "train/samples_per_s" in got
    assert len(tboard.event_files(rec.log_dir)) == 1


def test_hf_trainer_script_unchanged_1x2_shows_progress(tmp_path):
    # one pretend node of 2 ranks: 4 ranks importing transformers cost twice as much and assert
    # nothing more (the 2-node layout: the Lightning test here, HF's in test_frameworks_cluster.py)
    extra = {} if importlib.util.find_spec("ddp_hpc.instrument") else {"PYTHONPATH": f"{BOOTSTRAP}:{ROOT}"}
    p = _run(tmp_path, "-m", "ddp_hpc.submit", "-N", "1", "-G", "2", "--wait",
             str(ROOT / "examples" / "hf_trainer.py"), "--max-steps", "6",
             env=_env(tmp_path, **extra))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rec = _job(tmp_path)
    detail = _run(tmp_path, "-m", "ddp_hpc.status", rec.id).stdout
    assert re.search(r"Progress:   e0 s6/6 100%, loss [\d.]+, [\d.]+ samples/s", detail), detail
    assert "Eval:       eval_loss=" in detail
    events = rank_events(rec.log_dir, 0).events
    final = [e for e in events if e["event"] == "step"][-1]
    assert final["step"] == final["total_steps"] == 6 and final["lr"] > 0
    assert [s for s, _ in _scalars(rec.log_dir)["train/loss"]][-1] == 6


def test_register_adds_the_trainer_callback_once_inside_a_job(tmp_path, monkeypatch):
    from ddp_hpc import integrations

    hooks = []
    integrations.register(lambda name, callback: hooks.append((name, callback)))
    ((name, callback),) = hooks
    assert name == "transformers.trainer"
    fake = types.SimpleNamespace(DEFAULT_CALLBACKS=["flow"])
    monkeypatch.delenv("DDP_HPC_LOG_DIR", raising=False)
    callback(fake)
    assert fake.DEFAULT_CALLBACKS == ["flow"]                 # outside a job: nothing
    monkeypatch.setenv("DDP_HPC_LOG_DIR", str(tmp_path))
    callback(fake)
    callback(fake)
    from transformers.trainer_callback import TrainerCallback

    assert fake.DEFAULT_CALLBACKS[0] == "flow" and len(fake.DEFAULT_CALLBACKS) == 2
    assert issubclass(fake.DEFAULT_CALLBACKS[1], TrainerCallback)


WANDB_SCRIPT = ("import wandb\n"
                "run = wandb.init(project='p', mode='offline')\n"
                "run.log({'loss': 1.0})\n"
                "print('RUN', run.id, flush=True)\n"
                "run.finish()\n")


def test_wandb_run_id_is_one_per_job_and_the_user_s_wins():
    child = {"DDP_HPC_JOB_ID": "1234_5", "DDP_HPC_LOG_DIR": "/runs/a"}
    ids = wandb_environ(child)
    assert ids["WANDB_RESUME"] == "allow" and re.fullmatch(r"1234_5-[0-9a-f]{8}", ids["WANDB_RUN_ID"])
    assert wandb_environ(dict(child)) == ids                                   # a requeue: the same
    assert wandb_environ({**child, "DDP_HPC_LOG_DIR": "/runs/b"})["WANDB_RUN_ID"] != ids["WANDB_RUN_ID"]
    assert wandb_environ({**child, "WANDB_RUN_ID": "mine", "WANDB_RESUME": "never"}) == {}
    assert wandb_environ({"DDP_HPC_LOG_DIR": "/runs/a"}) == {}                 # no job: nothing


def test_a_requeued_script_job_continues_its_wandb_run(tmp_path):
    """wandb in offline mode under the exec wrapper, twice as one job (restart 0, then 1)."""
    def run_id(restart: str) -> str:
        env = _env(tmp_path, DDP_HPC_JOB_ID="local-a", DDP_HPC_RESTART_BASE=restart, WANDB_SILENT="true")
        p = _run(tmp_path, "-m", "ddp_hpc.exec", "--log-dir", str(tmp_path / "run"), "--", PY, "-c",
                 WANDB_SCRIPT, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
        return re.search(r"^RUN (\S+)$", p.stdout, re.M).group(1)

    first = run_id("0")
    assert first.startswith("local-a-") and run_id("1") == first
    # both runs went to one W&B run (offline runs are named by their id)
    assert len(list((tmp_path / "wandb").glob(f"offline-run-*-{first}"))) == 2
