"""Preemption pieces in one process: the handler only sets a flag (real signals), time limit vs
preemption classification, the end-time sources, and who requeues."""
from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import pytest

from ddp_hpc.train import preempt
from ddp_hpc.train.preempt import PreemptionFlag, classify, job_end_time, preempt_signum, requeue_if_wanted


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
    assert preempt_signum("usr2") == signal.SIGUSR2
    with pytest.raises(AttributeError):
        preempt_signum("USR9")


def test_time_limit_is_told_from_preemption_by_the_distance_to_the_end_time():
    now = 1_000_000.0
    assert classify(now, now + 60, 180) == "timelimit"       # --signal=USR2@60, or the final TERM
    assert classify(now, now - 5, 180) == "timelimit"        # already past the limit
    assert classify(now, now + 3600, 180) == "preemption"    # scancel --signal=USR2 long before
    assert classify(now, None, 180) == "preemption"          # end time unknown


LOCAL = SimpleNamespace(launcher="local", in_slurm=False, job_id=None)
SLURM = SimpleNamespace(launcher="slurm", in_slurm=True, job_id="77_3")


@pytest.mark.parametrize("environ, env, squeue_end, expected", [
    ({"SLURM_JOB_END_TIME": "1700000000"}, SLURM, 5.0, 1700000000.0),   # the variable wins
    ({"DDP_HPC_JOB_END_TIME": "12.5"}, LOCAL, None, 12.5),
    ({"SLURM_JOB_END_TIME": "Unknown"}, LOCAL, None, None),
    ({}, LOCAL, 5.0, None),                                              # outside Slurm: no squeue
    ({}, SLURM, 5.0, 5.0),                                               # squeue's EndTime
])
def test_end_time_sources(monkeypatch, environ, env, squeue_end, expected):
    asked = []
    monkeypatch.setattr(preempt, "slurm_end_time", lambda job: asked.append(job) or squeue_end)
    assert job_end_time(env, rank=0, distributed=False, environ=environ) == expected
    assert asked == (["77_3"] if env is SLURM and not environ else [])


class _Log:
    def __init__(self):
        self.lines, self.events = [], []

    def info(self, msg):
        self.lines.append(msg)

    def warning(self, msg):
        self.lines.append("WARNING: " + msg)

    def event(self, name, **fields):
        self.events.append((name, fields))


@pytest.mark.parametrize("signum, env, rank, enabled, expected", [
    (signal.SIGUSR2, SLURM, 0, True, ["77_3"]),     # the preemption signal: rank 0 requeues
    (signal.SIGTERM, SLURM, 0, True, []),           # scancel / Slurm's own TERM: never
    (signal.SIGUSR2, SLURM, 1, True, []),           # only rank 0
    (signal.SIGUSR2, SLURM, 0, False, []),          # preempt.requeue=false
    (signal.SIGUSR2, LOCAL, 0, True, []),           # outside Slurm: exit code 75 instead
])
def test_only_rank_0_requeues_its_slurm_job_for_the_preemption_signal(monkeypatch, signum, env,
                                                                      rank, enabled, expected):
    calls = []
    monkeypatch.setattr(preempt.SlurmCLI, "requeue", lambda self, job, exclude=(): calls.append(job))
    flag = PreemptionFlag("USR2")
    flag._handler(signum, None)
    flag.poll(distributed=False)
    log = _Log()
    assert requeue_if_wanted(flag, env, rank=rank, enabled=enabled, distributed=False,
                             log=log) == bool(expected)
    assert calls == expected
    assert [e for e, _ in log.events] == ["requeue"] * len(expected)


def _agree(rank, world_size, signals):
    """Each rank raises its own signal (or none); returns what the flag all_reduce agreed."""
    from ddp_hpc.dist import cleanup_ddp, setup_ddp

    setup_ddp()
    flag = PreemptionFlag("USR2").install()
    try:
        if signals[rank]:
            os.kill(os.getpid(), preempt_signum(signals[rank]))
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
