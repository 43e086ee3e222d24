"""What a local test cluster looks like, as one value, and the config files rendered from it.

Everything here is pure: a :class:`ClusterSpec` names the nodes, addresses, ports and paths, and
``render_*`` turn it into slurm.conf / gres.conf / slurmdbd.conf text.  Keeping this separate
from the code that creates namespaces and starts daemons lets the rendering be read (and tested)
on a machine without root or Slurm.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import time
from pathlib import Path

from ddp_hpc.errors import HintError

DEFAULT_STATE_DIR = Path("/tmp/ddp_hpc_testcluster")
DEFAULT_SUBNET = "10.77.0.0/24"
DEFAULT_PORT_BASE = 16800
CONTROLLER_NAME = "ddpctl"
LAYOUTS = ("netns", "loopback")
MAX_NODES = 64
CPUS_PER_NODE = 8

_NAME_RE = re.compile(r"[a-z][a-z0-9-]{0,30}")


class ClusterError(HintError, RuntimeError):
    """A test-cluster failure: what was seen, and a HINT line with the fix."""


def _fail(what: str, hint: str) -> ClusterError:
    return ClusterError(what, hint)


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """The whole shape of one local cluster; every path lives under ``state_dir``."""

    nodes: int = 4
    """Number of Slurm nodes (n1..nN) in the default partition ``debug``."""
    spare_nodes: int = 0
    """More nodes (n(N+1)..), in a partition ``spare`` of their own: for jobs that must not share
    nodes with others (a node killed on purpose) while other jobs run in ``debug``."""
    spare_partitions: int = 1
    """How many such partitions of ``spare_nodes`` nodes each: ``spare``, ``spare2``, ... (two
    tests that each take a whole spare partition can run side by side)."""
    gpus_per_node: int = 4
    """Fake GPUs per node (GRES ``gpu`` backed by char devices); 0 for none."""
    layout: str = "netns"
    """``netns``: one network + UTS namespace and address per node; ``loopback``: all on 127.0.0.1."""
    slurmdbd: bool = False
    """Also run MariaDB + slurmdbd so plain ``sacct`` (and ``sacct -D``) works."""
    state_dir: Path = DEFAULT_STATE_DIR
    subnet: str = DEFAULT_SUBNET
    """Private /24 for the bridge (netns layout); must not overlap any existing route."""
    port_base: int = DEFAULT_PORT_BASE
    """slurmctld = base+17, slurmd = base+18 (loopback: base+100+i), slurmdbd = base+19, MariaDB = base+6."""
    cluster_name: str = "ddphpc"
    node_prefix: str = "n"

    def __post_init__(self):
        object.__setattr__(self, "state_dir", Path(self.state_dir).absolute())
        if not 1 <= self.nodes <= MAX_NODES:
            raise _fail(f"--nodes {self.nodes} is out of range", f"use 1..{MAX_NODES} nodes.")
        if not 1 <= self.spare_partitions <= 4:
            raise _fail(f"{self.spare_partitions} spare partitions is out of range", "use 1..4.")
        if not 0 <= self.spare_nodes * self.spare_partitions <= MAX_NODES - self.nodes:
            raise _fail(f"{self.spare_nodes} spare nodes is out of range",
                        f"use 0..{MAX_NODES} nodes in all.")
        if not 0 <= self.gpus_per_node <= 16:
            raise _fail(f"--gpus-per-node {self.gpus_per_node} is out of range", "use 0..16.")
        if self.layout not in LAYOUTS:
            raise _fail(f"--layout {self.layout!r} is unknown", f"use one of {', '.join(LAYOUTS)}.")
        if not _NAME_RE.fullmatch(self.cluster_name) or not _NAME_RE.fullmatch(self.node_prefix):
            raise _fail(f"cluster name {self.cluster_name!r} / node prefix {self.node_prefix!r} "
                        "is not a plain lower-case name", "use letters, digits and dashes.")
        if not 1024 <= self.port_base <= 65000 - 200:
            raise _fail(f"--port-base {self.port_base} is out of range", "use 1024..64800.")
        try:
            net = ipaddress.ip_network(self.subnet)
        except ValueError as exc:
            raise _fail(f"--subnet {self.subnet!r} is not a network: {exc}",
                        "use a private /24 such as 10.77.0.0/24.") from None
        if net.version != 4 or net.prefixlen != 24 or not net.is_private:
            raise _fail(f"--subnet {self.subnet!r} is not a private IPv4 /24",
                        "use a private /24 such as 10.77.0.0/24.")
        if " " in str(self.state_dir) or "," in str(self.state_dir):
            raise _fail(f"state dir {self.state_dir} contains a space or comma (slurm.conf can't hold it)",
                        "choose a plain path.")

    # -- names and addresses -------------------------------------------------------------
    @property
    def total_nodes(self) -> int:
        """Every node's count, the spare partitions' included."""
        return self.nodes + self.spare_nodes * self.spare_partitions

    @property
    def node_names(self) -> list[str]:
        """Every node, the spare ones included."""
        return [f"{self.node_prefix}{i}" for i in range(1, self.total_nodes + 1)]

    @property
    def partition_nodes(self) -> list[str]:
        """The nodes of the default partition ``debug``."""
        return self.node_names[:self.nodes]

    @property
    def spare_node_names(self) -> list[str]:
        """The nodes of the partition ``spare`` (none unless ``spare_nodes``)."""
        return self.node_names[self.nodes:self.nodes + self.spare_nodes]

    @property
    def spare_sets(self) -> dict[str, list[str]]:
        """Each spare partition's name and nodes: ``spare``, ``spare2``, ... (none unless
        ``spare_nodes``)."""
        if not self.spare_nodes:
            return {}
        names = self.node_names
        return {("spare" if k == 0 else f"spare{k + 1}"):
                names[self.nodes + k * self.spare_nodes:self.nodes + (k + 1) * self.spare_nodes]
                for k in range(self.spare_partitions)}

    @property
    def nodelist(self) -> str:
        return self._range(1, self.total_nodes)

    def _range(self, first: int, last: int) -> str:
        p = self.node_prefix
        return f"{p}[{first}-{last}]" if last > first else f"{p}{first}"

    @property
    def controller_addr(self) -> str:
        if self.layout == "loopback":
            return "127.0.0.1"
        return str(ipaddress.ip_network(self.subnet).network_address + 1)

    def node_addr(self, i: int) -> str:
        """Address of node i (1-based)."""
        if self.layout == "loopback":
            return "127.0.0.1"
        return str(ipaddress.ip_network(self.subnet).network_address + 10 + i)

    def hosts_entries(self) -> list[tuple[str, str]]:
        """(address, name) pairs the cluster adds to /etc/hosts."""
        pairs = [(self.controller_addr, CONTROLLER_NAME)]
        pairs += [(self.node_addr(i), n) for i, n in enumerate(self.node_names, 1)]
        return pairs

    # -- network objects (netns layout) ----------------------------------------------------
    @property
    def bridge(self) -> str:
        return f"ddpbr{self.port_base % 1000}"

    def netns_name(self, node: str) -> str:
        return f"ddp{self.port_base % 1000}-{node}"

    def veth_name(self, i: int) -> str:
        return f"ddpv{self.port_base % 1000}x{i}"

    # -- ports -------------------------------------------------------------------------------
    @property
    def ctld_port(self) -> int:
        return self.port_base + 17

    @property
    def slurmd_port(self) -> int:
        return self.port_base + 18

    def node_port(self, i: int) -> int:
        return self.slurmd_port if self.layout == "netns" else self.port_base + 100 + i

    @property
    def dbd_port(self) -> int:
        return self.port_base + 19

    @property
    def mysql_port(self) -> int:
        return self.port_base + 6

    def host_ports(self) -> dict[int, str]:
        """Ports the cluster listens on in the machine's own network namespace."""
        ports = {self.ctld_port: "slurmctld"}
        if self.layout == "loopback":
            ports.update({self.node_port(i): f"slurmd {n}" for i, n in enumerate(self.node_names, 1)})
        if self.slurmdbd:
            ports.update({self.dbd_port: "slurmdbd", self.mysql_port: "mariadb"})
        return ports

    # -- paths ---------------------------------------------------------------------------------
    def path(self, *parts: str) -> Path:
        return self.state_dir.joinpath(*parts)

    @property
    def slurm_conf(self) -> Path:
        return self.path("etc", "slurm.conf")

    @property
    def munge_socket(self) -> Path:
        return self.path("munge", "munged.sock")

    @property
    def jobcomp_file(self) -> Path:
        return self.path("jobcomp.txt")

    @property
    def shared_dir(self) -> Path:
        return self.path("shared")

    @property
    def local_dir(self) -> Path:
        """Each node's own "local disk": the same path on every node, a different folder behind
        it (slurmd runs in its own mount namespace with ``local/NODE`` bound here), so jobs can
        stage or ``sbcast`` to it as to a real node-local disk."""
        return self.path("nodelocal")

    def local_backing(self, node: str) -> Path:
        return self.path("local", node)

    def gpu_files(self) -> list[Path]:
        return [self.path("dev", f"nvidia{k}") for k in range(self.gpus_per_node)]

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["state_dir"] = str(self.state_dir)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "ClusterSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


