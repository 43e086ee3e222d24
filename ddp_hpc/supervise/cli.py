"""``python -m ddp_hpc.supervise [OPTIONS] -- COMMAND...``: what the batch script of a job with
in-allocation restarts runs instead of ``srun COMMAND...`` (the renderer writes the line)."""
from __future__ import annotations

import argparse

from ddp_hpc.errors import HintError, report
from ddp_hpc.supervise.hang import DEFAULT_HANG_S
from ddp_hpc.supervise.loop import Settings, supervise
from ddp_hpc.supervise.plan import Policy
from ddp_hpc.text import ArgumentParser, HelpFormatter, prog

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog("supervise"), formatter_class=HelpFormatter,
                                description=__doc__)
    p.add_argument("--nodes", type=int, required=True, help="nodes the ranks run on (without spares)")
    p.add_argument("--tasks-per-node", type=int, required=True, help="ranks per node")
    p.add_argument("--max-restarts", type=int, default=2, help="in-allocation restarts at most")
    p.add_argument("--spare-nodes", type=int, default=0, help="nodes of the allocation standing by")
    p.add_argument("--min-nodes", type=int, default=None, help="go on with this few nodes at least")
    p.add_argument("--restart-on-error", action="store_true",
                   help="restart after an error raised by the code too")
    p.add_argument("--stall-timeout", type=float, default=0.0, metavar="S",
                   help="stop and restart a step with no training step for S seconds (0: off)")
    p.add_argument("--no-health-check", dest="health_check", action="store_false",
                   help="start the ranks without checking their nodes first (ddp_hpc.supervise.health)")
    p.add_argument("--hang-timeout", type=float, default=DEFAULT_HANG_S, metavar="S",
                   help="call a hang when no rank finished a step for max(S, 10x the median step "
                        "time) once steps are timed; its stacks name the rank (0: off)")
    p.add_argument("--warm-standby", action="store_true",
                   help="once the ranks train, keep a standby step whose ranks imported torch, and "
                        "hand it the next restart (ddp_hpc.supervise.warm)")
    p.add_argument("--log-dir", required=True, help="the run's log directory")
    p.add_argument("--srun-arg", action="append", default=[], metavar="WORD",
                   help="one word of the user's srun options (repeatable)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...: what every rank runs")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        if not command:
            raise HintError("no command given", "end the options with -- COMMAND...")
        for name, least in (("nodes", 1), ("tasks_per_node", 1), ("max_restarts", 0), ("spare_nodes", 0)):
            if getattr(args, name) < least:
                raise HintError(f"--{name.replace('_', '-')} {getattr(args, name)} is not >= {least}",
                                f"pass a number >= {least}")
        if args.hang_timeout < 0:
            raise HintError(f"--hang-timeout {args.hang_timeout:g} is negative",
                            "pass seconds >= 0 (0 turns the fast hang detection off)")
        if args.min_nodes is not None and not 1 <= args.min_nodes <= args.nodes:
            raise HintError(f"--min-nodes {args.min_nodes} is not between 1 and --nodes {args.nodes}",
                            "pass how few nodes the job may go on with, at most --nodes")
        policy = Policy(nodes=args.nodes, tasks_per_node=args.tasks_per_node,
                        max_restarts=args.max_restarts, spare_nodes=args.spare_nodes,
                        min_nodes=args.min_nodes, restart_on_error=args.restart_on_error)
        return supervise(Settings(policy=policy, log_dir=args.log_dir, command=tuple(command),
                                  srun_args=tuple(args.srun_arg), stall_timeout_s=args.stall_timeout,
                                  health_check=args.health_check,
                                  hang_timeout_s=args.hang_timeout, warm_standby=args.warm_standby))
    except HintError as exc:
        report(prog("supervise"), exc)
        return 2
