"""Every command block of README.md runs as written (see tests/readme_blocks.py for the markers)."""

from __future__ import annotations

import os
import re
import time

import pytest
from readme_blocks import REPO, blocks, fresh_copy, newest_job_id, path_without_slurm, run_block, venv_points_at_repo

from ddp_hpc.cli import COMMANDS


def test_every_block_says_how_it_is_checked():
    found = blocks()
    assert found, "README.md has no bash blocks"
    unmarked = [b.line for b in found if b.kind not in ("run", "cluster", "skip")]
    assert not unmarked, f"README.md blocks at lines {unmarked} have no <!-- readme-check: ... --> marker"
    assert all(b.why for b in found if b.kind == "skip"), "a skipped block must say why"
    assert [b.kind for b in found].count("run") >= 4


def test_the_readmes_list_of_commands_is_the_one_ddp_hpc_help_shows():
    text = (REPO / "README.md").read_text()
    listed = re.search(r"`ddp-hpc ([a-z|]+)` \(`ddp-hpc --help`", text)
    assert listed, "README.md lost its `ddp-hpc a|b|c` (`ddp-hpc --help` ...) line"
    assert sorted(listed.group(1).split("|")) == sorted(COMMANDS)


def test_the_marker_parser_sees_a_missing_marker():
    text = "<!-- readme-check: run -->\n```bash\necho a\n```\n\n```bash\necho b\n```\n"
    assert [(b.kind, b.body) for b in blocks(text)] == [("run", "echo a\n"), ("", "echo b\n")]


@pytest.mark.slow
@pytest.mark.timeout(1800)   # 13 blocks of real jobs: 142-170 s on an idle 2-core CI machine, > 600 s under load
def test_readme_run_blocks_work_in_a_fresh_copy(tmp_path):
    work = fresh_copy(tmp_path / "repo")
    home = tmp_path / "ddp_hpc_home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDP_HPC_"))}
    env.update(DDP_HPC_HOME=str(home), PATH=path_without_slurm(tmp_path / "bin", env.get("PATH", "")))
    for b in blocks():
        if b.kind != "run":
            continue
        body = b.body.replace("JOBID", newest_job_id(home)) if "JOBID" in b.body else b.body
        t0 = time.monotonic()
        p = run_block(body, work, env, timeout=600)
        print(f"README.md:{b.line}: exit {p.returncode} in {time.monotonic() - t0:.1f} s")
        assert p.returncode == 0, (f"README.md block at line {b.line} failed:\n{body}\n"
                                   f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        assert venv_points_at_repo().startswith(str(REPO)), "the block re-installed ddp_hpc from the copy"
    record = home / "jobs"
    assert any(record.iterdir()), "the README's submit left no job record"
