"""Bring a local multi-node Slurm cluster up, check it, and tear down exactly what was made.

``up(spec)`` is idempotent: a healthy cluster with the same spec is reused, a broken one is torn
down and rebuilt, a healthy one with another spec is refused (run ``down`` first).  Everything it
creates is recorded in ``<state dir>/state.json`` *before* the next step runs, so a failure half
way (or a crash) can always be undone by ``down``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import time
from pathlib import Path

from . import daemons, network
from .health import daemon_table, node_states, status
from .spec import (
    CONTROLLER_NAME,
    ClusterError,
    ClusterSpec,
    first_job_id,
    render_gres_conf,
    render_mysql_init,
    render_slurm_conf,
    render_slurmdbd_conf,
)
from .state import STAMP, load_state, save_state, state_path

_FRESH_DIRS = ("etc", "munge", "run", "log", "ctld", "spool", "dev", "shared", "db", "local", "nodelocal")


def require_root_and_programs(spec: ClusterSpec) -> None:
    if os.geteuid() != 0:
        raise ClusterError(f"the test cluster needs root (running as uid {os.geteuid()})",
                           "run it as root, e.g. `sudo .venv/bin/python -m ddp_hpc.testcluster up`.")
    need = ["slurmctld", "slurmd", "munged", "sinfo", "scontrol", "scancel", "squeue", "unshare", "setsid"]
    if spec.layout == "netns":
        need += ["ip", "nsenter"]
    if spec.slurmdbd:
        need += ["slurmdbd", "mariadbd", "mariadb-install-db", "sacctmgr"]
    missing = [p for p in need if not shutil.which(p, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")]
    if missing:
        raise ClusterError(f"missing programs: {', '.join(missing)}",
                           "`python -m ddp_hpc.testcluster install"
                           f"{' --slurmdbd' if spec.slurmdbd else ''}` installs them (apt-get).")


# -- up --------------------------------------------------------------------------------------------
def _prepare_dir(spec: ClusterSpec) -> None:
    d = spec.state_dir
    if d.exists() and any(d.iterdir()) and not (d / STAMP).exists():
        raise ClusterError(f"state dir {d} exists, is not empty and was not made by the test cluster",
                           "pass an empty or new directory with --state-dir.")
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o755)
    (d / STAMP).touch()
    for sub in _FRESH_DIRS:
        shutil.rmtree(d / sub, ignore_errors=True)
    spec.jobcomp_file.unlink(missing_ok=True)
    for sub in _FRESH_DIRS:
        (d / sub).mkdir(mode=0o755)
    os.chmod(d / "munge", 0o700)
    os.chmod(d / "shared", 0o1777)
    for node in spec.node_names:
        (d / "spool" / node).mkdir()
        spec.local_backing(node).mkdir(mode=0o1777)
        os.chmod(spec.local_backing(node), 0o1777)


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _start_munge(spec: ClusterSpec) -> None:
    key = spec.path("munge", "munge.key")
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o400)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(1024))
    m = spec.path("munge")
    daemons.run(["munged", "--force", f"--socket={spec.munge_socket}", f"--key-file={key}",
                 f"--pid-file={spec.path('run', 'munged.pid')}", f"--seed-file={m / 'munged.seed'}",
                 f"--log-file={spec.path('log', 'munged.log')}"], spec, "munged")
    daemons.wait_for(spec.munge_socket.exists, 10, "munged did not create its socket",
                     f"see {spec.path('log', 'munged.log')}.")


def _start_mariadb(spec: ClusterSpec) -> None:
    db, log = spec.path("db"), spec.path("log", "mariadb.log")
    daemons.run(["mariadb-install-db", "--no-defaults", f"--datadir={db}", "--user=root",
                 "--auth-root-authentication-method=socket", "--skip-test-db"], spec,
                "mariadb-install-db", timeout=120, log=log)
    init = spec.path("etc", "mysql-init.sql")
    _write(init, render_mysql_init(spec), 0o600)
    argv = ["mariadbd", "--no-defaults", f"--datadir={db}", "--user=root", "--bind-address=127.0.0.1",
            f"--port={spec.mysql_port}", f"--socket={spec.path('run', 'mysqld.sock')}",
            f"--pid-file={spec.path('run', 'mysqld.pid')}", f"--log-error={log}",
            f"--init-file={init}", "--skip-name-resolve", "--skip-log-bin",
            "--innodb-buffer-pool-size=32M", "--innodb-log-file-size=16M",
            "--innodb-lock-wait-timeout=900"]
    # setsid -f: MariaDB does not daemonize itself; this way it is not our child (no zombie).
    daemons.run(["setsid", "-f", *argv], spec, "mariadbd", log=log)
    daemons.wait_for(lambda: daemons.port_in_use(spec.mysql_port, "127.0.0.1")
                     and daemons.alive(spec.path("run", "mysqld.pid"), "mariadbd"),
                     60, "MariaDB did not start listening", f"see {log}.", log=log)


def _start_slurmdbd(spec: ClusterSpec) -> None:
    conf = spec.path("etc", "slurmdbd.conf")
    if not conf.exists():
        _write(conf, render_slurmdbd_conf(spec), 0o600)
    daemons.run(["unshare", "--uts", "sh", "-c", f"hostname {CONTROLLER_NAME} && exec slurmdbd"], spec,
                "slurmdbd", log=spec.path("log", "slurmdbd.log"))
    daemons.wait_for(lambda: daemons.port_in_use(spec.dbd_port, spec.controller_addr),
                     30, "slurmdbd did not start listening", f"see {spec.path('log', 'slurmdbd.log')}.",
                     pidfile=spec.path("run", "slurmdbd.pid"), program="slurmdbd",
                     log=spec.path("log", "slurmdbd.log"))


def _start_slurmctld(spec: ClusterSpec, clean: bool) -> None:
    # Its own UTS namespace: slurmctld only runs on a host whose name is SlurmctldHost.
    log = spec.path("log", "slurmctld.log")
    inner = (f"hostname {CONTROLLER_NAME} && exec slurmctld {'-c ' if clean else ''}"
             f"-f {shlex.quote(str(spec.slurm_conf))}")
    daemons.run(["unshare", "--uts", "sh", "-c", inner], spec, "slurmctld", log=log)
    daemons.wait_for(lambda: daemons.run(["scontrol", "ping"], spec, "scontrol ping", check=False,
                                         timeout=15).stdout.count("UP") > 0,
                     30, "slurmctld does not answer `scontrol ping`", f"see {log}.",
                     pidfile=spec.path("run", "slurmctld.pid"), program="slurmctld", log=log)


#: a node's resolver in the netns layout: a node's namespace has no route to the machine's DNS
#: server, so every DNS query there waited out its timeouts (5 s x 2). torch's TCPStore formats
#: each peer's address, IPv4-mapped IPv6 (``::ffff:10.77.0.11``), by a reverse lookup /etc/hosts
#: cannot answer: 10 s per rendezvous connection. Names still resolve from /etc/hosts; DNS fails
#: at once (nothing listens on the node's loopback port 53).
NODE_RESOLV_CONF = "# ddp_hpc testcluster: names from /etc/hosts, no DNS inside the cluster\n" \
                   "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n"


def _start_slurmd(spec: ClusterSpec, i: int, node: str) -> None:
    # a private mount namespace: this node's local/NODE appears at nodelocal/ for slurmd and its
    # job steps only (propagation private, so nothing leaks to the host or the other nodes)
    inner = (f"mount --bind {shlex.quote(str(spec.local_backing(node)))} {shlex.quote(str(spec.local_dir))} && "
             f"hostname {shlex.quote(node)} && exec slurmd -f {shlex.quote(str(spec.slurm_conf))} "
             f"-N {shlex.quote(node)}")
    if spec.layout == "netns":
        resolv = spec.path("etc", "resolv.conf")
        resolv.write_text(NODE_RESOLV_CONF)
        bind = f"mount --bind {shlex.quote(str(resolv))} /etc/resolv.conf"
        inner = f"{{ [ ! -e /etc/resolv.conf ] || {bind}; }} && {inner}"
    argv = ["unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c", inner]
    if spec.layout == "netns":
        argv = ["nsenter", f"--net=/run/netns/{spec.netns_name(node)}", *argv]
    log = spec.path("log", f"slurmd-{node}.log")
    daemons.run(argv, spec, f"slurmd {node}", log=log)
    daemons.wait_for(lambda: daemons.alive(spec.path("run", f"slurmd-{node}.pid"), "slurmd"), 10,
                     f"slurmd {node} did not start", f"see {log}.", log=log)


def _wait_idle(spec: ClusterSpec, timeout: float = 60, ok=("idle",), nodes=None) -> None:
    """Wait until ``nodes`` (default: every node) are all in a state of ``ok``."""
    want = set(spec.node_names if nodes is None else nodes)

    def ready():
        states = {n: s for n, s in node_states(spec).items() if n in want}
        return set(states) == want and all(s in ok for s in states.values())
    try:
        daemons.wait_for(ready, timeout, "", "", interval=0.1)
    except ClusterError:
        raise ClusterError(f"nodes did not all become {'/'.join(ok)} within {timeout:.0f} s: "
                           f"{node_states(spec)}", f"see {spec.path('log')}/slurmd-*.log and "
                           "slurmctld.log.") from None


def _ensure_dbd_cluster(spec: ClusterSpec) -> None:
    """slurmctld registers its cluster with slurmdbd on start; add it by hand if it did not."""
    def listed():
        out = daemons.run(["sacctmgr", "-n", "-P", "list", "cluster", "format=cluster"], spec,
                          "sacctmgr", check=False).stdout.split()
        return spec.cluster_name in out
    if not listed():
        daemons.run(["sacctmgr", "-i", "add", "cluster", spec.cluster_name], spec, "sacctmgr add cluster",
                    check=False)
        daemons.wait_for(listed, 20, "slurmdbd does not list the cluster",
                         f"see {spec.path('log', 'slurmdbd.log')}.", interval=0.2)


def up(spec: ClusterSpec) -> dict:
    """Start the cluster (or reuse a healthy identical one); returns :func:`status`."""
    require_root_and_programs(spec)
    state = load_state(spec.state_dir)
    if state is not None:
        st = status(spec.state_dir)
        if st["healthy"] and state["spec"] == spec.to_json():
            if state.get("accounting_disabled"):
                set_accounting(spec.state_dir, True)
            return {**status(spec.state_dir), "reused": True}
        if st["healthy"]:
            raise ClusterError(f"a different cluster is already up in {spec.state_dir}: "
                               f"{state['spec']}", "run `python -m ddp_hpc.testcluster down` first.")
        down(spec.state_dir)
    daemons.check_ports_free(spec)
    network.check_names_free(spec)
    if spec.layout == "netns":
        network.check_subnet_free(spec)
    made_dir = not spec.state_dir.exists()
    _prepare_dir(spec)
    state = {"spec": spec.to_json(), "created": {"state_dir": made_dir}, "complete": False,
             "started_at": time.time()}
    save_state(spec, state)
    try:
        _build(spec, state)
    except BaseException:
        down(spec.state_dir)
        raise
    state["complete"] = True
    save_state(spec, state)
    return status(spec.state_dir)


class _Clock:
    """Seconds spent per start-up phase, kept in state.json (``status --json`` shows them)."""

    def __init__(self, state: dict):
        self.timings = state.setdefault("timings", {})
        self.t = time.monotonic()

    def __call__(self, phase: str) -> None:
        now = time.monotonic()
        self.timings[phase] = round(now - self.t, 3)
        self.t = now


def _build(spec: ClusterSpec, state: dict) -> None:
    created = state["created"]
    lap = _Clock(state)
    for f in spec.gpu_files():
        os.mknod(f, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    state["first_job_id"] = first_job_id()
    _write(spec.slurm_conf, render_slurm_conf(spec, first_job=state["first_job_id"]))
    _write(spec.path("etc", "gres.conf"), render_gres_conf(spec))
    _write(spec.path("etc", "plugstack.conf"), "")
    _start_munge(spec)
    lap("munge")
    if spec.layout == "netns":
        try:
            network.create(spec, created)
        finally:
            save_state(spec, state)
    created["hosts_block"] = True
    save_state(spec, state)
    network.add_hosts_block(spec)
    lap("network")
    if spec.slurmdbd:
        _start_mariadb(spec)
        lap("mariadb")
        _start_slurmdbd(spec)
        lap("slurmdbd")
    _start_slurmctld(spec, clean=True)
    lap("slurmctld")
    for i, node in enumerate(spec.node_names, 1):
        _start_slurmd(spec, i, node)
    lap("slurmd")
    _wait_idle(spec)
    lap("nodes idle")
    if spec.slurmdbd:
        _ensure_dbd_cluster(spec)
        lap("dbd cluster")


# -- accounting switch -------------------------------------------------------------------------------
def set_accounting(state_dir: Path, enabled: bool) -> None:
    """Switch a slurmdbd cluster between full accounting and jobcomp-only (as on a cluster without
    slurmdbd: ``sacct`` says accounting storage is disabled).  Restarts slurmctld, keeps jobs."""
    state = load_state(state_dir)
    if state is None:
        raise ClusterError(f"no cluster recorded in {state_dir}", "run `python -m ddp_hpc.testcluster up`.")
    spec = ClusterSpec.from_json(state["spec"])
    if not spec.slurmdbd:
        raise ClusterError("this cluster was started without slurmdbd", "`up --slurmdbd`.")
    if bool(state.get("accounting_disabled")) == (not enabled):
        return
    ctld = spec.path("run", "slurmctld.pid")
    daemons.stop_pidfile(ctld, "slurmctld", timeout=10)
    if enabled:
        _start_slurmdbd(spec)
    else:
        daemons.stop_pidfile(spec.path("run", "slurmdbd.pid"), "slurmdbd")
    _write(spec.slurm_conf, render_slurm_conf(spec, accounting=enabled, first_job=state.get("first_job_id")))
    state["accounting_disabled"] = not enabled
    save_state(spec, state)
    _start_slurmctld(spec, clean=False)
    _wait_idle(spec, ok=("idle", "mix", "alloc", "comp"))


# -- down ------------------------------------------------------------------------------------------
def down(state_dir: Path, *, keep_logs: bool = False) -> list[str]:
    """Stop everything the recorded cluster started and remove what it created (the daemons' logs
    too unless ``keep_logs``).  Returns a list of what was done; empty when nothing was recorded."""
    state = load_state(Path(state_dir))
    if state is None:
        return []
    spec = ClusterSpec.from_json(state["spec"])
    created = state.get("created", {})
    done = []
    if daemons.alive(spec.path("run", "slurmctld.pid"), "slurmctld"):
        daemons.run(["scancel", "--full", "--quiet", "-u", "root"], spec, "scancel", check=False)
        daemons.run(["scancel", "--quiet", "--state=PENDING"], spec, "scancel", check=False)
        try:  # let slurmstepd end its tasks itself; stragglers are killed below
            daemons.wait_for(lambda: not daemons.run(["squeue", "-h", "-o", "%i"], spec, "squeue",
                                                     check=False).stdout.strip(), 15, "", "")
        except ClusterError:
            pass
    table = daemon_table(spec)
    order = [n for n in table if n.startswith("slurmd ")] + ["slurmctld", "slurmdbd", "mariadb"]
    for name in order:
        if name in table and daemons.stop_pidfile(*table[name], timeout=10):
            done.append(f"stopped {name}")
    left = [p for p in daemons.leftover_pids(spec, network.netns_inodes(created))
            if p != daemons.alive(table["munged"][0], "munged")]
    if left:
        daemons.kill_pids(left)
        done.append(f"killed {len(left)} leftover job process(es)")
    if daemons.stop_pidfile(*table["munged"]):
        done.append("stopped munged")
    done += network.destroy(created)
    if created.get("hosts_block") and network.remove_hosts_block(spec):
        done.append("removed /etc/hosts block")
    done.append(_remove_files(spec, made_dir=bool(created.get("state_dir")), keep_logs=keep_logs))
    return done


def _remove_files(spec: ClusterSpec, *, made_dir: bool, keep_logs: bool) -> str:
    """Remove what ``up`` wrote under the state dir (the dir itself too when ``up`` made it)."""
    d = spec.state_dir
    keep = {"log"} if keep_logs else set()
    if made_dir and not keep:
        shutil.rmtree(d, ignore_errors=True)
        return f"removed {d}"
    for sub in [*_FRESH_DIRS, STAMP, spec.jobcomp_file.name]:
        if sub not in keep:
            target = d / sub
            if target.is_dir():
                shutil.rmtree(target, ignore_errors=True)
            else:
                target.unlink(missing_ok=True)
    state_path(d).unlink(missing_ok=True)
    return f"removed the cluster's files in {d}" + (f" (kept {d / 'log'})" if keep else "")
