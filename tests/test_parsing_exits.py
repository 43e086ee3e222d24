"""The two bottom-layer helpers: tolerant number parsing (ddp_hpc.parsing) and how a process ends
(ddp_hpc.exits), with what each caller relies on."""
from __future__ import annotations

import signal

import pytest

from ddp_hpc import exits
from ddp_hpc.env.job import job_facts
from ddp_hpc.parsing import to_float, to_int
from ddp_hpc.train.preempt import SignalNameError, preempt_signum


@pytest.mark.parametrize("value, expected", [
    ("3", 3), (" 3 ", 3), (3, 3), ("-1", -1), (2.9, 2),     # int(): strips, truncates a float
    ("2.0", None), ("", None), (None, None), ("abc", None), ([1], None)])
def test_to_int(value, expected):
    assert to_int(value) == expected


def test_to_int_default_is_the_callers():
    assert to_int("x", 0) == 0 and to_int(None, -1) == -1 and to_int("7", 0) == 7
    keep = object()
    assert to_int("?", keep) is keep


@pytest.mark.parametrize("value, expected", [
    ("1.5", 1.5), ("1e3", 1000.0), (2, 2.0), (" 4 ", 4.0), ("", None), (None, None), ("abc", None)])
def test_to_float(value, expected):
    assert to_float(value) == expected


def test_to_float_default_is_the_callers():
    assert to_float(None, 0.0) == 0.0 and to_float("x", 1.5) == 1.5 and to_float("2", 0.0) == 2.0


def test_job_end_time_falls_back_when_unset_empty_or_not_a_number():
    assert job_facts({"SLURM_JOB_END_TIME": "1700000000"}).end_time == 1700000000.0
    assert job_facts({"SLURM_JOB_END_TIME": "", "DDP_HPC_JOB_END_TIME": "12.5"}).end_time == 12.5
    assert job_facts({"SLURM_JOB_END_TIME": "soon"}).end_time is None
    assert job_facts({}).end_time is None


def test_requeue_exit_code_is_ex_tempfail():
    assert exits.EX_TEMPFAIL == 75


@pytest.mark.parametrize("signum, name", [(9, "SIGKILL"), (15, "SIGTERM"), (99, "signal 99")])
def test_signal_name(signum, name):
    assert exits.signal_name(signum) == name


def test_signal_text():
    assert exits.signal_text(9) == "signal 9 (SIGKILL)"
    assert exits.signal_text(99) == "signal 99"


@pytest.mark.parametrize("spec, number", [
    ("SIGKILL", 9), ("KILL", 9), ("kill", 9), (" usr2 ", int(signal.SIGUSR2)), (9, 9), ("9", 9),
    ("NOPE", None), ("", None), (None, None), ("_DFL", None)])
def test_signal_number(spec, number):
    assert exits.signal_number(spec) == number


def test_signal_number_names_only():
    assert exits.signal_number("USR2", numbers=False) == signal.SIGUSR2
    assert exits.signal_number("9", numbers=False) is None
    assert exits.signal_number(9, numbers=False) is None


def test_exit_status_and_signal_go_both_ways():
    assert exits.exit_status_of_signal(9) == 137
    assert exits.signal_of_exit_status(137) == 9
    assert [exits.signal_of_exit_status(c) for c in (0, 1, 75, 128)] == [None] * 4


def test_a_subprocess_return_code_as_a_shells_exit_status():
    import subprocess
    import sys
    killed = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    assert killed.wait() == -9 and exits.exit_status_of_returncode(killed.returncode) == 137
    exited = subprocess.run([sys.executable, "-c", "raise SystemExit(3)"])
    assert exits.exit_status_of_returncode(exited.returncode) == 3
    assert exits.exit_status_of_returncode(0) == 0 and exits.exit_status_of_returncode(None) == 1


def test_preempt_signum_raises_a_hint_error_that_is_an_attribute_error():
    assert preempt_signum("SIGUSR1") == signal.SIGUSR1
    for bad in ("USR9", "9", ""):
        with pytest.raises(AttributeError) as info:
            preempt_signum(bad)
        assert isinstance(info.value, SignalNameError)
        assert "HINT: use a name such as USR2" in str(info.value)
