"""``python -m ddp_hpc.exec [--log-dir DIR] [--] CMD [ARGS...]``: one rank of a script job.

Every rank runs this wrapper (under srun, submitit, or ``ddp-hpc launch``).  It derives the rank
facts with `ddp_hpc.env.detect` (refusing a setup that would hang), starts CMD as its child with
the torchrun contract (`DistEnv.child_environ`), passes on the signals a scheduler or a user sends
(`FORWARDED`), and exits with the child's exit status (128 + N when signal N killed it).  The
child's output is left alone: srun or the launcher already write it to ``rank<R>.out``.  Around it
the wrapper writes ``start``, ``error`` and ``end`` events to its node's ``node<K>.events.jsonl`` (rules in
`ddp_hpc.exec.outcome`); a log it cannot write costs a message on stderr, never the exit status.
The child also gets torchrun's other variables and, for a Python command, ddp_hpc's
instrumentation (`ddp_hpc.exec.instrumented`, docs/scripts.md "What status sees without changes").
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Sequence

from ddp_hpc.data.scriptstage import run_staged
from ddp_hpc.env import DistEnv, EnvError, gpu_index, gpu_usable, job_facts, visible_gpus
from ddp_hpc.env.checks import diagnose
from ddp_hpc.env.tracking import wandb_environ
from ddp_hpc.errors import HintError, report
from ddp_hpc.exec.events import SafeLog
from ddp_hpc.exec.instrumented import (
    Instrumentation,
    InstrumentError,
    check_installed,
    read_error_file,
    torch_environ,
)
from ddp_hpc.exec.outcome import classify, error_fields, last_step
from ddp_hpc.fsutil import file_size
from ddp_hpc.runlogs.schema import error_file, node_events_file, rank_out
from ddp_hpc.runlogs.startup import PROC_START_VAR, process_start
from ddp_hpc.runlogs.watchdog import STACK_SIGNAL
from ddp_hpc.text import ArgumentParser, HelpFormatter, prog

EXIT_USAGE = 2
EXIT_CANNOT_RUN = 126     # the shell's codes: found but not runnable / not found
EXIT_NOT_FOUND = 127

#: signals passed on to the child: scancel and srun (TERM, INT, the job's --signal USR1/USR2),
#: Ctrl-C, job suspension (CONT), a lost terminal (HUP) and `ddp-hpc status --stacks` (URG)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT,
             signal.SIGHUP, STACK_SIGNAL)

EXAMPLES = """examples:
  srun python -m ddp_hpc.exec -- python train.py --lr 0.1
  ddp-hpc launch --nodes 2 --procs-per-node 2 -- python -m ddp_hpc.exec -- python train.py

The command gets the torchrun variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID) and
DDP_HPC_LOG_DIR; SIGTERM, SIGINT, SIGUSR1, SIGUSR2, SIGCONT, SIGHUP and SIGURG (status --stacks)
are passed on to it, and its exit status is this command's. A Python command is instrumented
(step events, hang and native-crash stacks) unless DDP_HPC_INSTRUMENT=0. See docs/scripts.md."""


def _parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(
        prog=prog("exec"), formatter_class=HelpFormatter, epilog=EXAMPLES,
        usage="%(prog)s [--log-dir DIR] [--] CMD [ARGS...]",
        description="Run a training script as one rank of a distributed job: torchrun's variables\n"
                    "from whichever launcher started this process, signals passed on, start and\n"
                    "end events in the run log.")
    ap.add_argument("--log-dir", metavar="DIR",
                    help="where nodeK.events.jsonl and rankR.log go (default: $DDP_HPC_LOG_DIR, else "
                         "the directory of this process's output file when it is rankR.out)")
    ap.add_argument("command", nargs=argparse.REMAINDER, metavar="CMD [ARGS...]",
                    help="the command every rank runs, with its arguments (verbatim, no shell)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        report(prog("exec"), HintError("no command to run",
                                       f"e.g. {prog('exec')} -- python train.py --lr 0.1"))
        return EXIT_USAGE
    return run(cmd, args.log_dir)


def output_dir(rank: int) -> Path | None:
    """The directory of this process's stdout or stderr when it is a file named ``rank<R>.out``
    (srun ``--output=DIR/rank%t.out``, the local launcher): the run's log directory."""
    for fd in (1, 2):
        try:
            path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
        if path.name == rank_out(rank) and path.is_file():
            return path.parent
    return None


def _log_dir(given: str | os.PathLike | None, rank: int | None) -> Path | None:
    if given or job_facts().log_dir:
        return Path(given or job_facts().log_dir).resolve()
    return output_dir(rank) if rank is not None else None