#: slurm.conf lines that do not depend on the spec
_STATIC_CONF = [
    "SlurmUser=root",
    "SlurmdUser=root",
    "MailProg=/bin/true",
    "AuthType=auth/munge",
    "CredType=cred/munge",
    # No cgroups and no systemd on the machines this runs on.
    "ProctrackType=proctrack/linuxproc",
    "TaskPlugin=task/none",
    "JobAcctGatherType=jobacct_gather/none",
    "SwitchType=switch/none",
    "MpiDefault=none",
    "SelectType=select/cons_tres",
    "SelectTypeParameters=CR_Core",
    "SchedulerType=sched/backfill",
    # Fast requeue: with the defaults a requeued job waits minutes (Reason=BeginTime).
    "SchedulerParameters=sched_interval=2,bf_interval=2",
    "JobRequeue=1",
    "KillWait=10",
    "ReturnToService=2",
    "InactiveLimit=0",
    "MessageTimeout=10",
    "SlurmdTimeout=20",   # a dead node is DOWN (NODE_FAIL) about 30 s after it stops answering
    "SlurmdParameters=config_overrides",
    "GresTypes=gpu",
]


def _paths_conf(spec: ClusterSpec) -> list[str]:
    p = spec.path
    return [
        f"ClusterName={spec.cluster_name}",
        f"SlurmctldHost={CONTROLLER_NAME}({spec.controller_addr})",
        f"SlurmctldPort={spec.ctld_port}",
        f"SlurmdPort={spec.slurmd_port}",
        f"AuthInfo=socket={spec.munge_socket},cred_expire=10",
        f"StateSaveLocation={p('ctld')}",
        f"SlurmdSpoolDir={p('spool')}/%n",
        f"SlurmctldPidFile={p('run', 'slurmctld.pid')}",
        f"SlurmdPidFile={p('run')}/slurmd-%n.pid",
        f"SlurmctldLogFile={p('log', 'slurmctld.log')}",
        f"SlurmdLogFile={p('log')}/slurmd-%n.log",
        f"PlugStackConfig={p('etc', 'plugstack.conf')}",
        "JobCompType=jobcomp/filetxt",
        f"JobCompLoc={spec.jobcomp_file}",
    ]


