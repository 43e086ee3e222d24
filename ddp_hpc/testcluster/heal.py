"""The test cluster heals itself between tests: a node that a test left out of service (drained
with "Kill task failed" after a step outlived SIGKILL, down, failing, its slurmd dead) is named
and brought back, so one bad node never fails the tests after it (tests/conftest.py calls `heal`
before and after each cluster test).

    from ddp_hpc.testcluster.heal import heal
    heal(state_dir)    # -> {"n2": "drained (Kill task failed)"}: what was found and resumed

Bringing a node back: its slurmd started again when it is not running (both layouts), then
``scontrol update NodeName=N State=RESUME``, then a wait until it takes work again. A drain whose
reason starts with `DELIBERATE` is a test's own (it resumes the node itself) and is left alone;
so is every node not in ``nodes`` (a test that kills a node on purpose owns it meanwhile).
"""
from __future__ import annotations

from pathlib import Path

from ddp_hpc.testcluster import cluster, daemons
from ddp_hpc.testcluster.spec import ClusterError, ClusterSpec
from ddp_hpc.testcluster.state import load_state

__all__ = ["sick_nodes", "heal", "DELIBERATE"]

#: how a test that drains a node on purpose starts its reason (``scontrol update ... reason=``)
DELIBERATE = "ddp_hpc"

#: words of sinfo's %T that take a node out of service (running steps may go on, new ones do not)
_OUT = ("drain", "down", "fail", "maint", "inval", "reboot")
#: states a node takes work in again
_USABLE = ("idle", "mix", "mixed", "alloc", "allocated", "comp", "completing")


def sick_nodes(spec: ClusterSpec) -> dict[str, str]:
    """node -> ``state (reason)`` for each node out of service or not responding (``*``)."""
    proc = daemons.run(["sinfo", "-h", "-N", "-o", "%N|%T|%E"], spec, "sinfo", check=False, timeout=15)
    out: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        node, _, rest = line.partition("|")
        state, _, reason = rest.partition("|")
        text = state.strip().lower()
        why = reason.strip()
        if why.startswith(DELIBERATE):
            continue
        if node in spec.node_names and (text.endswith("*") or any(w in text for w in _OUT)):
            out[node] = f"{text} ({why})" if why and why.lower() != "none" else text
    return out


def heal(state_dir: str | Path, nodes=None, timeout: float = 60) -> dict[str, str]:
    """Bring back every node of ``nodes`` (default: all) that `sick_nodes` names; returns what was
    found (empty: all were well). A node that does not come back within ``timeout`` raises
    `ClusterError` naming it."""
    state = load_state(Path(state_dir))
    if state is None:
        return {}
    spec = ClusterSpec.from_json(state["spec"])
    sick = {n: s for n, s in sick_nodes(spec).items() if nodes is None or n in nodes}
    for node in sick:
        i = list(spec.node_names).index(node)
        if not daemons.alive(spec.path("run", f"slurmd-{node}.pid"), "slurmd"):
            cluster._start_slurmd(spec, i, node)  # noqa: SLF001 - the same start as `up` uses
        daemons.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], spec, "scontrol",
                    check=False)
    if sick:
        try:
            cluster._wait_idle(spec, timeout, ok=_USABLE, nodes=list(sick))  # noqa: SLF001
        except ClusterError as exc:
            raise ClusterError(f"test cluster: could not bring back {', '.join(sick)} "
                               f"({'; '.join(f'{n}: {s}' for n, s in sick.items())}): {exc}",
                               f"see {spec.path('log')}") from exc
    return sick
