"""Node addresses: a bridge + one network namespace per node, and a marked /etc/hosts block.

Why namespaces and not ``ip netns exec``: the latter remounts /sys, and slurmd 22.05 then fails
to initialise its cgroup plugin.  We create the namespace with ``ip netns add`` (which pins it at
/run/netns/NAME) and later enter it with ``nsenter --net=/run/netns/NAME``.

Every object made here carries a name derived from the spec, is recorded in the state file, and
is the only thing removed on teardown.  /etc/hosts gets one block between two marker lines; the
rest of the file is never touched, so edits others make meanwhile survive.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
from pathlib import Path

from .spec import ClusterError, ClusterSpec

HOSTS_FILE = Path("/etc/hosts")


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", *args]
    if ns:
        argv = ["nsenter", f"--net=/run/netns/{ns}", *argv]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode:
        raise ClusterError(f"`{' '.join(argv)}` failed: {proc.stderr.strip()}",
                           "the netns layout needs root and iproute2; try --layout loopback.")
    return proc


def link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def netns_exists(name: str) -> bool:
    return Path("/run/netns", name).exists()


def check_subnet_free(spec: ClusterSpec) -> None:
    """Refuse a subnet that overlaps any address or route already on the machine."""
    net = ipaddress.ip_network(spec.subnet)
    out = _ip("-4", "-o", "route", "show", "table", "all").stdout
    out += _ip("-4", "-o", "addr", "show").stdout
    for line in out.splitlines():
        words = line.split()
        for w in words:
            try:
                other = ipaddress.ip_network(w, strict=False)
            except ValueError:
                continue
            if other.version == 4 and other.prefixlen > 0 and other.overlaps(net) \
                    and spec.bridge not in words:
                raise ClusterError(
                    f"subnet {spec.subnet} overlaps {w} already in use here ({line.strip()})",
                    "pass another private /24 with --subnet, e.g. 10.78.0.0/24.")


def create(spec: ClusterSpec, created: dict) -> None:
    """Bridge + per-node netns/veth.  Appends what it made to ``created`` as it goes."""
    if link_exists(spec.bridge):
        raise ClusterError(f"network device {spec.bridge} exists but this cluster's state does "
                           "not record it", "another cluster uses the same --port-base; "
                           "run `python -m ddp_hpc.testcluster down` for it or pick another --port-base.")
    check_subnet_free(spec)
    prefix = ipaddress.ip_network(spec.subnet).prefixlen
    _ip("link", "add", spec.bridge, "type", "bridge")
    created.setdefault("links", []).append(spec.bridge)
    _ip("addr", "add", f"{spec.controller_addr}/{prefix}", "dev", spec.bridge)
    _ip("link", "set", spec.bridge, "up")
    for i, node in enumerate(spec.node_names, 1):
        ns, veth = spec.netns_name(node), spec.veth_name(i)
        if netns_exists(ns):
            raise ClusterError(f"network namespace {ns} already exists", "remove it with "
                               f"`ip netns del {ns}` if it is stale, or pick another --port-base.")
        _ip("netns", "add", ns)
        created.setdefault("netns", []).append(ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", veth, "master", spec.bridge, "up")
        _ip("addr", "add", f"{spec.node_addr(i)}/{prefix}", "dev", "eth0", ns=ns)
        _ip("link", "set", "eth0", "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)
        _ip("route", "add", "default", "via", spec.controller_addr, ns=ns)


def destroy(created: dict) -> list[str]:
    """Remove the namespaces and links recorded in ``created``; returns what was removed."""
    gone = []
    for ns in created.get("netns", []):
        if netns_exists(ns):
            _ip("netns", "del", ns, check=False)
            gone.append(f"netns {ns}")
    for link in created.get("links", []):
        if link_exists(link):
            _ip("link", "del", link, check=False)
            gone.append(f"link {link}")
    return gone


def netns_inodes(created: dict) -> set[int]:
    """Inode numbers of our namespaces, to recognise processes living in them."""
    inodes = set()
    for ns in created.get("netns", []):
        try:
            inodes.add(os.stat(f"/run/netns/{ns}").st_ino)
        except OSError:
            pass
    return inodes


# -- /etc/hosts ----------------------------------------------------------------------------------
def _markers(spec: ClusterSpec) -> tuple[str, str]:
    return (f"# >>> ddp_hpc testcluster {spec.state_dir} >>>",
            f"# <<< ddp_hpc testcluster {spec.state_dir} <<<")


def _write_hosts(text: str) -> None:
    """Replace /etc/hosts atomically when possible; in place when it is a bind mount (containers)."""
    tmp = HOSTS_FILE.with_name(f".hosts.ddp_hpc.{os.getpid()}")
    try:
        tmp.write_text(text)
        os.chmod(tmp, HOSTS_FILE.stat().st_mode & 0o7777)
        os.replace(tmp, HOSTS_FILE)
    except OSError:
        tmp.unlink(missing_ok=True)
        with open(HOSTS_FILE, "r+") as f:
            f.write(text)
            f.truncate()


def _strip_block(text: str, spec: ClusterSpec) -> str:
    begin, end = _markers(spec)
    out, inside = [], False
    for line in text.splitlines(keepends=True):
        if line.rstrip("\n") == begin:
            inside = True
        elif inside and line.rstrip("\n") == end:
            inside = False
        elif not inside:
            out.append(line)
    return "".join(out)


def check_names_free(spec: ClusterSpec) -> None:
    """Refuse when a node or controller name already resolves outside our block."""
    text = _strip_block(HOSTS_FILE.read_text(), spec)
    ours = {name for _, name in spec.hosts_entries()}
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        clash = ours.intersection(words[1:])
        if clash:
            raise ClusterError(f"host name(s) {sorted(clash)} already in /etc/hosts: {line.strip()!r}",
                               "remove that line or pick other names with --node-prefix.")
    for name in sorted(ours):
        try:
            addr = socket.gethostbyname(name)
        except OSError:
            continue
        raise ClusterError(f"host name {name!r} already resolves to {addr} on this machine",
                           "pick other node names with --node-prefix.")


def add_hosts_block(spec: ClusterSpec) -> None:
    begin, end = _markers(spec)
    text = _strip_block(HOSTS_FILE.read_text(), spec)
    if text and not text.endswith("\n"):
        text += "\n"
    block = [begin] + [f"{addr} {name}" for addr, name in spec.hosts_entries()] + [end]
    _write_hosts(text + "\n".join(block) + "\n")


def remove_hosts_block(spec: ClusterSpec) -> bool:
    text = HOSTS_FILE.read_text()
    stripped = _strip_block(text, spec)
    if stripped != text:
        _write_hosts(stripped)
        return True
    return False
