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


@pytest.mark.parametrize("message", [
    "argument command: invalid choice: 'sttaus' (choose from 'submit', 'status', 'cancel')",   # <= 3.12.6
    "argument command: invalid choice: 'sttaus' (choose from submit, status, cancel)",         # 3.12.7+, 3.13
    "argument command: invalid choice: 'sttaus', maybe you meant 'status'? (choose from submit, status, cancel)",
])
def test_an_invalid_choice_gets_did_you_mean_in_each_pythons_words(message):
    """argparse's message differs between Python versions (the choices quoted or not, 3.14's own
    guess); the nearest choice is found in each."""
    from ddp_hpc.text import did_you_mean
    assert did_you_mean(message, []) == " (did you mean `status`?)"
