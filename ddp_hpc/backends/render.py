"""Render a ``JobSpec`` into an sbatch script: a pure function (no files, no clock, no
environment), so the exact text is golden-tested and ``--dry-run`` shows what would be submitted.

The script is a plain, readable batch file a user could submit again by hand. What it does and
why:

- one task per GPU: ``--ntasks-per-node=G --gpus-per-node=G``; ``--nodes`` a count or sbatch's
  range ``MIN-MAX`` as given (the job runs with the nodes it got: ranks = nodes x G from Slurm's
  variables); ``--cpus-per-task`` from the spec, and ``SRUN_CPUS_PER_TASK`` exported because
  since Slurm 22.05 srun no longer inherits ``--cpus-per-task`` from the batch allocation;
  ``OMP_NUM_THREADS`` the task's CPUs unless the user set it (torch starts an intra-op thread per
  core it sees in every rank, and a node's ranks would share its cores many times over; torchrun
  sets 1);
- preemption: ``--signal=SIG@grace`` reaches every task of the step (the training core turns it
  into checkpoint + requeue), ``--requeue`` allows that, ``--open-mode=append`` keeps the first
  run's output after a requeue;
- ``srun --kill-on-bad-exit=1``: one dead rank ends the step instead of leaving the others
  blocked in a collective until the NCCL/gloo timeout;
- a node that failed: a restart placed again on a node that failed an earlier run requeues
  itself with that node in ``ExcNodeList`` (``ddp_hpc.supervise.avoid``) before srun starts;
- restarts inside the allocation (``--max-restarts N`` > 0, docs/restarts.md): the allocation
  asks for the spare nodes too and ``--no-kill`` (a lost node does not end it), and the batch step
  runs ``python -m ddp_hpc.supervise`` instead of ``srun``: it starts the ranks' srun step itself,
  and again on healthy nodes after a fault; with 0 the script is exactly what it was before;
- the user's srun options (``--srun-arg``) go on the srun line, each one quoted word; with
  ``--container IMAGE`` every rank runs as ``apptainer exec --nv IMAGE ...`` (or singularity),
  and the script stops with a clear message on a node that has neither;
- logs: the batch output and one ``rank%t.out`` per rank in the job's log directory, which is
  also ``DDP_HPC_LOG_DIR`` for the run logs; an array task gets its own directory; a job that
  resumes a stopped run exports ``DDP_HPC_RESTART_BASE`` (its restart numbers follow that run's);
- safety: every value that reaches shell code goes through ``shlex.quote``; values in
  ``#SBATCH`` lines were validated by ``ddp_hpc.config.SlurmOptions`` (no blanks, quotes or
  ``#``), which also lists the options passed on as they are (``sbatch_items``).
"""

from __future__ import annotations

import shlex

from ddp_hpc.backends.spec import JobSpec
from ddp_hpc.config.slurm_options import DEFAULT_HANG_TIMEOUT, sbatch_items
from ddp_hpc.exits import EX_TEMPFAIL
from ddp_hpc.runlogs.schema import batch_out, rank_out

__all__ = ["render", "sbatch_options", "srun_args", "stage_sbcast_lines"]


def sbatch_options(spec: JobSpec) -> list[tuple[str, str | None]]:
    """The ``#SBATCH`` options in order: (name, value or None for a flag)."""
    opts: list[tuple[str, str | None]] = [
        ("job-name", spec.name),
        ("nodes", spec.alloc_nodes),       # N (+ spares), or a range MIN-MAX as sbatch takes it
        ("ntasks-per-node", str(spec.tasks_per_node)),
        ("gpus-per-node", str(spec.gpus_per_node)),
        ("cpus-per-task", str(spec.cpus_per_task)),
        ("time", spec.time),
        ("signal", f"{spec.signal}@{spec.grace_s}"),
        ("requeue", None),
        ("open-mode", "append"),
    ]
    if spec.supervised:
        opts.append(("no-kill", None))
    if spec.is_array:
        opts.append(("output", f"{spec.log_dir}/task%a/{batch_out('%A_%a')}"))
        opts.append(("array", f"0-{len(spec.tasks) - 1}"))
    else:
        opts.append(("output", f"{spec.log_dir}/{batch_out('%j')}"))
    opts += sbatch_items(spec.options)
    for key, value in sorted(spec.options.sbatch_args.items()):
        opts.append((key, None if value is True or value is None or value == "" else str(value)))
    return opts