def _nodes_conf(spec: ClusterSpec) -> list[str]:
    gres = f" Gres=gpu:{spec.gpus_per_node}" if spec.gpus_per_node else ""
    lines = []
    for i, name in enumerate(spec.node_names, 1):
        hostname = name if spec.layout == "netns" else "localhost"
        lines.append(
            f"NodeName={name} NodeAddr={spec.node_addr(i)} NodeHostname={hostname} "
            f"Port={spec.node_port(i)} CPUs={CPUS_PER_NODE} Boards=1 SocketsPerBoard=1 "
            f"CoresPerSocket={CPUS_PER_NODE} ThreadsPerCore=1 RealMemory=4000{gres} State=UNKNOWN")
    if not spec.spare_nodes:
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        return lines
    lines.append(f"PartitionName=debug Nodes={spec._range(1, spec.nodes)} Default=YES "
                 "MaxTime=INFINITE State=UP")
    for k, name in enumerate(spec.spare_sets):
        first = spec.nodes + k * spec.spare_nodes + 1
        lines.append(f"PartitionName={name} Nodes={spec._range(first, first + spec.spare_nodes - 1)} "
                     "MaxTime=INFINITE State=UP")
    return lines


def first_job_id(now: float | None = None) -> int:
    """The first job id of a cluster started now: the seconds of the clock below Slurm's MaxJobId
    (67043328 by default). Every `up` starts with a fresh controller state, so from 1 each cluster
    would hand out the ids of the one before it, and what a job keeps by its id on a node (its
    memory snapshots in /dev/shm, its staged data) would look like an earlier job's; a cluster
    that handed out fewer ids than a second each never overlaps the next one."""
    return 1 + int(time.time() if now is None else now) % 60_000_000


