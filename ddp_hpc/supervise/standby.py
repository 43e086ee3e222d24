"""A warm standby rank: ``python -m ddp_hpc.supervise.standby --go HOST:PORT -- PYTHON -m MODULE ARGS...``
(or ``-- PYTHON SCRIPT.py ARGS...``), one per task of the standby step the supervisor keeps
beside the running one (``supervise.warm``).

First it asks whether its node's memory has room for the standby (``supervise.standroom``); where
it has not, it imports nothing, says so in one line (`runlogs.schema.STANDBY_BACK`) and exits
`BACK_STATUS`, which ends the standby (a restart starts cold). Otherwise it pays a new rank's
start-up before any fault: Python starts, torch and ``torch.distributed``
are imported, and ``torch._dynamo`` too (DDP's constructor imports it: about 1.3 s of CPU on the
test machine, about the import of torch itself); for ddp_hpc's own loop its modules as well.
`IMPORTS_VAR` names other modules instead (a script's frameworks).
Then it connects to the supervisor and waits, idle, on that connection for its go:

- ``{"rank": null}`` or the connection closed: this process is not needed; it exits 0;
- ``{"rank": R, "env": {...}, "out": PATH}``: it becomes rank R of the new step. The variables in
  ``env`` replace its own (Slurm's task and step variables of the new step's layout, the
  supervisor's restart count; a null value unsets one), its stdout and stderr go to the rank's
  output file ``PATH`` (appended, as srun's ``--output`` would), `PROC_START_VAR` is set to now
  (the restart's phases count its start from the go, not from the standby's start), and the
  command runs in this process, as ``python -m MODULE`` or ``python SCRIPT`` would run it.

Both ends prove that they know the job's secret, `TOKEN_VAR` (random, made by the supervisor once
per job, passed on by srun in the step's environment, which only this user can read; never on the
command line, which every user can), and the token itself never travels: the port the standby
connects to may be held by another local user's process once the supervisor closed it (the
standby retries for `CONNECT_S`), and what a go carries (variables such as ``LD_PRELOAD``, a file
to open) must come from the supervisor alone. One JSON object a line:

1. standby -> supervisor, the hello: its node and its place on the node (``ddp_hpc.env.derive``
   of the standby step's own variables), its pid, and a random ``nonce``;
2. supervisor -> standby, at a restart (the supervisor reads the hellos then): its own ``nonce``
   and ``proof``: `proof` ("supervisor", both nonces);
3. standby -> supervisor, only when that proof holds: its ``proof`` ("standby", both nonces);
4. supervisor -> standby, right after: ``{"go": TEXT, "mac": proof("go", both nonces, TEXT)}``,
   ``TEXT`` the go itself (above). Even so it may set only `GO_ENV_KEYS` and write only into the
   log directory (`LOGS_VAR`), as ``rank{R}.out`` of the rank it names.

A peer that does not prove itself gets nothing more, and the standby runs nothing: one line says
so, and it exits 0 (2 for an authenticated go it may not follow).
"""
from __future__ import annotations

import hashlib
import hmac
import importlib
import json
import os
import runpy
import secrets
import socket
import sys
import threading
import time

import psutil

from ddp_hpc.env.job import ALLOC_RESTARTS_VAR
from ddp_hpc.env.sources import derive
from ddp_hpc.parsing import to_int
from ddp_hpc.runlogs.schema import STANDBY_BACK, rank_out
from ddp_hpc.runlogs.startup import PROC_START_VAR, WARM_START_VAR
from ddp_hpc.supervise.standroom import refusal

__all__ = ["TOKEN_VAR", "LOGS_VAR", "WARM_VAR", "IMPORTS_VAR", "NICE_VAR", "GO_ENV_KEYS", "eligible", "preload",
           "standby_nice", "autogroup_nice", "own_session", "proof", "send", "receive", "go_refusal", "main"]

