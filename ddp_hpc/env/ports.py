"""The master port rule: the user's MASTER_PORT wins, else a port derived from the job key (the
same on every rank with no communication), else a free port of this machine (one process),
outside the ephemeral range.

``free_port`` here is the one of ddp_hpc: launchers and tests pick free ports with it.
"""

from __future__ import annotations

import os
import random
import socket
import zlib
from collections.abc import Mapping

from ddp_hpc.env.model import EnvError, int_var

#: MASTER_PORT derived from a job id lies in [PORT_BASE, PORT_BASE + PORT_SPAN): above the
#: well-known and registered ranges most services use, below Linux's default ephemeral range
#: (32768-60999 overlaps; a collision there fails loudly at bind, and MASTER_PORT overrides).
PORT_BASE = 20000
PORT_SPAN = 10000

#: `free_port` picks from [FREE_BASE, FREE_BASE + FREE_SPAN): below the derived ports (a Slurm
#: job's, on a machine that is also a node) and below the ephemeral range
FREE_BASE = 10000
FREE_SPAN = 10000

#: the variables a user sets to choose the port, in order of precedence
PORT_VARS = ("MASTER_PORT", "DDP_HPC_MASTER_PORT")


def derive_port(job_key: str) -> int:
    """MASTER_PORT for a job: identical on every rank, spread over PORT_SPAN ports by job id."""
    return PORT_BASE + zlib.crc32(job_key.encode()) % PORT_SPAN


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` of this machine right now (for single-machine runs), outside
    the kernel's ephemeral range where one can be found (`FREE_BASE`..): a port is chosen now
    and bound seconds later, once the rank has imported torch, and an ephemeral one may meanwhile
    go to any outgoing connection on the machine (a busy machine's test run hit EADDRINUSE so);
    a port outside that range is taken only by a program that binds it on purpose."""
    low, high = _ephemeral_range()
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(FREE_BASE, FREE_BASE + FREE_SPAN)
        if low <= port <= high:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:      # all taken: any free one
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (Linux's default where unreadable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            low, high = (int(x) for x in f.read().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def user_port(environ: Mapping[str, str] | None = None) -> int | None:
    """The port the user chose (MASTER_PORT, then DDP_HPC_MASTER_PORT), None when neither is set;
    an `EnvError` when it is not a TCP port. Processes started without a launcher agree on a
    port only through this."""
    environ = os.environ if environ is None else environ
    for name in PORT_VARS:
        if environ.get(name):
            port = int_var(environ, name)
            if not 0 < port < 65536:
                raise EnvError(f"{name}={port} is not a TCP port.", f"Set {name} to a free port in 1024..65535.")
            return port
    return None


def master_port(environ: Mapping[str, str], job_key: str | None) -> int:
    """The rule of the module docstring: the user's port, the job's derived port, a free one."""
    port = user_port(environ)
    if port is not None:
        return port
    return derive_port(job_key) if job_key else free_port()
