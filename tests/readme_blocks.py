"""README.md's command blocks, as the tests run them (tests/test_readme.py here, and
tests/cluster/test_readme_cluster.py on the test cluster), so the README cannot drift.

Every ```bash block in README.md is preceded by a marker comment that says how it is checked::

    <!-- readme-check: run -->       run here, in order, in a fresh copy of the repository
    <!-- readme-check: cluster -->   run on the test cluster, in order
    <!-- readme-check: skip (why) -->  not run; the reason is required

The copy is a clean working directory with the repository's tracked files and a link to its
`.venv`, so commands that make data folders or run directories start from nothing, as for a
newcomer. ``JOBID`` in a block stands for the newest job the earlier blocks submitted.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(?:<!--\s*readme-check:\s*(?P<kind>\w+)(?P<why>[^>]*?)\s*-->\s*\n)?```bash\n(?P<body>.*?)```",
                   re.S)


@dataclass
class Block:
    kind: str          # run | cluster | skip | "" (no marker)
    why: str
    body: str
    line: int


def blocks(text: str | None = None) -> list[Block]:
    text = (REPO / "README.md").read_text() if text is None else text
    return [Block(m["kind"] or "", (m["why"] or "").strip(), m["body"], text.count("\n", 0, m.start("body")) + 1)
            for m in BLOCK.finditer(text)]


def fresh_copy(dest: Path) -> Path:
    """The tracked files of the repository in ``dest`` and a link to its venv.

    `scripts/setup.sh` runs in the repository first, so the venv is complete; the copied
    requirements and setup.cfg get old times, so the copy's `scripts/setup.sh` sees the linked venv
    as up to date and never re-installs ddp_hpc from the copy (`venv_points_at_repo` checks)."""
    subprocess.run(["/bin/bash", str(REPO / "scripts" / "setup.sh")], check=True, capture_output=True)
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    for rel in ("requirements-ci.txt", "setup.cfg"):
        os.utime(dest / rel, (0, 0))
    (dest / ".venv").symlink_to(REPO / ".venv")
    return dest


SLURM_PROGRAMS = ("sbatch", "srun", "squeue", "sacct", "scontrol", "sinfo", "scancel", "salloc", "sbcast")


def path_without_slurm(bin_dir: Path, path: str) -> str:
    """A PATH that finds every program of ``path`` except Slurm's: ``bin_dir`` gets a link to each.
    With it `submit` sees no Slurm and takes the local default, as on a laptop."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for d in filter(None, path.split(os.pathsep)):
        if not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            link, target = bin_dir / name, os.path.join(d, name)
            if (name.startswith(SLURM_PROGRAMS) or link.exists() or link.is_symlink()
                    or not os.access(target, os.X_OK)):
                continue
            link.symlink_to(target)
    return str(bin_dir)


def venv_points_at_repo() -> str:
    """Where the venv's ddp_hpc lives, seen from outside any checkout (must be this repository)."""
    return subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-c", "import ddp_hpc; print(ddp_hpc.__file__)"],
                          cwd="/", capture_output=True, text=True).stdout.strip()


def newest_job_id(ddp_hpc_home: Path) -> str:
    from ddp_hpc.records import list_records

    recs = list_records({"DDP_HPC_HOME": str(ddp_hpc_home)})
    assert recs, f"no job recorded under {ddp_hpc_home} by the blocks before"
    return recs[-1].id


def run_block(body: str, cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["/bin/bash", "-euo", "pipefail", "-c", body], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