#: the job's secret that the supervisor and its standby ranks prove to each other they know
TOKEN_VAR = "DDP_HPC_STANDBY_TOKEN"
#: the job's log directory: a go's output file must be in it
LOGS_VAR = "DDP_HPC_STANDBY_LOGS"
#: the variables a go may set or unset: the new step's Slurm task and step variables
#: (``supervise.warm.step_variables``) and the supervisor's restart count; no other (no
#: ``LD_PRELOAD``, ``PYTHONPATH``, ...)
GO_ENV_KEYS = frozenset({
    "SLURM_PROCID", "SLURM_NODEID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_NPROCS",
    "SLURM_NNODES", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE", "SLURM_GTIDS", ALLOC_RESTARTS_VAR})
#: the longest line either end reads, bytes (a go is a few kB)
LINE_MAX = 1 << 20
#: set to 1 in a rank that started from the warm standby (its ``rendezvous`` event says so)
WARM_VAR = WARM_START_VAR
#: how long a standby rank tries to reach the supervisor, seconds
CONNECT_S = 60.0
#: the exit status of a standby rank that stepped back (no room in its node's memory): not 0, so
#: that srun's ``--kill-on-bad-exit`` ends the whole standby, and a restart starts cold at once
BACK_STATUS = 3
#: what every standby imports, whatever it will run
BASE_MODULES = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo")
#: how far a standby rank stands back while it imports and waits: the nice value (0-19, default
#: 19) of its import thread and of its session's autogroup (`autogroup_nice`)
NICE_VAR = "DDP_HPC_STANDBY_NICE"
#: the modules to import instead, comma-separated (e.g. ``torch,transformers,lightning`` for a
#: script that uses them; empty: none)
IMPORTS_VAR = "DDP_HPC_STANDBY_IMPORTS"
#: what it imports more for ddp_hpc's own entry points
OWN_MODULES = ("ddp_hpc.train.api", "ddp_hpc.exec.wrapper")


def eligible(command) -> bool:
    """Whether a standby can run ``command``: a Python interpreter with ``-m MODULE`` or a
    ``.py`` script as its first argument (no interpreter options: they would not apply to this
    process). Anything else (a shell script, torchrun, a container) starts cold."""
    cmd = [str(c) for c in command]
    if len(cmd) < 2 or not os.path.basename(cmd[0]).startswith("python"):
        return False
    return (cmd[1] == "-m" and len(cmd) >= 3) or (cmd[1].endswith(".py") and not cmd[1].startswith("-"))


def preload(command, environ=None) -> list[str]:
    """Import what a rank of ``command`` will need (`BASE_MODULES`; for a ``ddp_hpc`` module also
    `OWN_MODULES`; `IMPORTS_VAR` when set instead) at the lowest CPU priority, so that the cores of
    a node that trains go to the training first: in a thread of its own with nice 19 (Linux keeps a
    nice value per thread; the process itself, which becomes the rank, keeps its priority, which an
    unprivileged process could not raise again). The names that failed to import (they will fail
    again, loudly, in the run)."""
    env = os.environ if environ is None else environ
    names = list(BASE_MODULES)
    if len(command) >= 3 and command[1] == "-m" and str(command[2]).split(".")[0] == "ddp_hpc":
        names += OWN_MODULES
    if IMPORTS_VAR in env:
        names = [n.strip() for n in env[IMPORTS_VAR].split(",") if n.strip()]
    failed: list[str] = []

    def imports() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), standby_nice(env))
        except (OSError, AttributeError):
            pass                      # not Linux: the imports run at the process's priority
        for name in names:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the run itself reports a broken import
                failed.append(name)

    t = threading.Thread(target=imports, name="ddp_hpc-standby-imports")
    t.start()
    t.join()
    return failed


def standby_nice(environ=None) -> int:
    """`NICE_VAR` (default 19), kept within 0-19."""
    return min(19, max(0, to_int((os.environ if environ is None else environ).get(NICE_VAR), 19)))


#: what starts an srun task: one per step and node, in a session of its own (it daemonizes)
STEPD = "slurmstepd"


def own_session() -> bool:
    """This process's session holds only its own step: it leads the session (as a stand-in srun
    starts a task, with ``setsid``), or the session is its step's slurmstepd's. srun's tasks do
    not lead their session: the step's slurmstepd made it when it daemonized (its leader has
    exited), and it holds nothing but that step's processes on the node."""
    sid = os.getsid(0)
    if sid == os.getpid():
        return True
    try:
        for parent in psutil.Process().parents():
            if os.getsid(parent.pid) != sid:
                return False          # the session began below a launcher that is not slurmstepd
            if parent.name() == STEPD:
                return True
    except (psutil.Error, OSError):
        pass
    return False