def _q(words) -> str:
    return " ".join(shlex.quote(str(w)) for w in words)


def render(spec: JobSpec) -> str:
    """The batch script for ``spec`` (text). Same spec, same text."""
    lines = [
        "#!/bin/bash",
        f"# ddp_hpc job {spec.name}: {spec.options.nodes} node(s) x {spec.tasks_per_node} task(s), one "
        f"task per GPU{f', array of {len(spec.tasks)} tasks' if spec.is_array else ''}.",
        "# Rendered by ddp_hpc.submit (sbatch backend); `sbatch <this file>` submits it again.",
    ]
    for key, value in sbatch_options(spec):
        lines.append(f"#SBATCH --{key}" if value is None else f"#SBATCH --{key}={value}")
    first = spec.tasks[0]
    lines += [
        "",
        "set -eu",
        "# srun does not inherit --cpus-per-task since Slurm 22.05",
        'export SRUN_CPUS_PER_TASK="${SLURM_CPUS_PER_TASK:-' + str(spec.cpus_per_task) + '}"',
        "# one OpenMP thread per CPU of a task unless set: torch would start one per core in every rank",
        'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$SRUN_CPUS_PER_TASK}"',
        f"cd {shlex.quote(spec.workdir)}",
        f"ARGS=({_q(spec.base_argv())})",
    ]
    if spec.is_command:   # what ddp_hpc.preemption listens for in the user's script
        lines.insert(-1, f"export DDP_HPC_PREEMPT_SIGNAL={spec.signal}")
    if not spec.exclude_failed_nodes:   # preempt.exclude_failed_nodes=false
        lines.insert(-1, "export DDP_HPC_EXCLUDE_FAILED_NODES=0")
    if spec.restart_base:   # resumes a stopped run: its restart numbers follow that run's
        lines.insert(-1, f"export DDP_HPC_RESTART_BASE={int(spec.restart_base)}")
    for key, value in spec.stage_environ().items():   # --stage: what each node copies first
        lines.insert(-1, f"export {key}={shlex.quote(value)}")
    if spec.is_array:
        lines.append('case "${SLURM_ARRAY_TASK_ID:-}" in')
        for task in spec.tasks:
            extra = f"; ARGS+=({_q(task.overrides)})" if task.overrides else ""
            lines.append(f"  {task.task_id}) LOG_DIR={shlex.quote(task.log_dir)}{extra} ;;")
        lines.append('  *) echo "ddp_hpc: no task ${SLURM_ARRAY_TASK_ID:-(unset)} in this array"'
                     " >&2; exit 2 ;;")
        lines.append("esac")
    else:
        lines.append(f"LOG_DIR={shlex.quote(first.log_dir)}")
    lines += [
        'export DDP_HPC_LOG_DIR="$LOG_DIR"',
        'mkdir -p "$LOG_DIR"',
        'echo "ddp_hpc: job ${SLURM_JOB_ID:-?} restart ${SLURM_RESTART_COUNT:-0} on '
        '${SLURM_JOB_NODELIST:-?}, logs in $LOG_DIR"',
        f"# a restart placed on a node that failed an earlier run requeues itself off it (exit {EX_TEMPFAIL})",
        'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then',
        f'  rc=0; {shlex.quote(spec.python)} -m ddp_hpc.supervise.avoid "$LOG_DIR" || rc=$?',
        f'  if [ "$rc" = {EX_TEMPFAIL} ]; then exit 0; fi',
        "fi",
        *stage_sbcast_lines(spec),
        *_container_lines(spec),
        _step_line(spec),
        "",
    ]
    return "\n".join(lines)