def run(cmd: Sequence[str], log_dir: str | os.PathLike | None = None) -> int:
    """Run ``cmd`` as this rank's child (in-process entry, e.g. for a submitit task); returns the
    exit status ``python -m ddp_hpc.exec`` would exit with."""
    cmd = [str(a) for a in cmd]
    env, problems = diagnose(dict(os.environ))
    if env is None or problems:
        return _refuse(problems[0], env, log_dir)
    where = _log_dir(log_dir, env.rank)
    try:
        child_env = env.child_environ()
        check_installed(cmd, child_env)
    except (EnvError, InstrumentError) as exc:
        return _refuse(exc, env, where)
    if where is not None:
        child_env["DDP_HPC_LOG_DIR"] = str(where)
    child_env.update(wandb_environ(child_env))     # one W&B run per job (docs/scripts.md)
    log = SafeLog(where, env.rank, env.job_id, env.restart_count, who=prog("exec"))
    try:  # submit --stage: node-local copies first, their paths in DDP_HPC_STAGE_<NAME>
        return run_staged(env, child_env, log, lambda: _supervise(cmd, env, child_env, log))
    finally:
        log.close()


def _refuse(exc: HintError, env: DistEnv | None, log_dir: str | os.PathLike | None) -> int:
    """An environment (or an installation) that cannot work: the error on stderr, an error event
    when the rank and the log directory are known, exit status 2."""
    report(prog("exec"), exc)
    where = _log_dir(log_dir, env.rank if env else None)
    if env is not None and where is not None:
        log = SafeLog(where, env.rank, env.job_id, env.restart_count, who=prog("exec"))
        log.event("error", exc_type=type(exc).__name__, message=str(exc), traceback=None,
                  exit_code=EXIT_USAGE, signal=None)
        log.close()
    return EXIT_USAGE


def _supervise(cmd: list[str], env: DistEnv, child_env: dict[str, str], log: SafeLog) -> int:
    """Start the child, pass signals on, wait, and record how it ended."""
    note = binding_note(env, child_env)
    if note:
        log.warning(note)
    out_path = log.dir / rank_out(env.rank) if log.dir else None
    out_start = file_size(out_path)
    errfile = _torch_environ(child_env, env, log.dir)
    inst = Instrumentation.prepare(cmd, child_env, log.dir, env.rank)
    if (began := process_start({})) is not None:   # the script's proc_start: when srun started us
        child_env[PROC_START_VAR] = str(began)
    started = time.time()
    with _forwarding() as fwd:
        try:
            proc = subprocess.Popen(cmd, env=child_env, pass_fds=inst.pass_fds)
        except OSError as exc:
            inst.started()
            return _not_started(cmd, exc, log)
        inst.started()
        fwd.attach(proc)
        log.event("start", world_size=env.world_size, num_nodes=env.num_nodes,
                  local_rank=env.local_rank, pid=proc.pid, total_steps=None, epochs=None,
                  launcher=f"exec/{env.launcher}", command=cmd,
                  device=None if gpu_usable(child_env) else "cpu",  # on a GPU the script picks: not known
                  instrumented=inst.read_fd is not None)
        log.info(f"exec: started {cmd[0]} as pid {proc.pid} (rank {env.rank} of {env.world_size}, "
                 f"node {env.node_rank} of {env.num_nodes})")
        events = log.dir / node_events_file(log.node) if log.dir else None
        events_start = file_size(events)
        outcome = classify(proc.wait(), fwd.forwarded, inst.ending(), fwd.first_at)
        log.flush(wait=True)     # the child's last events, held by the node's writer, into the file
        try:
            why = (read_error_file(errfile, started), inst.fault_stack())
            _record_end(log, outcome, (out_path, out_start, *why), (events, events_start, env.rank), started)
        except Exception as exc:  # noqa: BLE001 - the exit status must survive a broken log
            print(f"{prog('exec')}: cannot record how rank {env.rank} ended: {type(exc).__name__}: "
                  f"{exc}", file=sys.stderr, flush=True)
    return outcome.exit_status


def _torch_environ(child_env: dict[str, str], env: DistEnv, log_dir: Path | None) -> Path | None:
    """Add torchrun's other variables and the flight recorder's where unset (exec/instrumented.py);
    returns the elastic error file the child will write (a stale one of an earlier run removed)."""
    visible = visible_gpus(child_env)
    gpus = bool(visible) if visible is not None else os.path.exists("/dev/nvidiactl")
    path = log_dir / error_file(env.rank) if log_dir else None
    for key, value in torch_environ(log_dir, env.rank, job_facts(child_env).restart_count, gpus).items():
        if child_env.setdefault(key, value) != value and path is not None and value == str(path):
            path = None    # the user chose their own error file: theirs to keep
    if path is not None:
        with contextlib.suppress(OSError):   # an unwritable log directory costs no run
            path.unlink(missing_ok=True)
    return path