def autogroup_nice(value: int) -> bool:
    """Set the nice value of this process's autogroup (Linux's ``/proc/self/autogroup``), False
    where there is none. With autogroups on (``kernel.sched_autogroup_enabled``, the default of
    many kernels) the scheduler shares a CPU fairly between sessions first, and every srun step
    is a session of its own on each node (its slurmstepd's): a standby step, however niced its
    threads, would take as much as the training step. Its autogroup at 19 keeps it back; at the
    hand-over 0 gives it back (raising the value and lowering it again down to 0 needs no
    privilege; the kernel takes one change per 0.1 s).

    Only where the session is this step's alone (`own_session`): otherwise the autogroup is its
    launcher's too (a shell, a test run, a launcher that started it without ``setsid``), and all
    of them would stand back with it, for good if this process never becomes a rank."""
    if not own_session():
        return False
    for _ in range(20):
        try:
            with open("/proc/self/autogroup", "w", encoding="ascii") as f:
                f.write(str(value))
            return True
        except BlockingIOError:      # EAGAIN: another change in the last 0.1 s
            time.sleep(0.11)
        except OSError:
            return False
    return False


def _connect(address: str) -> socket.socket | None:
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + CONNECT_S
    while True:
        try:
            return socket.create_connection((host, int(port)), timeout=10)
        except OSError:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.5)


def proof(token: str, who: str, *parts: str) -> str:
    """HMAC-SHA256 under the job's token of ``who`` (the role: "supervisor", "standby", "go", so
    that no end's proof serves as another's) and ``parts`` (both ends' nonces: no proof serves on
    another connection)."""
    return hmac.new(token.encode(), "\0".join((who, *parts)).encode(), hashlib.sha256).hexdigest()


def send(sock: socket.socket, obj: dict) -> None:
    sock.sendall((json.dumps(obj) + "\n").encode())


def receive(f) -> dict | None:
    """The next line of ``f`` (a socket's binary file) as a JSON object; None when the connection
    closed, or the line is no JSON object (or longer than `LINE_MAX`)."""
    line = f.readline(LINE_MAX)
    if not line.endswith(b"\n"):
        return None
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def go_refusal(go: dict, logs: str | None) -> str | None:
    """Why a standby may not follow the authenticated ``go`` (None: it may): a rank that is no
    number, a variable outside `GO_ENV_KEYS`, an output file other than the rank's own in ``logs``."""
    rank = go.get("rank")
    if rank is None:
        return None
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        return f"rank {rank!r} is no rank"
    env = go.get("env") or {}
    if not isinstance(env, dict):
        return f"env {env!r} is no mapping"
    bad = sorted(k for k, v in env.items() if k not in GO_ENV_KEYS or not (v is None or isinstance(v, str)))
    if bad:
        return f"it may not set {', '.join(bad)} (only the step's Slurm variables and {ALLOC_RESTARTS_VAR})"
    out = go.get("out")
    if out is not None:
        if not logs:
            return f"output file {out!r} but no log directory in {LOGS_VAR}"
        want = os.path.join(os.path.realpath(logs), rank_out(rank))
        if not isinstance(out, str) or os.path.realpath(out) != want:
            return f"output file {out!r} is not {want}"
    return None


class Refused(Exception):
    """The peer or its go refused: the message, and the exit status (0: nothing was asked of
    this standby by its supervisor; 2: its supervisor's go is one it may not follow)."""

    def __init__(self, why: str, status: int = 0):
        super().__init__(why)
        self.status = status


def _wait_for_go(sock: socket.socket, place, token: str, logs: str | None) -> dict | None:
    """The hand-shake (the module docstring) with the peer on ``sock`` (``place``: this standby
    rank's `DistEnv` in its own step), then its go; None when the connection closed first.
    Raises `Refused` for a peer that did not prove itself, or a go this standby may not follow."""
    if not token:
        raise Refused(f"no secret in {TOKEN_VAR} to check it with")
    nonce = secrets.token_hex(16)
    sock.settimeout(None)   # the supervisor answers only at a restart, hours later perhaps
    send(sock, {"node": place.hostnames[place.node_rank], "local": place.local_rank, "task": place.rank,
                "pid": os.getpid(), "nonce": nonce})
    with sock.makefile("rb") as f:
        challenge = receive(f)
        if challenge is None:
            return None
        theirs = challenge.get("nonce")
        if not isinstance(theirs, str) or not hmac.compare_digest(
                str(challenge.get("proof")), proof(token, "supervisor", nonce, theirs)):
            raise Refused("it did not prove that it knows the job's secret")
        send(sock, {"proof": proof(token, "standby", nonce, theirs)})
        signed = receive(f)
    if signed is None:
        return None
    text = signed.get("go")
    if not isinstance(text, str) or not hmac.compare_digest(str(signed.get("mac")),
                                                            proof(token, "go", nonce, theirs, text)):
        raise Refused("its go was not signed with the job's secret")
    try:
        go = json.loads(text)
    except ValueError:
        go = None
    if not isinstance(go, dict):
        raise Refused(f"its go {text[:80]!r} is no JSON object", 2)
    why = go_refusal(go, logs)
    if why:
        raise Refused(why, 2)
    return go


