"""ddp_hpc as a wheel install, not the editable one the other tests use: the wheel holds every file
of the package (the instrumentation's start-up folder ``instrument/site/`` is no package), and a
plain script run from a fresh venv with that wheel shows its steps in ``ddp-hpc status``.

Offline and quick: the wheel is built without build isolation by this venv's setuptools, installed
with ``--no-deps`` into a venv without pip whose ``.pth`` file points at this venv's packages (torch
and the rest resolve there; ddp_hpc comes from the wheel, which goes first on sys.path)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "plain_ddp.py"
#: rank and job variables of an enclosing launcher that must not leak into the job
DROP = re.compile(r"^(SLURM_\w+|SUBMITIT_\w+|TORCHELASTIC_\w+|TORCH_NCCL_\w+|TORCH_FR_\w+|RANK|LOCAL_RANK|WORLD_SIZE"
                  r"|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_\w+|MASTER_ADDR|MASTER_PORT|DDP_HPC_\w+"
                  r"|CUDA_VISIBLE_DEVICES|PYTHONPATH|PYTHONHOME|VIRTUAL_ENV)$")


def _run(argv: list, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=170, **kw)
    assert p.returncode == 0, f"{argv}\n{p.stdout}\n{p.stderr}"
    return p


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of this source tree, built from a copy (no build/ or egg-info left in the tree)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "ddp_hpc", src / "ddp_hpc", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", tmp / "dist", src])
    (whl,) = (tmp / "dist").glob("ddp_hpc-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed; this venv's packages behind it through a .pth file."""
    v = tmp_path_factory.mktemp("venv") / "v"
    _run([sys.executable, "-m", "venv", "--without-pip", v])
    py = v / "bin" / "python"
    purelib = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    ours = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    Path(purelib, "_ddp_hpc_test_venv.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    _run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", "--no-index", wheel])
    return v


def test_the_wheel_holds_every_file_of_the_package(wheel):
    tree = {p.relative_to(ROOT).as_posix() for p in (ROOT / "ddp_hpc").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
    with zipfile.ZipFile(wheel) as z:
        packed = {n for n in z.namelist() if n.startswith("ddp_hpc/")}
    assert "ddp_hpc/instrument/site/sitecustomize.py" in tree
    assert tree - packed == set(), "files of ddp_hpc/ missing from the wheel (setup.cfg's package_data)"


@pytest.mark.timeout(300)
def test_a_plain_script_from_a_wheel_install_shows_its_steps_in_status(venv, tmp_path):
    bin_dir = venv / "bin"
    env = {k: v for k, v in os.environ.items() if not DROP.match(k)}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", DDP_HPC_HOME=str(tmp_path / "home"),
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    where = _run([bin_dir / "python", "-c", "import ddp_hpc; print(ddp_hpc.__file__)"], env=env, cwd=tmp_path)
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout    # the wheel's, not the tree's
    _run([bin_dir / "ddp-hpc", "submit", "--backend", "local", "-N", "1", "-G", "2", "--wait",
          "--log-dir", tmp_path / "runs", SCRIPT, "--steps", "4"], env=env, cwd=tmp_path)
    (record,) = (tmp_path / "home" / "jobs").glob("*.json")
    job = json.loads(record.read_text())
    assert Path(job["command"][0]).parent == bin_dir, job["command"]
    st = json.loads(_run([bin_dir / "ddp-hpc", "status", job["id"], "--json"], env=env, cwd=tmp_path).stdout)
    assert st["state"] == "COMPLETED", st
    # loss and steps/s come only from the instrumentation's step events (the script reports nothing)
    progress = st["progress"]
    assert progress["step"] == 4 and progress["loss"] is not None and progress["steps_per_s"], progress