def render_slurm_conf(spec: ClusterSpec, *, accounting: bool | None = None,
                      first_job: int | None = None) -> str:
    """slurm.conf for ``spec``; ``accounting=False`` renders the jobcomp-only variant; ``first_job``:
    its FirstJobId (`first_job_id`), Slurm's 1 when None."""
    accounting = spec.slurmdbd if accounting is None else accounting
    lines = ["# Rendered by ddp_hpc.testcluster; rewritten on every `up`.", *_paths_conf(spec), *_STATIC_CONF]
    if first_job is not None:
        lines.append(f"FirstJobId={first_job}")
    if spec.layout == "netns":
        # slurmctld must bind the bridge address (its own name resolves to it), not 127.0.0.1.
        lines.append("CommunicationParameters=NoCtldInAddrAny")
    if accounting:
        lines += [
            "AccountingStorageType=accounting_storage/slurmdbd",
            f"AccountingStorageHost={CONTROLLER_NAME}",
            f"AccountingStoragePort={spec.dbd_port}",
            f"AccountingStoragePass={spec.munge_socket}",
        ]
    return "\n".join(lines + _nodes_conf(spec)) + "\n"


def render_gres_conf(spec: ClusterSpec) -> str:
    lines = ["AutoDetect=off"]
    if spec.gpus_per_node:
        last = spec.gpus_per_node - 1
        files = f"{spec.path('dev')}/nvidia" + (f"[0-{last}]" if last else "0")
        lines.append(f"NodeName={spec.nodelist} Name=gpu File={files}")
    return "\n".join(lines) + "\n"


DB_USER = "slurm"
DB_PASS = "ddp_hpc_testcluster"
DB_NAME = "slurm_acct_db"


def render_slurmdbd_conf(spec: ClusterSpec) -> str:
    p = spec.path
    return "\n".join([
        "AuthType=auth/munge",
        f"AuthInfo=socket={spec.munge_socket}",
        f"DbdHost={CONTROLLER_NAME}",
        f"DbdAddr={spec.controller_addr}",
        f"DbdPort={spec.dbd_port}",
        "SlurmUser=root",
        f"PidFile={p('run', 'slurmdbd.pid')}",
        f"LogFile={p('log', 'slurmdbd.log')}",
        "StorageType=accounting_storage/mysql",
        "StorageHost=127.0.0.1",
        f"StoragePort={spec.mysql_port}",
        f"StorageUser={DB_USER}",
        f"StoragePass={DB_PASS}",
        f"StorageLoc={DB_NAME}",
    ]) + "\n"


def render_mysql_init(spec: ClusterSpec) -> str:
    """SQL run by MariaDB at every start (--init-file): the slurmdbd user, idempotently."""
    return (f"CREATE USER IF NOT EXISTS '{DB_USER}'@'127.0.0.1' IDENTIFIED BY '{DB_PASS}';\n"
            f"GRANT ALL ON {DB_NAME}.* TO '{DB_USER}'@'127.0.0.1';\n"
            f"CREATE DATABASE IF NOT EXISTS {DB_NAME};\n")
