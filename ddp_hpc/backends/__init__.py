"""The backends, by name: the one place a backend's name is looked up, and the one place a
checked spec is handed to a backend (``dispatch``).

    from ddp_hpc import backends
    backend, why = backends.choose(opts, cli)      # --backend NAME, or auto: which and why
    done = backends.dispatch(spec, backend, cli, SubmitOptions(wait=True))   # -> Submitted
    backends.get("sbatch"); backends.of_record(rec)

Each backend is one class of the ``Backend`` protocol (``base``): ``local`` (N x G processes
here), ``sbatch`` (a rendered batch script), ``submitit`` (Slurm through submitit). Everything
else (the command line, the Python API, cancel, resume, status's targets) holds a ``Backend`` and
asks it, never compares names. A new backend is a class and one ``register(...)`` call
(docs/architecture.md, "The Backend seam").

What they share lies here too, below ``ddp_hpc.status`` and the commands: the checked request
(``spec.JobSpec``), the sbatch script (``render``, pure), submitit's side of a Slurm job
(``slurmjob``) and the checks against sinfo (``checks``), the local driver (``localdriver``), a
Python function as a job (``functions``) and the wait for a Slurm job's end (``wait``). Nothing
in this package imports ``ddp_hpc.status`` or ``ddp_hpc.submit``.
"""

from __future__ import annotations

import shutil
import sys
from typing import Any, Sequence

from ddp_hpc.backends.base import Backend, SubmitOptions, Submitted, say
from ddp_hpc.backends.local import LocalBackend
from ddp_hpc.backends.sbatch import SbatchBackend
from ddp_hpc.backends.spec import JobSpec, SpecError
from ddp_hpc.backends.submitit import SubmititBackend
from ddp_hpc.config import JobConfig
from ddp_hpc.config.slurm_options import SlurmOptions
from ddp_hpc.slurm.cli import SlurmError

__all__ = ["Backend", "register", "unregister", "get", "of_record", "names", "choose",
           "check_options", "dispatch"]

#: name -> backend, in the order `names` lists them
REGISTRY: dict[str, Backend] = {}
#: names old or other writers of job records use: a batch script that registered itself
#: (`ddp-hpc records register`) is an sbatch job
ALIASES = {"sbatch-script": "sbatch"}


def register(backend: Backend) -> None:
    """Make ``backend`` known by its name: to ``--backend``, ``backend=``, ``slurm.backend`` and
    to the records it writes."""
    REGISTRY[backend.name] = backend


def unregister(name: str) -> None:
    """Forget a backend `register` added (a built-in one stays)."""
    if name not in _BUILT_IN:
        REGISTRY.pop(name, None)


def names() -> list[str]:
    """The registered backends' names, built-in first."""
    return list(REGISTRY)


def get(name: str, where: str = "--backend") -> Backend:
    """The backend called ``name``; a SpecError naming it, ``where`` it came from and the
    known names otherwise."""
    backend = REGISTRY.get(ALIASES.get(name, name))
    if backend is None:
        raise SpecError(f"{where} {name!r} names no backend",
                        f"use one of {', '.join(['auto', *REGISTRY])}")
    return backend


def of_record(rec: Any) -> Backend:
    """The backend that submitted a job record. A name no backend has (a record of another
    version) is read by its id: ``local-...`` ran here, anything else went to Slurm."""
    backend = REGISTRY.get(ALIASES.get(str(rec.backend), str(rec.backend)))
    if backend is not None:
        return backend
    return _LOCAL if str(rec.id).startswith("local-") else _SBATCH


def choose(opts: SlurmOptions, cli) -> tuple[Backend, str]:
    """(backend, why). ``auto`` needs both an sbatch on PATH and a controller that answers
    sinfo (Slurm's client tools are often installed where no cluster is configured); then
    submitit, or sbatch for a node range, which only it takes; else local."""
    if opts.backend != "auto":
        return get(opts.backend), "asked for with --backend" if opts.backend else "default"
    if not cli.available():
        return _LOCAL, "no `sbatch` on PATH, so this machine is not a Slurm login node"
    try:
        parts = cli.sinfo_partitions()
    except SlurmError as exc:   # a login node without a cluster configured: common, and no error
        cli.unreachable = str(exc).splitlines()[0]    # --verbose shows it
        return _LOCAL, "`sbatch` is installed, but no Slurm controller answered"
    why = (f"`sbatch` is on PATH and the controller answers (partitions: "
           f"{', '.join(p['name'] for p in parts) or 'none'})")
    if isinstance(opts.nodes, str):
        return _SBATCH, f"{why}; --nodes {opts.nodes} is a range, which only sbatch takes"
    return _SUBMITIT, why