def _step_line(spec: JobSpec) -> str:
    """The batch step's last line: srun (a fault ends the job), or the supervisor that runs srun
    and restarts the ranks inside the allocation."""
    if not spec.supervised:
        return ('exec srun --kill-on-bad-exit=1 --open-mode=append --output="$LOG_DIR/'
                + rank_out("%t") + '"' + "".join(f" {shlex.quote(a)}" for a in srun_args(spec))
                + ' "${ARGS[@]}"')
    o = spec.options
    words = [spec.python, "-m", "ddp_hpc.supervise", "--nodes", spec.nodes, "--tasks-per-node",
             spec.tasks_per_node, "--max-restarts", o.max_restarts]
    words += ["--spare-nodes", o.spare_nodes] if o.spare_nodes else []
    low, high = o.node_range   # a range job goes on with as few nodes as it may start on
    least = o.min_nodes if o.min_nodes is not None else (low if low != high else None)
    words += ["--min-nodes", least] if least is not None else []
    words += ["--restart-on-error"] if o.restart_on_error else []
    words += ["--stall-timeout", f"{spec.stall_timeout_s:g}"] if spec.stall_timeout_s else []
    words += ["--hang-timeout", f"{o.hang_timeout:g}"] if o.hang_timeout != DEFAULT_HANG_TIMEOUT else []
    words += ["--warm-standby"] if o.warm_standby else []
    words += ["--no-health-check"] if not o.health_check else []
    words += [f"--srun-arg={a}" for a in srun_args(spec)]
    return ("# the supervisor starts the ranks with srun and again after a fault (docs/restarts.md)\n"
            f'exec {_q(words)} --log-dir "$LOG_DIR" -- "${{ARGS[@]}}"')


def srun_args(spec: JobSpec) -> list[str]:
    """The user's srun options (``--srun-arg`` / ``slurm.srun_args``), one word each, by name."""
    return [f"--{key}" if value is True or value is None or value == "" else f"--{key}={value}"
            for key, value in sorted(spec.options.srun_args.items())]


def stage_sbcast_lines(spec: JobSpec) -> list[str]:
    """``--stage`` on several nodes (a file, an LMDB, a folder as one archive): Slurm's sbcast
    reads it once and puts it on every node, where the ranks adopt it (``ddp_hpc.data.sbcast``);
    a failed sbcast only means each node copies it. First runs only: a requeue reuses the nodes'
    copies."""
    items = spec.stage_sbcast()
    if not items:
        return []
    lines = ['if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then']
    for item in items:   # item.name: letters, digits and _ (ddp_hpc.data.scriptstage)
        lines.append(f"  {shlex.quote(spec.python)} -m ddp_hpc.data sbcast {shlex.quote(item.src)} --to auto"
                     f' || echo "ddp_hpc: sbcast of --stage {item.name} failed; each node copies it" >&2')
    return [*lines, "fi"]


def _container_lines(spec: JobSpec) -> list[str]:
    """With ``--container IMAGE``: each rank runs as ``apptainer exec --nv IMAGE ARGS...`` (or
    singularity), checked on the node, since the submitting machine's PATH proves nothing there."""
    if not spec.options.container:
        return []
    image = shlex.quote(spec.options.container)
    return [
        "# each rank runs in the container; the runtime must be on the node",
        "RUNTIME=$(command -v apptainer || command -v singularity || true)",
        'if [ -z "$RUNTIME" ]; then',
        f'  echo "ddp_hpc: --container {image}: neither apptainer nor singularity is on PATH on '
        '$(hostname)" >&2; exit 2',
        "fi",
        f'ARGS=("$RUNTIME" exec --nv {image} "${{ARGS[@]}}")',
    ]
