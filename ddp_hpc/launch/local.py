"""The local command runner: a command once per rank, as N pretend nodes x G processes.

stdout+stderr of rank R go to ``log_dir/rankR.out`` (appended). The ``local`` submit backend and
``python -m ddp_hpc.launch -- CMD`` use it.
"""
from __future__ import annotations

import codecs
import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence, TextIO

from ddp_hpc.env import free_port, host_gpus
from ddp_hpc.exits import exit_status_of_signal, signal_name, signal_number
from ddp_hpc.judge.evidence import consequence_phrase
from ddp_hpc.launch.tree import (
    KILL_GRACE_S,
    LaunchError,
    local_rank_env,
    new_job_id,
    pretend_node_gpus,
    thread_env,
)
from ddp_hpc.runlogs.schema import rank_out
from ddp_hpc.text import shown_path


@dataclass
class LocalResult:
    """How a ``run_local`` run ended. ``returncodes[r]`` < 0 means killed by that signal."""

    returncodes: list[int]
    first_failed_rank: int | None
    log_dir: Path
    job_id: str
    pids: list[int] = field(default_factory=list)
    interrupted: str | None = None  # "SIGINT" / "SIGTERM" when the launcher was asked to stop

    @property
    def ok(self) -> bool:
        return self.first_failed_rank is None and self.interrupted is None

    @property
    def exitcode(self) -> int:
        """One process exit status for the whole run (the first failing rank's)."""
        if self.first_failed_rank is not None:
            rc = self.returncodes[self.first_failed_rank]
            return rc if rc > 0 else exit_status_of_signal(-rc if rc < 0 else 1)
        return exit_status_of_signal(signal_number(self.interrupted)) if self.interrupted else 0