CONTAINER_RUNTIMES = ("apptainer", "singularity")


def _able(flag: str, like: Backend) -> list[str]:
    """The names of the backends that take an option (``flag``: a capability of `Backend`), of
    the same kind as ``like`` (a scheduler's, or processes here) where there is one."""
    able = [b for b in REGISTRY.values() if getattr(b, flag)]
    return [b.name for b in ([b for b in able if b.runs_here == like.runs_here] or able)]


def _add(names: list[str]) -> str:
    return " or ".join(f"--backend {n}" for n in names)


def check_options(spec: JobSpec, backend: Backend, dry_run: bool = False,
                  path: str | None = None) -> None:
    """Refuse the options ``backend`` does not take (a node range, a container, the restarts
    inside the allocation), each naming the backends that do. A container runtime missing from
    this machine's PATH (``path``: PATH's value) is refused too, except in a dry run, which
    says so (the batch script checks the node's)."""
    o = spec.options
    if isinstance(o.nodes, str) and not backend.takes_node_range:
        raise SpecError(f"--nodes {o.nodes} is a range, which the {backend.name} backend cannot "
                        "take (it counts its tasks from one node count)",
                        f"use {_add(_able('takes_node_range', backend))} (or auto), or a count such as "
                        f"--nodes {spec.nodes}")
    given = [w for w, on in (("--spare-nodes", o.spare_nodes), ("--min-nodes", o.min_nodes is not None),
                             ("--restart-on-error", o.restart_on_error)) if on]
    able = _able("restarts_in_allocation", backend)
    if given and not backend.restarts_in_allocation:
        raise SpecError(f"{' and '.join(given)} restart the ranks inside the allocation, which only the "
                        f"{' or '.join(able)} backend does, not {backend.name}",
                        f"add {_add(able)} (docs/restarts.md says why submitit cannot)")
    if not o.container:
        return
    pyxis = f"with the pyxis plugin, --srun-arg container-image={o.container} works on every Slurm backend"
    able = _able("takes_container", backend)
    if not backend.takes_container:
        raise SpecError(f"--container {o.container} runs through the {' or '.join(able)} backend, "
                        f"not {backend.name}", f"add {_add(able)}; {pyxis}")
    if any(shutil.which(rt, path=path) for rt in CONTAINER_RUNTIMES):
        return
    problem = f"--container {o.container} needs apptainer or singularity, and neither is on PATH here"
    if dry_run:
        say(f"dry run: {problem}; the script checks the node's PATH as well")
        return
    raise SpecError(problem, "load or install one (e.g. `module load apptainer`) where "
                    f"you submit and on the nodes; {pyxis}")


def dispatch(spec: JobSpec, backend: Backend, cli, opts: SubmitOptions | None = None,
             task_cfgs: Sequence[JobConfig] | None = None) -> Submitted:
    """Run or submit a checked ``spec`` on ``backend`` (``cli``: the SlurmCLI it may ask):
    check what the backend takes, plan, then print the plan (a dry run: a batch script,
    submitit's parameters, the launcher commands; nothing written, no record) or submit it.
    ``task_cfgs``: each task's config, copied into its run directory (None for a script,
    module or function job)."""
    opts = opts or SubmitOptions()
    check_options(spec, backend, opts.dry_run)
    backend.check(spec, cli, opts.dry_run)
    plan = backend.plan(spec, task_cfgs)
    if opts.dry_run:
        sys.stdout.write(plan.shown())
        sys.stdout.flush()
        return Submitted(None)
    return backend.submit(plan, cli, opts)


_LOCAL, _SBATCH, _SUBMITIT = LocalBackend(), SbatchBackend(), SubmititBackend()
for _backend in (_LOCAL, _SBATCH, _SUBMITIT):
    register(_backend)
_BUILT_IN = frozenset(REGISTRY)
