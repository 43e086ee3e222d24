"""A node failure on the test cluster, on purpose: every process of one node (its slurmd, the
slurmstepd of its job steps, the ranks they run) killed at once, as when a machine dies; and the
node brought back afterwards (slurmd started again, the node resumed), so later tests have it.

    ddp-hpc testcluster ... (the cluster must be up)
    from ddp_hpc.testcluster.nodefail import fail_node, revive_node
    fail_node(state_dir, "n2")     # -> the pids killed
    revive_node(state_dir, "n2")   # slurmd again, `scontrol update NodeName=n2 State=RESUME`

Needs the netns layout (a node is the set of processes in its network namespace).
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

from ddp_hpc.testcluster import cluster, daemons
from ddp_hpc.testcluster.spec import ClusterError, ClusterSpec
from ddp_hpc.testcluster.state import load_state

__all__ = ["fail_node", "revive_node"]


def _spec(state_dir: Path) -> ClusterSpec:
    state = load_state(Path(state_dir))
    if state is None:
        raise ClusterError(f"no test cluster recorded in {state_dir}", "start one: ddp-hpc testcluster up")
    spec = ClusterSpec.from_json(state["spec"])
    if spec.layout != "netns":
        raise ClusterError("a node failure needs the netns layout (one namespace per node)",
                           "start the cluster with --layout netns")
    return spec


def node_pids(spec: ClusterSpec, node: str) -> list[int]:
    """Every process living in ``node``'s network namespace."""
    inode = os.stat(f"/run/netns/{spec.netns_name(node)}").st_ino
    return [pid for pid in daemons.leftover_pids(spec, {inode})
            if _net_inode(pid) == inode]


def _net_inode(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def fail_node(state_dir: Path, node: str) -> list[int]:
    """SIGKILL every process of ``node`` at once; returns their pids."""
    spec = _spec(state_dir)
    pids = node_pids(spec, node)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def revive_node(state_dir: Path, node: str, timeout: float = 60) -> None:
    """Start ``node``'s slurmd again and return the node to service."""
    spec = _spec(state_dir)
    i = list(spec.node_names).index(node)
    if not daemons.alive(spec.path("run", f"slurmd-{node}.pid"), "slurmd"):
        cluster._start_slurmd(spec, i, node)  # noqa: SLF001 - the same start as `up` uses
    daemons.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], spec, "scontrol",
                check=False)
    # this node only: the other nodes' jobs go on meanwhile (one completing is no reason to wait)
    cluster._wait_idle(spec, timeout, ok=("idle", "mix", "mixed", "alloc", "allocated"),  # noqa: SLF001
                       nodes=[node])
