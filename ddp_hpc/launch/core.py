"""Local multi-process launch: the laptop stand-in for ``srun``.

Two launchers share one environment contract (docs/architecture.md): every process gets the
torchrun-style variables RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
MASTER_PORT plus DDP_HPC_LAUNCHER=local, DDP_HPC_NUM_NODES and DDP_HPC_JOB_ID, so
``ddp_hpc.env.detect()`` derives the same DistEnv it would on a cluster.

- ``launch_distributed(fn, world_size)`` runs a Python function in spawned processes and hands
  back each rank's return value. The first rank to fail raises ``RankFailedError`` in the caller
  and every other rank is killed at once: a rank blocked in a collective waiting for a dead peer
  would otherwise hang until the 30-minute collective timeout.
- ``run_local(argv, ...)`` runs a command once per rank with per-rank log files; the ``local``
  submit backend and ``python -m ddp_hpc.launch -- CMD`` use it.

``python -m ddp_hpc.launch --nodes 2 --procs-per-node 2`` without a command runs a small DDP demo.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import wait as mp_wait
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import psutil

__all__ = [
    "RankFailedError", "launch_distributed", "local_rank_env", "free_port", "node_layout",
    "LocalRun", "LocalResult", "start_local", "run_local", "main",
]

KILL_GRACE_S = 3.0  # SIGTERM first, SIGKILL after this many seconds
EXIT_GRACE_S = 30.0  # a rank that sent its result gets this long to exit before it is killed


class RankFailedError(RuntimeError):
    """A rank of a local launch failed; the first failure (by time) is the one reported."""

    def __init__(self, rank: int, exc_type: str, message: str, traceback_text: str = "",
                 exitcode: int | None = None):
        self.rank, self.exc_type, self.message = rank, exc_type, message
        self.traceback_text, self.exitcode = traceback_text, exitcode
        text = f"rank {rank} failed: {exc_type}: {message}"
        if traceback_text:
            text += f"\n--- traceback of rank {rank} ---\n{traceback_text.rstrip()}"
        super().__init__(text)

    def __reduce__(self):  # keep the attributes when pickled (e.g. across another launch)
        return (type(self), (self.rank, self.exc_type, self.message, self.traceback_text,
                             self.exitcode))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it; a tiny race is possible)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def node_layout(world_size: int, nodes: int | Sequence[int]) -> list[int]:
    """Processes per pretend node: ``nodes`` as a count (even split) or explicit counts (3, 1)."""
    if isinstance(nodes, int):
        if nodes < 1 or world_size < 1 or world_size % nodes:
            raise ValueError(
                f"world_size={world_size} does not split evenly over nodes={nodes}\n"
                f"HINT: pass nodes as per-node counts, e.g. nodes=(3, 1), for an uneven layout")
        return [world_size // nodes] * nodes
    counts = [int(n) for n in nodes]
    if not counts or min(counts) < 1 or sum(counts) != world_size:
        raise ValueError(
            f"nodes={tuple(counts)} must be positive per-node counts summing to "
            f"world_size={world_size}\nHINT: e.g. nodes=(3, 1) for world_size=4")
    return counts


def local_rank_env(counts: Sequence[int], master_port: int, job_id: str,
                   master_addr: str = "127.0.0.1") -> list[dict[str, str]]:
    """The local-launcher variables of every rank, ranks laid out node by node."""
    world, out = sum(counts), []
    for node, n in enumerate(counts):
        for local in range(n):
            out.append({
                "RANK": str(len(out)), "LOCAL_RANK": str(local), "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(n), "GROUP_RANK": str(node),
                "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
                "DDP_HPC_LAUNCHER": "local", "DDP_HPC_NUM_NODES": str(len(counts)),
                "DDP_HPC_JOB_ID": job_id,
            })
    return out


def thread_env(procs_per_node: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """OMP_NUM_THREADS for ranks sharing a machine (cores // ranks, at least 1), unless set:
    torch's default of one thread per core in every rank oversubscribes the CPU (torchrun
    does the same)."""
    environ = os.environ if environ is None else environ
    if "OMP_NUM_THREADS" in environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // max(1, procs_per_node)))}


def _limit_threads() -> None:
    """Apply OMP_NUM_THREADS in a child where torch was imported before it was set (forkserver
    preload): OpenMP read the variable too early."""
    torch = sys.modules.get("torch")
    n = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and n.isdigit() and int(n) > 0:
        torch.set_num_threads(int(n))


def _new_job_id() -> str:
    return f"local-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def _kill_tree(pids: Sequence[int], grace: float = KILL_GRACE_S) -> None:
    """SIGTERM the processes and their descendants, SIGKILL whatever is left after ``grace``."""
    procs: list[psutil.Process] = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs += [p] + p.children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)


# ----------------------------------------------------------------------------- launch_distributed
def _worker(fn: Callable, rank: int, world_size: int, args: tuple, env: dict, conn) -> None:
    """Child body: set the rank's variables, run ``fn``, send ("ok"|"err", ...) back."""
    os.environ.update(env)
    _exit_with_launcher()
    _limit_threads()
    try:
        msg = ("ok", rank, fn(rank, world_size, *args))
    except SystemExit as exc:  # sys.exit(0) in a rank is a normal end, anything else a failure
        if exc.code in (0, None):
            msg = ("ok", rank, None)
        else:
            msg = ("err", rank, time.time(), "SystemExit", f"exit code {exc.code}",
                   traceback.format_exc())
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        msg = ("err", rank, time.time(), type(exc).__qualname__, str(exc), traceback.format_exc())
    try:
        if msg[0] == "ok":  # pickled here, by value: multiprocessing would pass tensors as shared
            msg = ("ok", rank, pickle.dumps(msg[2]))  # memory of a process about to exit
        conn.send(msg)
    except Exception as exc:  # e.g. an unpicklable return value
        conn.send(("err", rank, time.time(), type(exc).__qualname__,
                   f"could not send rank {rank}'s result back: {exc}", traceback.format_exc()))
    conn.close()
    if msg[0] == "err":
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(1)  # skip interpreter teardown: a wedged process group must not hang the exit


