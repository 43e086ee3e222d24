"""The local backend and this machine's GPUs: it counts them (CUDA_VISIBLE_DEVICES, else
``nvidia-smi -L``; never torch), refuses a layout they cannot hold before anything starts, and
gives each pretend node GPUs of its own. A machine without a GPU runs any layout on the CPU.
A stand-in ``nvidia-smi`` on PATH plays the GPUs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_hpc.env import HostGpus, host_gpus
from ddp_hpc.launch.tree import LaunchError, local_rank_env, pretend_node_gpus

PY = sys.executable
SCRIPT = "import os; print('SEEN', os.environ['RANK'], os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>'))\n"


def _smi_dir(tmp_path: Path, gpus: int) -> Path:
    """A folder with a stand-in ``nvidia-smi`` that lists ``gpus`` GPUs."""
    bindir = tmp_path / f"smi{gpus}"
    bindir.mkdir()
    smi = bindir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f'echo "GPU {i}: NVIDIA Stand-in (UUID: GPU-{i})"\n'
                                           for i in range(gpus)))
    smi.chmod(0o755)
    return bindir


def _env(tmp_path: Path, gpus: int | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "DDP_HPC_")) and k != "CUDA_VISIBLE_DEVICES"}
    path = [p for p in env.get("PATH", "").split(os.pathsep)
            if not (Path(p) / "sbatch").exists() and not (Path(p) / "nvidia-smi").exists()]
    if gpus is not None:
        path.insert(0, str(_smi_dir(tmp_path, gpus)))
    env.update(PATH=os.pathsep.join(path), DDP_HPC_HOME=str(tmp_path / "home"), **extra)
    return env


def _submit(tmp_path: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "seen.py"
    script.write_text(SCRIPT)
    return subprocess.run([PY, "-m", "ddp_hpc.submit", "--backend", "local", *args, str(script)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_host_gpus_reads_cuda_visible_devices_then_nvidia_smi(tmp_path):
    assert host_gpus({"CUDA_VISIBLE_DEVICES": "0"}).ids == ("0",)
    assert host_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}).ids == ("2", "3")
    assert host_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,2"}).ids == ("0",)   # CUDA stops at -1
    assert host_gpus({"CUDA_VISIBLE_DEVICES": ""}).ids == ()
    smi = _smi_dir(tmp_path, 3)
    found = host_gpus({"PATH": str(smi)})
    assert found == HostGpus(("0", "1", "2"), "`nvidia-smi -L` lists 3")
    assert host_gpus({"PATH": str(smi), "CUDA_VISIBLE_DEVICES": "1"}).ids == ("1",)   # the variable wins
    assert host_gpus({"PATH": str(tmp_path / "nothing")}).ids == ()


def test_each_pretend_node_gets_gpus_of_its_own():
    four = HostGpus(("0", "1", "2", "3"), "test")
    assert pretend_node_gpus([2, 2], four) == ["0,1", "2,3"]
    assert pretend_node_gpus([1], four) == ["0"]
    assert pretend_node_gpus([3, 1], four) == ["0,1,2", "3"]
    assert pretend_node_gpus([8, 8], HostGpus((), "none")) is None          # CPU: any layout
    with pytest.raises(LaunchError, match=r"5 ranks .* this machine has 4 \(test\)"):
        pretend_node_gpus([4, 1], four)
    envs = local_rank_env([1, 1], 29500, "j", gpus=["0", "1"])
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1"]
    assert "CUDA_VISIBLE_DEVICES" not in local_rank_env([1, 1], 29500, "j")[0]


def test_more_gpus_than_nvidia_smi_lists_is_refused_with_the_fix(tmp_path):
    done = _submit(tmp_path, _env(tmp_path, gpus=1), "-N", "1", "-G", "2")
    assert done.returncode == 2, done.stderr
    assert ("--nodes 1 --gpus 2 asks the local backend for 2 GPUs (one per rank), but this machine "
            "has 1 GPU (`nvidia-smi -L` lists 1)") in done.stderr
    assert "HINT: use --nodes 1 --gpus 1" in done.stderr and "CUDA_VISIBLE_DEVICES= " in done.stderr
    assert not (tmp_path / "runs").exists()      # refused before any directory or process


def test_cuda_visible_devices_counts_and_pretend_nodes_need_their_own(tmp_path):
    done = _submit(tmp_path, _env(tmp_path, gpus=4, CUDA_VISIBLE_DEVICES="0"), "-N", "2", "-G", "1",
                   "--dry-run")
    assert done.returncode == 2
    assert "2 GPUs (one per rank), but this machine has 1 GPU (CUDA_VISIBLE_DEVICES='0')" in done.stderr


@pytest.mark.parametrize("extra", [{"CUDA_VISIBLE_DEVICES": ""}, {}])
def test_no_gpu_keeps_any_layout_on_the_cpu(tmp_path, extra):
    done = _submit(tmp_path, _env(tmp_path, gpus=1 if extra else None, **extra), "-N", "2", "-G", "2",
                   "--wait")
    assert done.returncode == 0, done.stderr
    seen = sorted(line for f in (tmp_path / "runs").glob("*/rank*.out")
                  for line in f.read_text().splitlines() if line.startswith("SEEN"))
    expect = extra.get("CUDA_VISIBLE_DEVICES", "<unset>")
    assert seen == [f"SEEN {r} {expect}" for r in range(4)]


def test_pretend_nodes_see_their_own_gpus(tmp_path):
    done = _submit(tmp_path, _env(tmp_path, gpus=4), "-N", "2", "-G", "2", "--wait")
    assert done.returncode == 0, done.stderr
    seen = sorted(line for f in (tmp_path / "runs").glob("*/rank*.out")
                  for line in f.read_text().splitlines() if line.startswith("SEEN"))
    assert seen == ["SEEN 0 0,1", "SEEN 1 0,1", "SEEN 2 2,3", "SEEN 3 2,3"]
