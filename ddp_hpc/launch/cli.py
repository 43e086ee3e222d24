"""``python -m ddp_hpc.launch`` / ``ddp-hpc launch``: a command as N pretend nodes x G processes.

Without a command it runs a small DDP demo (gloo on CPU) through `launch_distributed`.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Sequence

from ddp_hpc.errors import report
from ddp_hpc.launch.local import LocalResult, run_local
from ddp_hpc.launch.spawn import RankFailedError, launch_distributed
from ddp_hpc.launch.tree import LaunchError, new_job_id
from ddp_hpc.runlogs.schema import rank_out
from ddp_hpc.text import ArgumentParser, HelpFormatter, plural, prog

EXIT_USAGE = 2
EXAMPLES = """examples:
  %(prog)s    # the 2 x 2 DDP demo on CPU
  %(prog)s --nodes 1 --procs-per-node 2 -- python -m ddp_hpc.run jobs/demo.yaml
  %(prog)s --nodes 2 --procs-per-node 2 --log-dir /tmp/l -- python train.py --lr 0.1

Rank 0's output is shown as it runs; every rank's output (stdout and stderr) is appended to
LOG_DIR/rankR.out, and the run logs of ddp_hpc.run, ddp_hpc.exec and ddp_hpc.report go to LOG_DIR
too (DDP_HPC_LOG_DIR). The first rank to exit non-zero stops the others, and its exit status is this
command's. Ctrl-C / SIGTERM are passed on to the ranks (10 s to finish, a second one kills)."""


def _parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(
        prog=prog("launch"), formatter_class=HelpFormatter, epilog=EXAMPLES,
        usage="%(prog)s [--nodes N] [--procs-per-node G] [--log-dir DIR] [--job-id ID] "
              "[--timeout S] [-- CMD ...]",
        description="Run a command (after --) once per rank with the local launcher's rank "
                    "variables, or, without a command, a small DDP demo on CPU (gloo).")
    ap.add_argument("--nodes", type=int, default=2, metavar="N", help="pretend nodes")
    ap.add_argument("--procs-per-node", type=int, default=2, metavar="G",
                    help="processes per pretend node")
    ap.add_argument("--log-dir", metavar="DIR",
                    help="where rank R's output goes, as rankR.out, and the run logs (rankR.log, "
                         "nodeK.events.jsonl: DDP_HPC_LOG_DIR for the ranks) (default: runs/<job id>)")
    ap.add_argument("--job-id", metavar="ID",
                    help="DDP_HPC_JOB_ID for the ranks (default: local-<date>-<time>-<hex>)")
    ap.add_argument("--timeout", type=float, default=300.0, metavar="S",
                    help="demo only: give up after this many seconds")
    return ap


def _parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, cmd = argv[:i], argv[i + 1:]
    ap = _parser()
    args, extra = ap.parse_known_args(argv)
    if extra:
        raise LaunchError(f"unrecognized arguments: {' '.join(extra)}",
                          f"put the command after `--`, e.g. {ap.prog} --nodes 1 "
                          f"--procs-per-node 2 -- {' '.join(extra)}")
    if args.job_id is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", args.job_id):
        raise LaunchError(f"--job-id={args.job_id!r} may use only letters, digits, '.', '_' and '-'",
                          "it names the log directory, e.g. --job-id my-run.1")
    for name in ("nodes", "procs_per_node"):
        if getattr(args, name) < 1:
            raise LaunchError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    return args, cmd


def _log_files(log_dir: Path, world: int) -> str:
    """``DIR/rank0.out`` or ``DIR/rank0.out ... rank3.out``."""
    last = f" ... {rank_out(world - 1)}" if world > 1 else ""
    return f"{log_dir / rank_out(0)}{last}"