def _become(go: dict) -> None:
    """Take the new rank's variables and output file (the module docstring)."""
    for key, value in (go.get("env") or {}).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = str(value)
    os.environ[PROC_START_VAR] = f"{time.time():.3f}"
    os.environ[WARM_VAR] = "1"
    autogroup_nice(0)      # a training rank now: its session's full share of the CPU
    os.environ.pop(TOKEN_VAR, None)
    os.environ.pop(LOGS_VAR, None)
    if go.get("out"):
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(go["out"], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)


def _run(command: list[str]) -> None:
    """Run ``command`` in this process as its interpreter would have (``-m`` or a script)."""
    if command[1] == "-m":
        sys.argv = [command[2], *command[3:]]
        runpy.run_module(command[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = command[1:]
        sys.path.insert(0, os.path.dirname(os.path.abspath(command[1])))
        runpy.run_path(command[1], run_name="__main__")


def _stand_by(address: str, command: list[str]) -> dict | int | None:
    """Import what ``command`` will, then wait for the supervisor at ``address`` to hand this
    process a rank: the go message, None when there is none (the supervisor is gone or moved on),
    or the exit status of a refusal."""
    t0 = time.monotonic()
    place = derive(os.environ)
    node = place.hostnames[place.node_rank]
    why = refusal(place.local_world_size)     # before any import: no room, no standby (supervise.standroom)
    if why:
        print(f"{STANDBY_BACK} on {node} (task {place.rank}): {why}; a restart onto {node} starts its ranks "
              "cold", flush=True)
        return BACK_STATUS
    autogroup_nice(standby_nice())   # standing by: behind the training ranks' sessions (autogroup_nice)
    failed = preload(command)
    print(f"ddp_hpc standby: task {place.rank} on {node} ready in "
          f"{time.monotonic() - t0:.1f} s" + (f" (could not import {', '.join(failed)})" if failed else ""),
          flush=True)
    sock = _connect(address)
    if sock is None:
        return None       # the supervisor is gone or moved on: nothing to stand by for
    try:
        return _wait_for_go(sock, place, os.environ.get(TOKEN_VAR, ""), os.environ.get(LOGS_VAR))
    except Refused as e:
        print(f"ddp_hpc standby: refused the peer at {address}: {e}; running nothing", flush=True)
        return e.status
    except ConnectionError as e:   # reset mid-exchange: the supervisor's process ended (the job's end)
        print(f"ddp_hpc standby: the supervisor at {address} went away ({e.strerror or e}); ran nothing",
              flush=True)
        return None
    finally:
        sock.close()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 4 or args[0] != "--go" or args[2] != "--" or not eligible(args[3:]):
        print("usage: python -m ddp_hpc.supervise.standby --go HOST:PORT -- PYTHON (-m MODULE | SCRIPT.py) "
              "ARGS...", file=sys.stderr)
        return 2
    command = args[3:]
    try:
        go = _stand_by(args[1], command)
    except KeyboardInterrupt:   # srun's abort of the standby step (the job ends): nothing was run
        print("ddp_hpc standby: stopped while standing by; ran nothing", flush=True)
        return 130
    if isinstance(go, int):
        return go
    if not go or go.get("rank") is None:
        return 0
    try:
        _become(go)
    except OSError as e:           # the output file (a link, a full disk): no rank without it
        print(f"ddp_hpc standby: cannot open the output file {go.get('out')}: {e}; running nothing", flush=True)
        return 2
    _run(command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