def _exit_with_launcher() -> None:
    """End this rank when the launching process dies (SIGKILL, OOM): otherwise it would stay
    behind, possibly blocked in a collective for the full 30-minute timeout."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()  # returns when the launcher's end of the sentinel pipe closes
        os._exit(1)

    threading.Thread(target=watch, name="ddp_hpc-launcher-watch", daemon=True).start()


def _death_error(rank: int, exitcode: int | None) -> RankFailedError:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return RankFailedError(rank, "ProcessKilled", f"killed by {name} without a Python "
                               "exception", exitcode=exitcode)
    return RankFailedError(rank, "ProcessExited", f"exited with code {exitcode} without a Python "
                           "exception (os._exit, a crash in native code, or the OOM killer?)",
                           exitcode=exitcode)


def launch_distributed(fn: Callable, world_size: int, args: tuple = (), *,
                       nodes: int | Sequence[int] = 1, timeout: float | None = None,
                       start_method: str = "spawn") -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` local processes; return the results.

    ``fn`` and ``args`` must be picklable (a module-level function). ``nodes`` pretends the ranks
    are spread over nodes, contiguously (a count, or per-node counts such as ``(3, 1)``).
    Raises ``RankFailedError`` for the first rank that fails (a Python exception, or dying
    without one) after killing every other rank; ``TimeoutError`` naming the unfinished ranks
    when ``timeout`` seconds pass.
    """
    counts = node_layout(world_size, nodes)
    threads = thread_env(sum(counts))  # all pretend nodes share this machine
    envs = [{**e, **threads} for e in local_rank_env(counts, free_port(), _new_job_id())]
    ctx = mp.get_context(start_method)
    procs, conns = [], []
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, name=f"ddp_hpc-rank{rank}",
                            args=(fn, rank, world_size, tuple(args), envs[rank], send))
            try:
                p.start()
            except (pickle.PicklingError, AttributeError, TypeError) as exc:
                raise TypeError(
                    f"launch_distributed: cannot send fn={fn!r} or args to a {start_method!r} "
                    f"process: {exc}\nHINT: use a function defined at module level (not a "
                    "lambda or nested function) and picklable args") from exc
            send.close()
            procs.append(p)
            conns.append(recv)
        results = _collect(procs, conns, timeout)
        _join_until(procs, time.monotonic() + EXIT_GRACE_S)  # let them finish exiting
        return results
    finally:
        live = [p.pid for p in procs if p.is_alive()]
        if live:
            _kill_tree(live)
        for p in procs:
            p.join(timeout=KILL_GRACE_S)
        for c in conns:
            c.close()


