"""Preemption pieces in one process: the handler only sets a flag (real signals), time limit vs
preemption classification, and the end-time sources."""
from __future__ import annotations

import os
import signal
import time

import pytest

from ddp_hpc.train.preempt import PreemptionFlag, classify, job_end_time, signal_number


def test_signal_only_sets_a_flag_and_handlers_are_restored():
    before_usr2 = signal.getsignal(signal.SIGUSR2)
    before_term = signal.getsignal(signal.SIGTERM)
    flag = PreemptionFlag("USR2").install()
    try:
        assert not flag.poll(distributed=False)
        os.kill(os.getpid(), signal.SIGUSR2)        # real delivery; the process keeps running
        time.sleep(0.01)
        assert flag.poll(distributed=False) and flag.received == signal.SIGUSR2
        assert flag.requeue_wanted                    # the preemption signal asks for a requeue
        os.kill(os.getpid(), signal.SIGTERM)        # SIGTERM is caught too; the first one wins
        time.sleep(0.01)
        assert flag.received == signal.SIGUSR2
    finally:
        flag.restore()
    assert signal.getsignal(signal.SIGUSR2) == before_usr2
    assert signal.getsignal(signal.SIGTERM) == before_term


def test_sigterm_alone_sets_the_flag_and_a_configured_signal_is_used():
    flag = PreemptionFlag("SIGUSR1").install()
    try:
        assert signal.SIGUSR1 in flag.signums and signal.SIGTERM in flag.signums
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert flag.received == signal.SIGTERM
        # SIGTERM (a plain scancel, Slurm's own preemption or time limit) stops without a requeue
        assert flag.poll(distributed=False) and not flag.requeue_wanted
    finally:
        flag.restore()
    assert signal_number("usr2") == signal.SIGUSR2
    with pytest.raises(AttributeError):
        signal_number("USR9")


def test_time_limit_is_told_from_preemption_by_the_distance_to_the_end_time():
    now = 1_000_000.0
    assert classify(now, now + 60, 180) == "timelimit"       # --signal=USR2@60, or the final TERM
    assert classify(now, now - 5, 180) == "timelimit"        # already past the limit
    assert classify(now, now + 3600, 180) == "preemption"    # scancel --signal=USR2 long before
    assert classify(now, None, 180) == "preemption"          # end time unknown


def test_end_time_sources():
    assert job_end_time({"SLURM_JOB_END_TIME": "1700000000"}) == 1700000000.0
    assert job_end_time({"DDP_HPC_JOB_END_TIME": "12.5"}) == 12.5
    assert job_end_time({"SLURM_JOB_END_TIME": "Unknown"}) is None
    assert job_end_time({}) is None


def _agree(rank, world_size, signals):
    """Each rank raises its own signal (or none); returns what the flag all_reduce agreed."""
    from ddp_hpc.dist import cleanup_ddp, setup_ddp

    setup_ddp()
    flag = PreemptionFlag("USR2").install()
    try:
        if signals[rank]:
            os.kill(os.getpid(), signal_number(signals[rank]))
            time.sleep(0.01)
        assert not flag.poll(distributed=True)     # the decision lands one check later
        assert flag.poll(distributed=True)
        return flag.agreed, flag.requeue_wanted
    finally:
        flag.drain()
        flag.restore()
        cleanup_ddp()


@pytest.mark.parametrize("signals, expected", [
    ((None, "TERM"), (PreemptionFlag.TERMINATE, False)),
    (("TERM", "USR2"), (PreemptionFlag.PREEMPT, True)),
    ((None, "USR2"), (PreemptionFlag.PREEMPT, True)),
])
def test_all_ranks_agree_which_signal_arrived(signals, expected):
    from ddp_hpc.launch import launch_distributed

    assert launch_distributed(_agree, 2, args=(signals,), timeout=120) == [expected, expected]
