"""NCCL_DEBUG=INFO with and without ddp_hpc's NCCL_SOCKET_IFNAME: both runs must work, and what NCCL
chose each time (bootstrap interface, network transport, RDMA devices) is recorded in
``nccl-ifname.txt`` (scripts/gpu-check.sh's results folder, $GPU_REPORT_DIR; else a tmp dir) for
the keep / narrow / drop decision of docs/gpu.md.

``toolkit``: ``setup_ddp()``, which sets NCCL_SOCKET_IFNAME to the interface that routes to
MASTER_ADDR; ``plain``: torch's own ``init_process_group``, NCCL's default choice. MASTER_ADDR is
this host's address (as on a cluster, where it is the first node's name), not 127.0.0.1.
"""
from __future__ import annotations

import re
import socket
import subprocess

import psutil
import pytest

from ddp_hpc.env import free_port, interface_for

from ._helpers import MARKS, REPO, child_env, python, real_gpu, report_dir
from .probe import parse

pytestmark = MARKS + [real_gpu, pytest.mark.timeout(180)]

#: the NCCL INFO lines that tell which interfaces and transports were taken
_WORTH = re.compile(r"NCCL version|Bootstrap|NET/|SOCKET_IFNAME|IB|Using network|transport|"
                    r"NCCL_|comm 0x|Channel|Init COMPLETE", re.I)


def _host_addr() -> str:
    """This host's address (what MASTER_ADDR is on a cluster): its name's, unless that is a
    loopback address (Debian's 127.0.1.1 line) or not one of this machine's, then the source
    address of its outward route, then its first non-loopback IPv4 address."""
    mine = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family == socket.AF_INET and not a.address.startswith("127.")]
    try:
        addr = socket.gethostbyname(socket.gethostname())
        if addr in mine:
            return addr
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.254.254.254", 9))          # no packet is sent; only the route is looked up
            if s.getsockname()[0] in mine:
                return s.getsockname()[0]
    except OSError:
        pass
    return mine[0] if mine else "127.0.0.1"


def _run(mode: str, addr: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = child_env(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,BOOTSTRAP,ENV,NET",
                    MASTER_ADDR=addr, MASTER_PORT=str(free_port()))
    p = subprocess.run([python(), str(REPO / "tests" / "gpu" / "probe.py"), mode], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, f"{mode}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p, parse(p.stdout)


def _section(mode: str, addr: str, p: subprocess.CompletedProcess, facts: dict) -> str:
    text = p.stdout + p.stderr
    lines = [ln for ln in text.splitlines() if "NCCL INFO" in ln and _WORTH.search(ln)]
    return "\n".join([
        f"## {mode}: NCCL_SOCKET_IFNAME={facts['env']['NCCL_SOCKET_IFNAME']!r} "
        f"(MASTER_ADDR={addr}, route interface {interface_for(addr)!r})",
        f"backend {facts['backend']}, device {facts['device']}, all_reduce sum {facts['sum']}, "
        f"nccl {facts['nccl_version']}, exit {p.returncode}",
        "", *lines[:80], "" if len(lines) <= 80 else f"... {len(lines) - 80} more lines", ""])


def test_nccl_debug_with_and_without_ddp_hpc_socket_ifname(tmp_path):
    addr = _host_addr()
    sections = []
    for mode in ("toolkit", "plain"):
        p, facts = _run(mode, addr)
        assert facts["backend"] == "nccl" and facts["sum"] == facts["expected_sum"]
        assert "NCCL INFO" in p.stdout + p.stderr, "NCCL_DEBUG=INFO printed nothing"
        if mode == "toolkit":     # ddp_hpc pinned the interface that routes to MASTER_ADDR
            assert facts["env"]["NCCL_SOCKET_IFNAME"] == interface_for(addr)
        else:                     # NCCL chose by itself
            assert facts["env"]["NCCL_SOCKET_IFNAME"] is None
        sections.append(_section(mode, addr, p, facts))
    out = report_dir(tmp_path) / "nccl-ifname.txt"
    out.write_text("# NCCL_DEBUG=INFO with ddp_hpc's NCCL_SOCKET_IFNAME (toolkit) and without "
                   "(plain)\n\n" + "\n".join(sections))
    print(f"recorded in {out}")