def _join_until(procs: list, deadline: float) -> None:
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))


def _collect(procs: list, conns: list, timeout: float | None) -> list:
    """Wait for every rank's message or death; raise at the first failure round."""
    deadline = None if timeout is None else time.monotonic() + timeout
    results: dict[int, Any] = {}
    pending_conn = {c: r for r, c in enumerate(conns)}
    pending_proc = {p.sentinel: r for r, p in enumerate(procs)}

    def read(conn, rank: int, errors: list) -> None:
        del pending_conn[conn]
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # died without a message: its sentinel reports it
        if msg[0] == "ok":
            results[rank] = pickle.loads(msg[2])
        else:
            _, rank, t, exc_type, message, tb = msg
            errors.append((t, RankFailedError(rank, exc_type, message, tb)))

    while len(results) < len(procs):
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = mp_wait(list(pending_conn) + list(pending_proc), timeout=left)
        if not ready:
            missing = sorted(set(range(len(procs))) - set(results))
            raise TimeoutError(f"launch_distributed: ranks {missing} still running after "
                               f"timeout={timeout} s; all ranks were killed")
        errors: list[tuple[float, RankFailedError]] = []
        for obj in ready:
            if obj in pending_conn:
                read(obj, pending_conn[obj], errors)
        for obj in ready:
            if obj not in pending_proc:
                continue
            rank = pending_proc.pop(obj)
            procs[rank].join()
            if conns[rank] in pending_conn:  # exited; its last message may still be unread
                read(conns[rank], rank, errors)
            if rank not in results and not any(e.rank == rank for _, e in errors):
                # A death seen in the same round as peers' errors most likely caused them
                # (their sockets closed): it sorts first.
                errors.append((float("-inf"), _death_error(rank, procs[rank].exitcode)))
        if errors:
            raise min(errors, key=lambda e: e[0])[1]
    return [results[r] for r in range(len(procs))]


# ----------------------------------------------------------------------------- run_local
@dataclass
class LocalResult:
    """How a ``run_local`` run ended. ``returncodes[r]`` < 0 means killed by that signal."""

    returncodes: list[int]
    first_failed_rank: int | None
    log_dir: Path
    job_id: str
    pids: list[int] = field(default_factory=list)
    interrupted: str | None = None  # "SIGINT" / "SIGTERM" when the launcher was asked to stop

    @property
    def ok(self) -> bool:
        return self.first_failed_rank is None and self.interrupted is None

    @property
    def exitcode(self) -> int:
        """One process exit status for the whole run (the first failing rank's)."""
        if self.first_failed_rank is not None:
            rc = self.returncodes[self.first_failed_rank]
            return rc if rc > 0 else 128 + (-rc if rc < 0 else 1)
        return 128 + int(signal.Signals[self.interrupted]) if self.interrupted else 0


