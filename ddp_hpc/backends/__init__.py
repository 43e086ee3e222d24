"""The backends, by name: the one place a backend's name is looked up, and the one place a
checked spec is handed to a backend (``dispatch``).

    from ddp_hpc import backends
    backend, why = backends.choose(opts)           # --backend NAME, or auto: which and why
    done = backends.dispatch(spec, backend, SubmitOptions(wait=True))   # -> Submitted
    backends.get("sbatch"); backends.of_record(rec); backends.of_record(None, job_id="1234")

Each backend is one class of the ``Backend`` protocol (``base``): ``local`` (N x G processes
here), ``sbatch`` (a rendered batch script), ``submitit`` (Slurm through submitit). The registry
keeps the classes; each lookup makes an instance, which owns its client (a Slurm backend's
``SlurmCLI``) for as long as its caller holds it. Everything else (the command line, the Python
API, cancel, resume, status) holds a ``Backend`` and asks it, never compares names or kinds. A
new backend is a class and one ``register(...)`` call (docs/architecture.md, "The Backend seam"),
in a module that ``$DDP_HPC_BACKENDS`` (``module:Class``, comma-separated) or an installed package's
``ddp_hpc.backends`` entry point names: the commands load those when they meet a name they do not
know, or list the names.

What they share lies here too, below ``ddp_hpc.status`` and the commands: the checked request
(``spec.JobSpec``), the sbatch script (``render``, pure), submitit's side of a Slurm job
(``slurmjob``) and the checks against sinfo (``checks``), the local driver (``localdriver``), a
Python function as a job (``functions``) and the wait for a Slurm job's end (``wait``). Nothing
in this package imports ``ddp_hpc.status`` or ``ddp_hpc.submit``.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import sys
from importlib.metadata import entry_points
from typing import Any, Callable, Sequence

from ddp_hpc.backends.base import Backend, SubmitOptions, Submitted, say
from ddp_hpc.backends.local import LocalBackend
from ddp_hpc.backends.sbatch import SbatchBackend
from ddp_hpc.backends.spec import JobSpec, SpecError
from ddp_hpc.backends.submitit import SubmititBackend
from ddp_hpc.config import JobConfig
from ddp_hpc.config.slurm_options import SlurmOptions
from ddp_hpc.slurm.cli import SlurmCLI, SlurmError

__all__ = ["Backend", "register", "unregister", "get", "of_record", "names", "choose",
           "check_options", "dispatch"]

#: name -> what makes the backend (its class), in the order `names` lists them
REGISTRY: dict[str, Callable[..., Backend]] = {}
#: names old or other writers of job records use: a batch script that registered itself
#: (`ddp-hpc records register`) is an sbatch job
ALIASES = {"sbatch-script": "sbatch"}


def register(backend: Callable[..., Backend]) -> None:
    """Make ``backend`` (a class of the ``Backend`` protocol, or anything that makes one with the
    keywords ``client`` and ``offline``) known by its ``name``: to ``--backend``, ``backend=``,
    ``slurm.backend`` and to the records it writes."""
    REGISTRY[backend.name] = backend


#: where the backends that are not built in are named (``module:Class`` or ``module``, comma-separated)
PLUGINS_VAR = "DDP_HPC_BACKENDS"
#: the entry point group an installed package names its backends in
ENTRY_POINTS = "ddp_hpc.backends"
_plugins_loaded = False


def load_plugins() -> None:
    """Register the backends ``$DDP_HPC_BACKENDS`` and the ``ddp_hpc.backends`` entry points
    name (once per process): ``module:Class`` registers the class, ``module`` alone is imported
    (it registers its own). One that does not load is a SpecError naming it and where it came from."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    named = [(f"${PLUGINS_VAR}", s.strip()) for s in os.environ.get(PLUGINS_VAR, "").split(",") if s.strip()]
    named += [(f"the {ENTRY_POINTS} entry point {ep.name!r}", ep.value) for ep in entry_points(group=ENTRY_POINTS)]
    for where, spec in named:
        module, _, attr = spec.partition(":")
        try:
            loaded = importlib.import_module(module)
            if attr:
                register(getattr(loaded, attr))
        except Exception as exc:   # anything a user's module raises: named, not a traceback
            raise SpecError(f"{where} names backend {spec!r}, which does not load: {type(exc).__name__}: {exc}",
                            f"fix the module, or take it out of {where}") from exc


