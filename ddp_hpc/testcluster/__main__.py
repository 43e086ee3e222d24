"""A real multi-node Slurm on this machine (root, Debian's slurm-wlm): for trying ddp_hpc and for tests.

  install [--slurmdbd]           apt-get slurm-wlm, munge (and MariaDB + slurmdbd)
  up [--nodes N] [--slurmdbd]    start it (a healthy identical cluster is reused)
  status [--json]                daemons and node states
  down [--keep-logs]             stop it and remove everything it made
  run [--keep] -- CMD ...        up, CMD with SLURM_CONF set, down; holds the machine's cluster
                                 lock throughout so a pytest session cannot replace it
  accounting-on|accounting-off   switch a --slurmdbd cluster to jobcomp-only and back
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ddp_hpc.errors import report
from ddp_hpc.text import ArgumentParser, HelpFormatter, prog

from . import lock
from .cluster import down, set_accounting, status, up
from .spec import DEFAULT_PORT_BASE, DEFAULT_STATE_DIR, DEFAULT_SUBNET, LAYOUTS, ClusterError, ClusterSpec

PACKAGES = ["slurm-wlm", "munge", "iproute2"]
DB_PACKAGES = ["mariadb-server", "slurmdbd"]


def install(slurmdbd: bool) -> int:
    """apt-get the Debian packages the cluster needs (the package scripts start no daemons we use)."""
    if os.geteuid() != 0:
        raise ClusterError("installing packages needs root", "run it with sudo.")
    if not shutil.which("apt-get"):
        raise ClusterError("apt-get not found: this installer knows Debian/Ubuntu only",
                           f"install {' '.join(PACKAGES + DB_PACKAGES)} with your package manager.")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    pkgs = PACKAGES + (DB_PACKAGES if slurmdbd else [])
    subprocess.run(["apt-get", "update", "-q"], env=env, check=True)
    subprocess.run(["apt-get", "install", "-y", "-q", *pkgs], env=env, check=True)
    return 0


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog("testcluster"), description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("command", choices=["up", "down", "status", "run", "install", "accounting-on",
                                       "accounting-off"], metavar="COMMAND",
                   help="up, down, status, run, install, accounting-on or accounting-off (see above)")
    p.add_argument("--nodes", type=int, default=4, help="number of nodes n1..nN")
    p.add_argument("--gpus-per-node", type=int, default=4, help="fake GPUs per node (GRES)")
    p.add_argument("--layout", choices=LAYOUTS, default="netns",
                   help="netns: own address and hostname per node; loopback: all on 127.0.0.1")
    p.add_argument("--slurmdbd", action="store_true", help="also run MariaDB + slurmdbd (full sacct)")
    p.add_argument("--state-dir", type=Path, default=Path(os.environ.get("DDP_HPC_TESTCLUSTER_DIR",
                                                                           DEFAULT_STATE_DIR)),
                   help="where the cluster keeps its config, logs, spool and shared folder "
                        "(DDP_HPC_TESTCLUSTER_DIR)")
    p.add_argument("--subnet", default=DEFAULT_SUBNET, help="private /24 for the netns bridge")
    p.add_argument("--port-base", type=int, default=DEFAULT_PORT_BASE,
                   help="slurmctld listens on base+17, slurmdbd base+19, MariaDB base+6")
    p.add_argument("--node-prefix", default="n", help="node names are PREFIX1..PREFIXN")
    p.add_argument("--json", action="store_true", help="status as JSON")
    p.add_argument("--lock-wait", type=float, default=0.0, metavar="SECONDS",
                   help=f"wait this long for {lock.LOCK_FILE} when a test session holds it")
    p.add_argument("--keep", action="store_true", help="run: leave the cluster up afterwards")
    p.add_argument("--keep-logs", action="store_true", help="down: keep the daemons' logs (log/)")
    return p


def _spec(args) -> ClusterSpec:
    return ClusterSpec(nodes=args.nodes, gpus_per_node=args.gpus_per_node, layout=args.layout,
                       slurmdbd=args.slurmdbd, state_dir=args.state_dir, subnet=args.subnet,
                       port_base=args.port_base, node_prefix=args.node_prefix)


def _up(spec: ClusterSpec) -> dict:
    t0 = time.monotonic()
    st = up(spec)
    print(_describe(st))
    if st.get("reused"):
        took = "already up, reused"
    else:
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in st.get("timings", {}).items())
        took = f"up in {time.monotonic() - t0:.1f} s ({phases})"
    print(f"{took}; use it with:\n  export SLURM_CONF={st['slurm_conf']}", flush=True)
    return st


def _run(args) -> int:
    """Run one command against the cluster while holding the lock (no test session interferes)."""
    cmd = args.cmd
    if not cmd:
        raise ClusterError("run needs a command", "python -m ddp_hpc.testcluster run -- srun -N2 hostname")
    st = _up(_spec(args))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = st["slurm_conf"]
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    try:
        return subprocess.run(cmd, env=env).returncode
    finally:
        if not args.keep:
            print("\n".join(down(args.state_dir)), flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[argv.index("--") + 1:] if "--" in argv else []
    args = _parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.cmd = cmd
    held = None
    try:
        if args.command == "install":
            return install(args.slurmdbd)
        if args.cmd and args.command != "run":
            raise ClusterError(f"unexpected command {args.cmd} after `--`", "only `run` takes one.")
        if args.command != "status":
            held = lock.acquire(args.lock_wait)
            if held is None:
                raise ClusterError(f"the test cluster is in use: {lock.LOCK_FILE} is held by "
                                   f"{lock.holder()}", "wait for that test session to end "
                                   "(or pass --lock-wait SECONDS).")
        if args.command == "down":
            t0 = time.monotonic()
            done = down(args.state_dir, keep_logs=args.keep_logs)
            print("\n".join(done) if done else f"no cluster recorded in {args.state_dir}")
            print(f"down in {time.monotonic() - t0:.1f} s")
            return 0
        if args.command == "status":
            st = status(args.state_dir)
            print(json.dumps(st, indent=1) if args.json else _describe(st))
            return 0 if st["healthy"] else 1
        if args.command in ("accounting-on", "accounting-off"):
            set_accounting(args.state_dir, args.command == "accounting-on")
            print(_describe(status(args.state_dir)))
            return 0
        if args.command == "run":
            return _run(args)
        _up(_spec(args))
        return 0
    except ClusterError as exc:
        report(prog("testcluster"), exc)
        return 2
    finally:
        lock.release(held)


def _describe(st: dict) -> str:
    if not st["up"]:
        return f"no cluster recorded in {st['state_dir']}"
    spec = st["spec"]
    lines = [f"cluster {spec['cluster_name']} ({spec['layout']}, {spec['nodes']} nodes x "
             f"{spec['gpus_per_node']} fake GPUs, accounting: {st['accounting']}) in {st['state_dir']}: "
             f"{'healthy' if st['healthy'] else 'NOT healthy'}"]
    lines += [f"  {name:<12} {'pid ' + str(pid) if pid else 'not running'}" for name, pid in st["daemons"].items()]
    lines += [f"  node {n}: {s}" for n, s in sorted(st["nodes"].items())]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