def _record_end(log: SafeLog, outcome, out: tuple, events: tuple, started: float) -> None:
    if outcome.is_cause:
        log.event("error", **error_fields(outcome, *out))
    elif outcome.status == "killed" and outcome.signal in ("SIGUSR1", "SIGUSR2"):
        log.warning(f"the command died of {outcome.signal}, passed on by the wrapper: it does not "
                    "handle that signal (ddp_hpc.preemption.install() catches the job's --signal)")
    if outcome.teardown:
        log.warning(f"the script ended with status {outcome.exit_code}, then the process died of "
                    f"{outcome.teardown} in the interpreter's native teardown (after its Python code "
                    f"had finished): counted as {outcome.status}, exit status {outcome.exit_status}")
    log.event("end", status=outcome.status, exit_code=outcome.exit_code, signal=outcome.signal,
              step=last_step(*events), duration_s=round(time.time() - started, 3),
              teardown=outcome.teardown)
    how = f"signal {outcome.signal}" if outcome.signal else f"status {outcome.exit_code}"
    log.info(f"exec: command ended with {how}: {outcome.status}")


def _not_started(cmd: list[str], exc: OSError, log: SafeLog) -> int:
    code = EXIT_NOT_FOUND if isinstance(exc, FileNotFoundError) else EXIT_CANNOT_RUN
    err = HintError(f"cannot start {cmd[0]!r}: {exc.strerror or exc}",
                    "check the program's name, its PATH and that it is executable")
    report(prog("exec"), err)
    log.event("error", exc_type=type(exc).__name__, message=str(err), traceback=None,
              exit_code=code, signal=None)
    return code


def binding_note(env: DistEnv, environ: dict[str, str]) -> str | None:
    """A warning when a torchrun script's ``torch.cuda.set_device(LOCAL_RANK)`` cannot work here:
    each task sees only its own GPU(s) (per-task binding) while several share a node, or a local
    rank has no GPU.  The binding itself is never changed."""
    visible = visible_gpus(environ)
    if not visible or env.local_world_size == 1:
        return None
    use = ("use torch.device('cuda', 0) (this task's own GPU), or ddp_hpc.dist.setup_ddp(), which "
           "binds the right device under every launcher")
    last = env.local_world_size - 1
    try:
        per_task = gpu_index(dataclasses.replace(env, local_rank=last), environ, visible) != last
    except EnvError as exc:
        return f"{exc.problem} torch.cuda.set_device(LOCAL_RANK) will fail; {use}."
    if not per_task:
        return None
    return (f"each task sees only its own GPU (CUDA_VISIBLE_DEVICES={environ.get('CUDA_VISIBLE_DEVICES')}) "
            f"but LOCAL_WORLD_SIZE={env.local_world_size}: a torchrun script's "
            f"torch.cuda.set_device(LOCAL_RANK={env.local_rank}) fails (invalid device ordinal) or takes "
            f"the wrong GPU; {use}.")


class _Forwarder:
    """Signal handlers that pass each signal on to the child (or hold it until there is one)."""

    def __init__(self) -> None:
        self.child: subprocess.Popen | None = None
        self.forwarded: list[int] = []
        self.first_at: float | None = None   # when the first signal came (time.time())
        self._held: list[int] = []

    def handle(self, signum: int, frame) -> None:  # noqa: ARG002 - signal API
        if self.first_at is None:
            self.first_at = time.time()
        self.forwarded.append(signum)
        if self.child is None:
            self._held.append(signum)
        else:
            self.child.send_signal(signum)

    def attach(self, child: subprocess.Popen) -> None:
        self.child = child
        while self._held:
            child.send_signal(self._held.pop(0))


@contextlib.contextmanager
def _forwarding() -> Iterator[_Forwarder]:
    """Forward `FORWARDED` to the child for the duration (main thread only: elsewhere the child
    still gets what its process group or srun's cgroup is sent).  A signal this process ignores
    (``nohup`` ignores SIGHUP) stays ignored, and the child inherits that."""
    fwd, previous = _Forwarder(), {}
    if threading.current_thread() is threading.main_thread():
        for sig in FORWARDED:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                previous[sig] = signal.signal(sig, fwd.handle)
    try:
        yield fwd
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