def _run_command(args: argparse.Namespace, cmd: list[str]) -> int:
    world = args.nodes * args.procs_per_node
    job_id = args.job_id or new_job_id()
    log_dir = Path(args.log_dir or Path("runs") / job_id)
    print(f"ddp_hpc launch: {plural(world, 'rank')} ({plural(args.nodes, 'pretend node')} x "
          f"{args.procs_per_node}) of {shlex.join(cmd)}\nrank 0's output follows; every rank's "
          f"goes to {log_dir / rank_out('R')}", flush=True)
    # rank 0's prints show up as they happen; the run logs (ddp_hpc.run, exec, report) go beside rankR.out
    env = {"PYTHONUNBUFFERED": "1", **os.environ, "DDP_HPC_LOG_DIR": str(log_dir.resolve())}
    try:
        res = run_local(cmd, nodes=args.nodes, procs_per_node=args.procs_per_node,
                        log_dir=log_dir, job_id=job_id, env=env, echo=sys.stdout)
    except OSError as exc:
        report(prog("launch"), LaunchError(f"cannot start {cmd[0]!r}: {exc.strerror or exc}",
                                           "check the program's name or path"))
        return EXIT_USAGE
    except LaunchError as exc:     # a layout this machine's GPUs cannot hold
        report(prog("launch"), exc)
        return EXIT_USAGE
    _summarize(res, world, log_dir)
    return res.exitcode


def _summarize(res: LocalResult, world: int, log_dir: Path) -> None:
    """The verdict line, then where every rank's output is."""
    logs = f"logs: {_log_files(log_dir, world)}"
    if res.interrupted:
        print(f"interrupted by {res.interrupted}; ranks stopped\n{logs}", file=sys.stderr)
    elif res.first_failed_rank is not None:
        r = res.first_failed_rank
        print(f"FAILED: rank {r} exited with {res.returncodes[r]}; see {log_dir / rank_out(r)}"
              f"\n{logs}", file=sys.stderr)
    else:
        print(f"OK: {'rank 0' if world == 1 else f'all {world} ranks'} exited 0\n{logs}")


def _demo(args: argparse.Namespace) -> int:
    world = args.nodes * args.procs_per_node
    print(f"ddp_hpc demo: {plural(world, 'process')} on "
          f"{plural(args.nodes, 'pretend node')}, gloo on CPU", flush=True)
    try:
        losses = launch_distributed(_demo_rank, world, nodes=args.nodes, timeout=args.timeout)
    except (RankFailedError, TimeoutError) as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    print("final loss per rank: " + ", ".join(f"{x:.4f}" for x in losses))
    print(f"OK: {plural(world, 'rank')} agreed on all_reduce and on the DDP parameters")
    return 0


def _demo_rank(rank: int, world_size: int, steps: int = 5) -> float:
    """One rank of the demo: setup_ddp, an all_reduce check, a few DDP SGD steps."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_hpc.dist import cleanup_ddp, setup_ddp

    ctx = setup_ddp()
    try:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        expected = world_size * (world_size + 1) / 2
        if t.item() != expected:
            raise RuntimeError(f"all_reduce gave {t.item()}, expected {expected}")
        torch.manual_seed(0)  # same initial weights everywhere (DDP also broadcasts rank 0's)
        model = DDP(torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data shard
        w_true = torch.arange(8, dtype=torch.float32) / 8
        for step in range(steps):
            x = torch.randn(32, 8, generator=gen)
            loss = torch.nn.functional.mse_loss(model(x).squeeze(1), x @ w_true)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sys.stdout.write(f"[rank {rank}/{world_size} node {ctx.env.node_rank}] step {step} "
                             f"loss {loss.item():.4f}\n")  # one write: lines do not interleave
            sys.stdout.flush()
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(gathered, flat)
        if not all(torch.equal(g, flat) for g in gathered):
            raise RuntimeError("DDP replicas diverged: parameters differ between ranks")
        return loss.item()
    finally:
        cleanup_ddp()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args, cmd = _parse(argv)
    except LaunchError as exc:
        report(prog("launch"), exc)
        return EXIT_USAGE
    return _run_command(args, cmd) if cmd else _demo(args)
