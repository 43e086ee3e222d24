"""The network interface this rank's peers reach it on: the one that routes to the rendezvous host.

gloo advertises whatever the host name resolves to unless GLOO_SOCKET_IFNAME names an interface,
and a name resolving to 127.0.0.1 makes multi-node init time out; `ddp_hpc.dist` sets the
variable (when unset) to `route_interface`'s answer.
"""

from __future__ import annotations

import socket

import psutil

from ddp_hpc.env.model import DistEnv


def interface_for(addr: str) -> str | None:
    """The name of the local interface whose address routes to ``addr`` (None when unknown).

    A UDP ``connect`` sends nothing; it only asks the kernel's routing table for the source
    address, which psutil maps back to an interface name.
    """
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_DGRAM)
    except socket.gaierror:
        return None
    ifaces = psutil.net_if_addrs()
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((sockaddr[0], 9) + tuple(sockaddr[2:]))
                local_ip = s.getsockname()[0]
        except OSError:
            continue
        for name, addrs in ifaces.items():
            if any(a.family == family and a.address.split("%")[0] == local_ip for a in addrs):
                return name
    return None


def is_loopback(ifname: str) -> bool:
    addrs = psutil.net_if_addrs().get(ifname, [])
    return bool(addrs) and all(a.address.startswith("127.") or a.address.split("%")[0] == "::1"
                               for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6))


def route_interface(env: DistEnv, rdzv_host: str | None = None) -> str | None:
    """The interface this rank's peers can reach it on: the one that routes to the rendezvous
    host (MASTER_ADDR). On the master node itself a host name often resolves to loopback
    (Debian's ``127.0.1.1 hostname`` line); with several nodes the route to another node's
    name decides there, so gloo does not advertise an address no other node can reach.
    """
    name = interface_for(rdzv_host or env.master_addr)
    if env.num_nodes > 1 and (name is None or is_loopback(name)):
        for i, host in enumerate(env.hostnames):
            other = interface_for(host) if i != env.node_rank else None
            if other is not None and not is_loopback(other):
                return other
    return name