class LocalRun:
    """A started set of rank processes (``start_local``); ``wait()`` gives the LocalResult.

    Each rank runs in its own session (process group) so that killing a rank also kills
    whatever it started (DataLoader workers, shells).
    """

    def __init__(self, argv: Sequence[str], *, nodes: int, procs_per_node: int,
                 log_dir: str | os.PathLike, env: Mapping[str, str] | None = None,
                 job_id: str | None = None, master_port: int | None = None):
        argv = [str(a) for a in argv]
        if not argv:
            raise ValueError("run_local: empty command\nHINT: pass the program and its "
                             "arguments, e.g. ['python', '-m', 'ddp_hpc.run', 'jobs/demo.yaml']")
        if nodes < 1 or procs_per_node < 1:
            raise ValueError(f"run_local: nodes={nodes} and procs_per_node={procs_per_node} "
                             "must both be >= 1")
        self.job_id = job_id or _new_job_id()
        self.log_dir = Path(log_dir).resolve()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        base = dict(os.environ if env is None else env)
        base.update(thread_env(nodes * procs_per_node, base))
        rank_envs = local_rank_env([procs_per_node] * nodes, master_port or free_port(),
                                   self.job_id)
        self.procs: list[subprocess.Popen] = []
        self.log_paths: list[Path] = []
        try:
            for rank, rank_env in enumerate(rank_envs):
                path = self.log_dir / f"rank{rank}.out"
                with open(path, "ab") as log:  # append: never lose an earlier run's output
                    self.procs.append(subprocess.Popen(
                        argv, env={**base, **rank_env}, stdin=subprocess.DEVNULL, stdout=log,
                        stderr=subprocess.STDOUT, start_new_session=True))
                self.log_paths.append(path)
        except BaseException:
            self.kill()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def send_signal(self, sig: int) -> None:
        """Deliver ``sig`` to every rank's whole process group."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    def kill(self, grace: float = KILL_GRACE_S, first: int = signal.SIGTERM,
             escalate: Callable[[], bool] = lambda: False) -> None:
        """Send ``first`` to every live rank group, SIGKILL after ``grace`` seconds (or as soon
        as ``escalate()`` turns true, e.g. a second Ctrl-C)."""
        self.send_signal(first)
        end = time.monotonic() + grace
        while (time.monotonic() < end and not escalate()
               and any(p.poll() is None for p in self.procs)):
            time.sleep(0.05)
        self.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def wait(self, poll: float = 0.2, stop_grace: float = 10.0) -> LocalResult:
        """Wait for all ranks; the first non-zero exit kills the others (SIGTERM, then SIGKILL
        after ``KILL_GRACE_S``).

        SIGINT / SIGTERM received meanwhile (main thread only) are forwarded to the ranks, which
        get ``stop_grace`` seconds to finish (e.g. write a checkpoint) before SIGKILL; a second
        signal kills at once.
        """
        received: list[int] = []
        old = {}
        if _in_main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                old[sig] = signal.signal(sig, lambda s, _f: received.append(s))
        first_failed = None
        try:
            while True:
                if received:
                    self.kill(stop_grace, first=received[0], escalate=lambda: len(received) > 1)
                    break
                codes = [p.poll() for p in self.procs]
                failed = [r for r, rc in enumerate(codes) if rc not in (None, 0)]
                if failed:
                    first_failed = failed[0]  # within one poll interval: the lowest rank
                    self.kill()
                    break
                if all(rc is not None for rc in codes):
                    break
                time.sleep(poll)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
        interrupted = signal.Signals(received[0]).name if received else None
        return LocalResult([p.wait() for p in self.procs], first_failed, self.log_dir,
                           self.job_id, self.pids, interrupted)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def start_local(argv: Sequence[str], *, nodes: int, procs_per_node: int,
                log_dir: str | os.PathLike, env: Mapping[str, str] | None = None,
                job_id: str | None = None) -> LocalRun:
    """Start ``argv`` once per rank with the local-launcher variables; do not wait."""
    return LocalRun(argv, nodes=nodes, procs_per_node=procs_per_node, log_dir=log_dir, env=env,
                    job_id=job_id)


def run_local(argv: Sequence[str], *, nodes: int, procs_per_node: int,
              log_dir: str | os.PathLike, env: Mapping[str, str] | None = None,
              job_id: str | None = None, poll: float = 0.2,
              stop_grace: float = 10.0) -> LocalResult:
    """Run ``argv`` once per rank (``nodes * procs_per_node`` processes) and wait.

    stdout+stderr of rank R go to ``log_dir/rankR.out`` (appended). ``env`` replaces the
    inherited environment (the rank variables are added on top). When a rank exits non-zero
    the whole run is killed and ``first_failed_rank`` names it. SIGINT/SIGTERM to this process
    are forwarded to the ranks (``stop_grace`` seconds before SIGKILL).
    """
    return start_local(argv, nodes=nodes, procs_per_node=procs_per_node, log_dir=log_dir,
                       env=env, job_id=job_id).wait(poll, stop_grace)


# ----------------------------------------------------------------------------- demo and CLI
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


def _parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, cmd = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(
        prog="python -m ddp_hpc.launch",
        usage="python -m ddp_hpc.launch [--nodes N] [--procs-per-node G] [--log-dir DIR] "
              "[--job-id ID] [--timeout S] [-- CMD ...]",
        description="Run a command (after --) once per rank with the local launcher's rank "
                    "variables, or, without a command, a small 2x2 DDP demo on CPU (gloo).")
    ap.add_argument("--nodes", type=int, default=2, help="pretend nodes (default 2)")
    ap.add_argument("--procs-per-node", type=int, default=2,
                    help="processes per pretend node (default 2)")
    ap.add_argument("--log-dir", help="per-rank logs rank{R}.out (with a command; default "
                                      "runs/<job id>)")
    ap.add_argument("--job-id", help="DDP_HPC_JOB_ID for the ranks (default local-<time>-<hex>)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="demo only: give up after this many seconds (default 300)")
    args, extra = ap.parse_known_args(argv)
    if extra:
        ap.error(f"unrecognized arguments: {' '.join(extra)}; put the command after `--`, e.g. "
                 f"python -m ddp_hpc.launch --nodes 1 --procs-per-node 2 -- {' '.join(extra)}")
    if args.job_id is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", args.job_id):
        ap.error(f"--job-id={args.job_id!r} may use only letters, digits, '.', '_' and '-' "
                 "(it names the log directory)")
    for name in ("nodes", "procs_per_node"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    return args, cmd


def main(argv: Sequence[str] | None = None) -> int:
    args, cmd = _parse(argv)
    world = args.nodes * args.procs_per_node
    if not cmd:
        print(f"ddp_hpc demo: {world} processes on {args.nodes} pretend node(s), gloo on CPU",
              flush=True)
        try:
            losses = launch_distributed(_demo_rank, world, nodes=args.nodes,
                                        timeout=args.timeout)
        except (RankFailedError, TimeoutError) as exc:
            print(f"FAILED: {exc}", file=sys.stderr)
            return 1
        print("final loss per rank: " + ", ".join(f"{x:.4f}" for x in losses))
        print(f"OK: {world} ranks agreed on all_reduce and on the DDP parameters")
        return 0
    job_id = args.job_id or _new_job_id()
    log_dir = Path(args.log_dir or Path("runs") / job_id)
    print(f"ddp_hpc launch: {world} ranks of {cmd!r}, logs in {log_dir}/rank*.out", flush=True)
    res = run_local(cmd, nodes=args.nodes, procs_per_node=args.procs_per_node, log_dir=log_dir,
                    job_id=job_id)
    if res.interrupted:
        print(f"interrupted by {res.interrupted}; ranks stopped", file=sys.stderr)
    elif res.first_failed_rank is not None:
        r = res.first_failed_rank
        print(f"FAILED: rank {r} exited with {res.returncodes[r]}; see "
              f"{res.log_dir / f'rank{r}.out'}", file=sys.stderr)
    else:
        print(f"OK: all {world} ranks exited 0")
    return res.exitcode


if __name__ == "__main__":
    sys.exit(main())
