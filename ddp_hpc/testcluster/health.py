"""Is the recorded test cluster alive: daemons by pid file, nodes by ``sinfo``."""

from __future__ import annotations

from pathlib import Path

from . import daemons
from .spec import ClusterSpec
from .state import load_state


def daemon_table(spec: ClusterSpec) -> dict[str, tuple[Path, str]]:
    run = spec.path("run")
    table = {"munged": (run / "munged.pid", "munged")}
    if spec.slurmdbd:
        table["mariadb"] = (run / "mysqld.pid", "mariadbd")
        table["slurmdbd"] = (run / "slurmdbd.pid", "slurmdbd")
    table["slurmctld"] = (run / "slurmctld.pid", "slurmctld")
    for node in spec.node_names:
        table[f"slurmd {node}"] = (run / f"slurmd-{node}.pid", "slurmd")
    return table


def node_states(spec: ClusterSpec) -> dict[str, str]:
    proc = daemons.run(["sinfo", "-h", "-N", "-o", "%N %t"], spec, "sinfo", check=False, timeout=15)
    states = {}
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1]
    return states


def status(state_dir: Path) -> dict:
    """What runs and in which state; ``healthy`` when every daemon is alive and nodes are usable."""
    state = load_state(state_dir)
    if state is None:
        return {"up": False, "state_dir": str(state_dir), "healthy": False}
    spec = ClusterSpec.from_json(state["spec"])
    procs = {name: daemons.alive(pidfile, prog) for name, (pidfile, prog) in daemon_table(spec).items()}
    if state.get("accounting_disabled"):
        procs.pop("slurmdbd", None)
    nodes = node_states(spec) if procs.get("slurmctld") else {}
    usable = {"idle", "mix", "alloc", "comp"}
    healthy = state.get("complete", False) and all(procs.values()) and \
        set(nodes) == set(spec.node_names) and all(s in usable for s in nodes.values())
    return {"up": True, "healthy": healthy, "state_dir": str(spec.state_dir), "spec": spec.to_json(),
            "daemons": procs, "nodes": nodes, "slurm_conf": str(spec.slurm_conf),
            "accounting": accounting_mode(spec, state), "created": state.get("created", {}),
            "timings": state.get("timings", {})}


def accounting_mode(spec: ClusterSpec, state: dict) -> str:
    return "slurmdbd" if spec.slurmdbd and not state.get("accounting_disabled") else "jobcomp"
