"""Every ``ddp-hpc`` command answers a typo with the nearest flag or subcommand (text.ArgumentParser),
run as a user runs it: the real command line in a subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddp_hpc", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("argv, guess", [
    (["sttaus"], "`status`"),
    (["status", "--limt", "3"], "`--limit`"),
    (["env", "--chekc"], "`--check`"),
    (["data", "pakc"], "`pack`"),
    (["testcluster", "stauts"], "`status`"),
    (["cancel", "--grcae", "5", "1"], "`--grace`"),
    (["records", "regster"], "`register`"),
])
def test_a_typo_gets_did_you_mean(argv, guess):
    p = _run(*argv)
    assert p.returncode == 2, p.stderr
    assert f"(did you mean {guess}?)" in p.stderr, p.stderr


def test_nothing_close_gets_no_guess():
    p = _run("zzzzzz")
    assert p.returncode == 2 and "invalid choice: 'zzzzzz'" in p.stderr
    assert "did you mean" not in p.stderr