class LocalRun:
    """A started set of rank processes (``start_local``); ``wait()`` gives the LocalResult.

    Each rank runs in its own session (process group) so that killing a rank also kills
    whatever it started (DataLoader workers, shells).
    """

    def __init__(self, argv: Sequence[str], *, nodes: int, procs_per_node: int,
                 log_dir: str | os.PathLike, env: Mapping[str, str] | None = None,
                 job_id: str | None = None, master_port: int | None = None):
        argv = [str(a) for a in argv]
        if not argv:
            raise LaunchError("run_local: empty command", "pass the program and its arguments, "
                              "e.g. ['python', '-m', 'ddp_hpc.run', 'jobs/demo.yaml']")
        if nodes < 1 or procs_per_node < 1:
            raise LaunchError(f"run_local: nodes={nodes} and procs_per_node={procs_per_node} "
                              "must both be >= 1")
        self.job_id = job_id or new_job_id()
        self.log_dir = Path(log_dir).resolve()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        base = dict(os.environ if env is None else env)
        base.update(thread_env(nodes * procs_per_node, base))
        counts = [procs_per_node] * nodes
        rank_envs = local_rank_env(counts, master_port or free_port(), self.job_id,
                                   gpus=pretend_node_gpus(counts, host_gpus(base)))
        self.procs: list[subprocess.Popen] = []
        self.log_paths: list[Path] = []
        self.log_starts: list[int] = []  # where this run's output begins in each (appended) log
        try:
            for rank, rank_env in enumerate(rank_envs):
                path = self.log_dir / rank_out(rank)
                with open(path, "ab") as log:  # append: never lose an earlier run's output
                    self.log_starts.append(log.tell())
                    self.procs.append(subprocess.Popen(
                        argv, env={**base, **rank_env}, stdin=subprocess.DEVNULL, stdout=log,
                        stderr=subprocess.STDOUT, start_new_session=True))
                self.log_paths.append(path)
        except BaseException:
            self.kill()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def send_signal(self, sig: int) -> None:
        """Deliver ``sig`` to every rank's whole process group."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    def kill(self, grace: float = KILL_GRACE_S, first: int = signal.SIGTERM,
             escalate: Callable[[], bool] = lambda: False) -> None:
        """Send ``first`` to every live rank group, SIGKILL after ``grace`` seconds (or as soon
        as ``escalate()`` turns true, e.g. a second Ctrl-C)."""
        self.send_signal(first)
        end = time.monotonic() + grace
        while (time.monotonic() < end and not escalate()
               and any(p.poll() is None for p in self.procs)):
            time.sleep(0.05)
        self.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def wait(self, poll: float = 0.2, stop_grace: float = 10.0,
             echo: TextIO | None = None) -> LocalResult:
        """Wait for all ranks; the first non-zero exit kills the others (SIGTERM, then SIGKILL
        after ``KILL_GRACE_S``).

        SIGINT / SIGTERM received meanwhile (main thread only) are forwarded to the ranks, which
        get ``stop_grace`` seconds to finish (e.g. write a checkpoint) before SIGKILL; a second
        signal kills at once. With ``echo``, rank 0's output is copied there as it is written.
        """
        first_failed = None
        with _caught_signals() as received, _echoing(self, echo) as echoed:
            while True:
                if received:
                    self.kill(stop_grace, first=received[0], escalate=lambda: len(received) > 1)
                    break
                codes = [p.poll() for p in self.procs]
                failed = [r for r, rc in enumerate(codes) if rc not in (None, 0)]
                if failed:
                    first_failed = failed[0]  # within one poll interval: the lowest rank
                    if echoed is not None and first_failed != 0:   # rank 0's own error is shown
                        echoed.failing.set()
                    self.kill()
                    break
                if all(rc is not None for rc in codes):
                    break
                time.sleep(poll)
        interrupted = signal_name(received[0]) if received else None
        return LocalResult([p.wait() for p in self.procs], first_failed, self.log_dir,
                           self.job_id, self.pids, interrupted)


@contextlib.contextmanager
def _caught_signals() -> Iterator[list[int]]:
    """Record SIGINT / SIGTERM in the yielded list instead of dying (main thread only)."""
    received: list[int] = []
    old = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, lambda s, _f: received.append(s))
    try:
        yield received
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


#: the first line of a Python traceback in a rank's output (torch prefixes each line of an
#: uncaught one with ``[rankN]: ``)
TRACEBACK_RE = re.compile(r"^(\[rank\d+\]:\s*)?Traceback \(most recent call last\):", re.MULTILINE)
#: a traceback rank 0 prints while it goes on running (caught and printed, a thread's) is shown
#: after this many seconds; one printed as the run breaks is held back (see `_Echo`)
HOLD_S = 2.0


class _Echo(threading.Thread):
    """Copies what is appended to one file, from ``start`` on, to ``out`` until stopped.

    A traceback is held back while the run may be breaking: when another rank fails, rank 0's
    own traceback ("Connection closed by peer") is only a consequence, and printed on the console
    it would hide the real error, which the driver prints from the judge once the run ended. So a
    traceback is shown once ``HOLD_S`` passed with rank 0 still running and no rank failed, or
    at the end when rank 0 failed first; when another rank failed first, or the traceback ends in
    the words of a lost peer, the held lines stay in the rank's file and one line says where.
    """

    def __init__(self, path: Path, start: int, out: TextIO, proc: subprocess.Popen | None = None,
                 poll: float = 0.1):
        super().__init__(name="ddp_hpc-echo", daemon=True)
        self.path, self.start_at, self.out, self.poll = path, start, out, poll
        self.proc = proc
        self.stopped = threading.Event()
        self.failing = threading.Event()   # a rank failed: hold tracebacks until the end
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.held: list[str] = []
        self.held_since = 0.0
        self.at_line_start = True

    def run(self) -> None:
        with open(self.path, "rb") as f:
            f.seek(self.start_at)
            while True:
                last = self.stopped.is_set()  # read once more after the stop: nothing is lost
                self._take(self.decoder.decode(f.read(), final=last))
                if self.held and not self.failing.is_set() and self.proc is not None \
                        and self.proc.poll() is None and time.monotonic() - self.held_since > HOLD_S \
                        and not self._lost_peer():
                    self._write("".join(self.held))   # rank 0 goes on: it was no ending
                    self.held = []
                if last:
                    self._finish()
                    return
                self.stopped.wait(self.poll)

    def _take(self, text: str) -> None:
        if not text:
            return
        if self.held:
            self.held.append(text)
            return
        m = TRACEBACK_RE.search(text)
        while m is not None and not (m.start() == 0 and self.at_line_start
                                     or m.start() > 0 and text[m.start() - 1] == "\n"):
            m = TRACEBACK_RE.search(text, m.end())
        if m is None:
            self._write(text)
            return
        self._write(text[:m.start()])
        self.held, self.held_since = [text[m.start():]], time.monotonic()

    def _lost_peer(self) -> bool:
        """The held traceback is rank 0's end (torch's ``[rankN]:`` prefix: an uncaught exception
        in a process group) in words of a lost peer ("Connection closed by peer", a collective's
        timeout: `judge.evidence.CONSEQUENCES`): rank 0 is a victim whichever rank the driver saw
        exit first (on a loaded machine the culprit's wrapper can take longer to exit than rank
        0's), and its process may take seconds to exit after printing it. A traceback it caught
        and printed has no prefix, whatever its words."""
        text = "".join(self.held)
        return text.startswith("[rank") and consequence_phrase(text) is not None

    def _finish(self) -> None:
        if not self.held:
            return
        text = "".join(self.held)
        if self.failing.is_set() or self._lost_peer():
            self._write(f"[ddp_hpc: rank 0's traceback ({text.count(chr(10))} lines) is in "
                        f"{shown_path(self.path)}]\n")
        else:
            self._write(text)

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()
            self.at_line_start = text.endswith("\n")


@contextlib.contextmanager
def _echoing(run: LocalRun, out: TextIO | None) -> Iterator[_Echo | None]:
    """Echo rank 0's log to ``out`` (if given) for the duration of the block."""
    if out is None:
        yield None
        return
    echo = _Echo(run.log_paths[0], run.log_starts[0], out, run.procs[0])
    echo.start()
    try:
        yield echo
    finally:
        echo.stopped.set()
        echo.join()


def start_local(argv: Sequence[str], *, nodes: int, procs_per_node: int,
                log_dir: str | os.PathLike, env: Mapping[str, str] | None = None,
                job_id: str | None = None) -> LocalRun:
    """Start ``argv`` once per rank with the local-launcher variables; do not wait."""
    return LocalRun(argv, nodes=nodes, procs_per_node=procs_per_node, log_dir=log_dir, env=env,
                    job_id=job_id)


def run_local(argv: Sequence[str], *, nodes: int, procs_per_node: int,
              log_dir: str | os.PathLike, env: Mapping[str, str] | None = None,
              job_id: str | None = None, poll: float = 0.2, stop_grace: float = 10.0,
              echo: TextIO | None = None) -> LocalResult:
    """Run ``argv`` once per rank (``nodes * procs_per_node`` processes) and wait.

    stdout+stderr of rank R go to ``log_dir/rankR.out`` (appended); with ``echo`` (e.g.
    ``sys.stdout``) rank 0's output is also copied there as it runs (the other ranks' output
    stays in their files, as with torchrun's ``--local-ranks-filter 0``).
    ``env`` replaces the inherited environment (the rank variables are added on top). When a
    rank exits non-zero the whole run is killed and ``first_failed_rank`` names it.
    SIGINT/SIGTERM to this process are forwarded to the ranks (``stop_grace`` seconds before
    SIGKILL).
    """
    return start_local(argv, nodes=nodes, procs_per_node=procs_per_node, log_dir=log_dir,
                       env=env, job_id=job_id).wait(poll, stop_grace, echo)
