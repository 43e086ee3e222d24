"""Start and stop the cluster's daemons: munged, MariaDB, slurmdbd, slurmctld, one slurmd per node.

Each daemon writes a pidfile under the state directory and is started with
``DDP_HPC_TESTCLUSTER=<state dir>`` in its environment.  Teardown signals only pids read from
those pidfiles whose /proc entry still shows the expected program, plus leftover job processes
recognised by that marker or by living in one of our network namespaces: never anything else.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from .spec import ClusterError, ClusterSpec

MARKER = "DDP_HPC_TESTCLUSTER"


def daemon_env(spec: ClusterSpec) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = str(spec.slurm_conf)
    env[MARKER] = str(spec.state_dir)
    return env


def run(argv: list[str], spec: ClusterSpec, what: str, *, timeout: float = 30, log: Path | None = None,
        check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(argv, env=daemon_env(spec), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"{what}: `{' '.join(argv)}` did not finish within {timeout:.0f} s",
                           f"see {log or spec.path('log')}.") from None
    if check and proc.returncode:
        tail = (proc.stderr or proc.stdout).strip()[-1500:]
        raise ClusterError(f"{what}: `{' '.join(argv)}` exited {proc.returncode}: {tail}",
                           f"see {log or spec.path('log')}.")
    return proc


def read_pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(pidfile: Path, program: str) -> int | None:
    """The pid in ``pidfile`` when that process runs ``program``; None otherwise."""
    pid = read_pid(pidfile)
    if pid and program in _cmdline(pid):
        return pid
    return None


def log_tail(log: Path | None, n: int = 6) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()[-n:] if log else []
    except OSError:
        return ""
    return "".join(f"\n  | {line}" for line in lines)


def wait_for(cond, timeout: float, what: str, hint: str, interval: float = 0.05, *,
             pidfile: Path | None = None, program: str = "", log: Path | None = None):
    """Poll ``cond`` until truthy.  With ``pidfile``, give up at once when that daemon has died
    (after a grace second for it to write the file), quoting the end of ``log``."""
    start = time.monotonic()
    while True:
        value = cond()
        if value:
            return value
        waited = time.monotonic() - start
        dead = pidfile is not None and waited > 1.0 and not alive(pidfile, program)
        if dead or waited > timeout:
            why = f"{program} exited" if dead else f"waited {timeout:.0f} s"
            raise ClusterError(f"{what} ({why}){log_tail(log)}", hint)
        time.sleep(interval)
        interval = min(interval * 1.5, 0.5)


def stop_pid(pid: int, program: str, timeout: float = 5.0) -> bool:
    """SIGTERM, then SIGKILL after ``timeout``; only while /proc still shows ``program``."""
    if program not in _cmdline(pid):
        return False
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if program not in _cmdline(pid):
            return True
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    time.sleep(0.1)
    return True


def stop_pidfile(pidfile: Path, program: str, timeout: float = 5.0) -> bool:
    pid = alive(pidfile, program)
    stopped = stop_pid(pid, program, timeout) if pid else False
    pidfile.unlink(missing_ok=True)
    return stopped


def port_in_use(port: int, addr: str = "0.0.0.0") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError:
            return True
    return False


def check_ports_free(spec: ClusterSpec) -> None:
    for port, who in sorted(spec.host_ports().items()):
        if port_in_use(port):
            raise ClusterError(f"port {port} (for {who}) is already in use on this machine",
                               "stop what listens there (`ss -ltnp`) or move the cluster "
                               "with --port-base.")


def leftover_pids(spec: ClusterSpec, ns_inodes: set[int]) -> list[int]:
    """Processes of this cluster still running: our marker in their environment, or their
    network namespace is one of ours (job tasks started by slurmstepd)."""
    found, me = [], os.getpid()
    marker = f"{MARKER}={spec.state_dir}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        try:
            if ns_inodes and os.stat(f"/proc/{pid}/ns/net").st_ino in ns_inodes:
                found.append(pid)
                continue
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if marker + b"\0" in env or env.endswith(marker):
            found.append(pid)
    return found


def kill_pids(pids: list[int], timeout: float = 3.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() and _not_zombie(p)
                                                  for p in pids):
            time.sleep(0.05)


def _not_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