def unregister(name: str) -> None:
    """Forget a backend `register` added (a built-in one stays)."""
    if name not in _BUILT_IN:
        REGISTRY.pop(name, None)


def names() -> list[str]:
    """The registered backends' names, built-in first."""
    load_plugins()
    return list(REGISTRY)


def get(name: str, where: str = "--backend", **made_with: Any) -> Backend:
    """The backend called ``name`` (a new instance; ``made_with``: its ``client``, ``offline``);
    a SpecError naming it, ``where`` it came from and the known names otherwise."""
    make = REGISTRY.get(ALIASES.get(name, name))
    if make is None:
        load_plugins()
        make = REGISTRY.get(name)
    if make is None:
        raise SpecError(f"{where} {name!r} names no backend",
                        f"use one of {', '.join(['auto', *REGISTRY])}")
    return make(**made_with)


_SLURM_ID = re.compile(r"^\d+(_\d+)?$")


def of_record(rec: Any, job_id: str | None = None, **made_with: Any) -> Backend:
    """The backend that submitted a job record (a new instance, ``made_with`` as `get`). A name
    no backend has (a record of another version), or no record (a job known by ``job_id``
    alone), is read by the id: ``local-...`` ran here, anything else went to Slurm."""
    name = str(rec.backend) if rec is not None else ""
    make = REGISTRY.get(ALIASES.get(name, name))
    if make is None and name:
        load_plugins()
        make = REGISTRY.get(name)
    if make is None:
        job_id = str(rec.id) if rec is not None else str(job_id)
        make = LocalBackend if job_id.startswith("local-") else SbatchBackend
    return make(**made_with)


def is_slurm_id(job_id: str) -> bool:
    """``1234`` or an array task ``1234_5`` (not a ``local-...`` id)."""
    return bool(_SLURM_ID.fullmatch(job_id))


def choose(opts: SlurmOptions, client: SlurmCLI | None = None) -> tuple[Backend, str]:
    """(backend, why). ``auto`` needs both an sbatch on PATH and a controller that answers
    sinfo (Slurm's client tools are often installed where no cluster is configured); then
    submitit, or sbatch for a node range, which only it takes; else local. ``client``: the
    SlurmCLI the Slurm backends use (None: their own); why no controller answered is kept as the
    local backend's ``unreachable`` (``submit -v`` shows it)."""
    if opts.backend != "auto":
        return get(opts.backend, client=client), "asked for with --backend" if opts.backend else "default"
    slurm = SubmititBackend(client=client)
    cli = slurm.client
    if not cli.available():
        return LocalBackend(), "no `sbatch` on PATH, so this machine is not a Slurm login node"
    try:
        parts = cli.sinfo_partitions()
    except SlurmError as exc:   # a login node without a cluster configured: common, and no error
        local = LocalBackend()
        local.unreachable = str(exc).splitlines()[0]    # --verbose shows it
        return local, "`sbatch` is installed, but no Slurm controller answered"
    why = (f"`sbatch` is on PATH and the controller answers (partitions: "
           f"{', '.join(p['name'] for p in parts) or 'none'})")
    if isinstance(opts.nodes, str):
        return SbatchBackend(client=cli), f"{why}; --nodes {opts.nodes} is a range, which only sbatch takes"
    return slurm, why


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


def dispatch(spec: JobSpec, backend: Backend, opts: SubmitOptions | None = None,
             task_cfgs: Sequence[JobConfig] | None = None) -> Submitted:
    """Run or submit a checked ``spec`` on ``backend``: check what the backend takes, plan, then
    print the plan (a dry run: a batch script, submitit's parameters, the launcher commands;
    nothing written, no record) or submit it.
    ``task_cfgs``: each task's config, copied into its run directory (None for a script,
    module or function job)."""
    opts = opts or SubmitOptions()
    check_options(spec, backend, opts.dry_run)
    backend.check(spec, opts.dry_run)
    plan = backend.plan(spec, task_cfgs)
    if opts.dry_run:
        sys.stdout.write(plan.shown())
        sys.stdout.flush()
        return Submitted(None)
    return backend.submit(plan, opts)


for _backend in (LocalBackend, SbatchBackend, SubmititBackend):
    register(_backend)
_BUILT_IN = frozenset(REGISTRY)
