"""What the restart and goodput benches (bench/restart.py, bench/goodput.py) share on the local
test cluster: submitting the demo as a ddp_hpc job (``ddp_hpc.submit``, the sbatch backend) or as
the same program under torchrun's elastic agent (one sbatch job, one ``srun`` step of one agent per
node), reading a run's events process by process, injecting a fault, and waiting for a job's end.

A rank's event file holds every process that was that rank, across restarts and requeues; each
process begins with its ``start`` event (with its pid). The benches split the file there
(`lives`) instead of trusting the events' ``restart`` numbers: under torchrun the agents number
their restarts each on its own (an agent that restarted its workers because a peer node asked, not
because its own workers failed, does not count it), so the ranks of one new run can carry
different numbers.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ddp_hpc.judge.nodefiles import rank_events  # noqa: E402
from ddp_hpc.testcluster.nodefail import fail_node  # noqa: E402

PY = sys.executable
DEMO = ROOT / "jobs" / "demo.yaml"
#: Slurm job states of a job that is over (NODE_FAIL too: a requeued job leaves it for PENDING)
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "NODE_FAIL",
         "PREEMPTED")
#: seconds a job must stay in an ended state before it counts as over (NODE_FAIL -> requeue)
SETTLE_S = 6.0
#: the c10d rendezvous port of the torchrun jobs (on the first node of the job)
RDZV_PORT = 29411


def bench_environ(work: Path) -> dict:
    """The environment of the bench's commands and jobs: its own job records (DDP_HPC_HOME), this
    checkout on PYTHONPATH, and OMP_NUM_THREADS=1 (sbatch passes it on to every rank). torchrun
    sets OMP_NUM_THREADS=1 for its workers; ddp_hpc's Slurm path sets the task's CPUs (render.py),
    which differ by job, and the test cluster binds no task to its CPUs (TaskPlugin=task/none):
    before either was set, each of the 4 ranks ran 2 threads on the 2 cores and the big model's
    compute took 2-5x torchrun's. One thread everywhere: the comparison measures the restarts,
    not the threads."""
    return dict(os.environ, DDP_HPC_HOME=str(work / "home"), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def events(log_dir: Path, rank: int) -> list[dict]:
    return rank_events(log_dir, rank).events


def lives(log_dir: Path, rank: int) -> list[list[dict]]:
    """Rank ``rank``'s events split at each ``start`` event: one list per process that was this
    rank, in order (events before the first start are dropped)."""
    out: list[list[dict]] = []
    for e in events(log_dir, rank):
        if e.get("event") == "start":
            out.append([])
        if out:
            out[-1].append(e)
    return out


def steps(evs: list[dict]) -> list[dict]:
    return [e for e in evs if e.get("event") == "step"]


def lives_after(log_dir: Path, ranks: int, t: float) -> dict[int, list[list[dict]]]:
    """Per rank, its processes started after ``t``."""
    return {r: [life for life in lives(log_dir, r) if life[0]["time"] > t] for r in range(ranks)}


def first_step_after(log_dir: Path, ranks: int, t: float) -> float | None:
    """When the first rank process started after ``t`` reported a training step."""
    got = [e["time"] for ls in lives_after(log_dir, ranks, t).values() for life in ls for e in steps(life)]
    return min(got) if got else None


def wait(what: str, cond, timeout: float = 300.0, poll: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := cond():
            return got
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def slurm(args: list[str], env: dict) -> str:
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=60).stdout


def job_fields(job: str, env: dict) -> dict:
    shown = slurm(["scontrol", "show", "job", "-o", job], env)
    return dict(w.split("=", 1) for w in shown.split() if "=" in w)


class JobEnd:
    """Whether a job is over, asked of scontrol at most every 2 s (an ended state must hold
    `SETTLE_S`: a node failure's NODE_FAIL turns into PENDING when Slurm requeues the job)."""

    def __init__(self, job: str, env: dict) -> None:
        self.job, self.env, self.asked, self.since, self.fields = job, env, 0.0, None, {}

    def __call__(self) -> dict | None:
        now = time.monotonic()
        if now - self.asked >= 2.0:
            self.asked, self.fields = now, job_fields(self.job, self.env)
            ended = self.fields.get("JobState") in ENDED
            self.since = (self.since or now) if ended else None
        return self.fields if self.since is not None and now - self.since >= SETTLE_S else None


def end(job: str, env: dict, timeout: float = 900.0) -> dict:
    """scontrol's fields of ``job`` once it is over."""
    return wait(f"job {job} to end", JobEnd(job, env), timeout)


def step_or_end(log_dir: Path, ranks: int, t: float, job: str, env: dict, timeout: float = 300.0):
    """The first training step after ``t`` (its time), or None once the job ended without one or
    ``timeout`` passed."""
    over = JobEnd(job, env)
    try:
        return wait("a step after the fault, or the job's end",
                    lambda: first_step_after(log_dir, ranks, t) or (over() and "ended"), timeout)
    except TimeoutError:
        return None


def finished(got) -> float | None:
    return got if isinstance(got, float) else None


def submit_ddp_hpc(work: Path, name: str, flags: list[str], overrides: list[str], env: dict,
                   nodes: int = 2) -> tuple[str, Path]:
    """``python -m ddp_hpc.submit --backend sbatch --fresh -N nodes -G 2 FLAGS -J name demo.yaml --
    log.dir=... OVERRIDES``: the job id and its log directory (once it exists). ``--fresh``: the
    same command as an earlier scenario's (the same overrides, another fault) must not resume
    that run from its checkpoints."""
    p = subprocess.run([PY, "-m", "ddp_hpc.submit", "--backend", "sbatch", "--fresh", "-N", str(nodes), "-G", "2",
                        "-t", "30", *flags, "-J", name, str(DEMO), "--", f"log.dir={work / 'runs'}", *overrides],
                       cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=120)
    if p.returncode:
        raise SystemExit(p.stderr)
    return p.stdout.split()[-1], wait("the log directory", lambda: next((work / "runs").glob(f"{name}-*"), None))


def torchrun_script(log_dir: Path, name: str, overrides: list[str], nnodes: str, max_restarts: int) -> str:
    """An sbatch script: ``torchrun --nnodes NNODES --nproc-per-node 2 --max-restarts N
    --rdzv-backend c10d`` on each of 2 nodes, in one ``srun --nodes=2 --ntasks-per-node=1`` step,
    running ``python -m ddp_hpc.run jobs/demo.yaml`` with every rank's run log in ``log_dir``.
    SLURM_RESTART_COUNT is taken out of the agents' environment (ddp_hpc numbers the runs of a
    Slurm job by it before torchrun's TORCHELASTIC_RESTART_COUNT), and
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 set: with the agents' store shared by the workers
    (torch's default since 2.5), the restarted workers of torch 2.13 failed their gloo rendezvous
    on the test cluster ("Gloo connectFullMesh failed ... Connection refused": the new workers
    read addresses of the old ones; pytorch/pytorch#135712, #167288) until the restarts were used
    up; with the flag each run's rank 0 serves a store of its own, as before torch 2.5."""
    torchrun = Path(PY).with_name("torchrun")
    agent = [str(torchrun), "--nnodes", nnodes, "--nproc-per-node", "2", "--max-restarts", str(max_restarts),
             "--rdzv-backend", "c10d", "--rdzv-id", "bench"]
    run = ["-m", "ddp_hpc.run", str(DEMO), *overrides]
    q = " ".join(shlex.quote(w) for w in agent)
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name={name}", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=2", "#SBATCH --time=30", "#SBATCH --no-kill",
        f"#SBATCH --output={log_dir}/slurm-%j.out",
        "set -eu",
        f"cd {shlex.quote(str(ROOT))}",
        f"export DDP_HPC_LOG_DIR={shlex.quote(str(log_dir))} PYTHONPATH={shlex.quote(str(ROOT))}",
        "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
        'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        'echo "torchrun agents on $SLURM_JOB_NODELIST, rendezvous at $HEAD"',
        f"srun --nodes=2 --ntasks-per-node=1 --no-kill --kill-on-bad-exit=0 --output={log_dir}/agent%t.out "
        f"env -u SLURM_RESTART_COUNT {q} --rdzv-endpoint \"$HEAD:{RDZV_PORT}\" "
        + " ".join(shlex.quote(w) for w in run),
        "",
    ])


def submit_torchrun(work: Path, name: str, overrides: list[str], env: dict, nnodes: str = "2",
                    max_restarts: int = 3) -> tuple[str, Path]:
    """Submit `torchrun_script`; the job id and its log directory."""
    log_dir = work / "runs" / f"{name}-torchrun"
    log_dir.mkdir(parents=True, exist_ok=True)
    script = log_dir / "torchrun.sbatch"
    script.write_text(torchrun_script(log_dir, name, overrides, nnodes, max_restarts))
    out = slurm(["sbatch", "--parsable", str(script)], env).strip()
    if not re.fullmatch(r"\d+(;\S+)?", out):
        raise SystemExit(f"sbatch {script} did not submit: {out!r}")
    return out.split(";")[0], log_dir


def newest_start(log_dir: Path, rank: int, after: float = 0.0) -> dict:
    """The ``start`` event of the process that is rank ``rank`` now (one started after ``after``)."""
    return wait(f"rank {rank}'s start event", lambda: next(
        (e for e in reversed(events(log_dir, rank)) if e.get("event") == "start" and e["time"] > after), None), 120)


def inject(fault: str, log_dir: Path, rank: int, state_dir: Path, after: float = 0.0) -> tuple[float, str | None]:
    """``kill`` (SIGKILL), ``stop`` (SIGSTOP) rank ``rank``'s process (the one started after
    ``after``), or ``node``: every process of its node (``ddp_hpc.testcluster.nodefail``). Returns
    the time and the node failed (to revive)."""
    start = newest_start(log_dir, rank, after)
    ended = [e for e in events(log_dir, rank) if e.get("event") == "end" and e["time"] >= start["time"]]
    if ended:
        raise SystemExit(f"rank {rank} ended ({ended[-1].get('status')}) before the {fault} fault could "
                         f"hit it: the run is shorter than the wait before its fault (on a loaded machine "
                         f"the warm standby takes a minute to be ready); give it more steps or less state")
    t = time.time()
    if fault == "node":
        fail_node(state_dir, start["host"])
        return t, start["host"]
    os.kill(int(start["pid"]), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    return t, None


class _Life:
    """One process's events, as `judge.restarts.phases` asks a rank's stream for one run's."""

    def __init__(self, evs: list[dict]) -> None:
        self.events = evs

    def of_restart(self, restart: int) -> list[dict]:
        return self.events


class LivesView:
    """The first process of each rank started after ``t``, in the shape of a ``RunLogs`` for
    ``judge.restarts.phases`` (any restart number reads that process's events): the phases of a
    restart that has no line in restarts.jsonl (a requeue, torchrun's agent)."""

    def __init__(self, log_dir: Path, ranks: int, t: float) -> None:
        self.ranks = {r: _Life(ls[0]) for r, ls in lives_after(log_dir, ranks, t).items() if ls}


def renumbered(log_dir: Path, ranks: int) -> dict:
    """Each rank's events as ``judge.goodput`` reads them (``RankStream``), with the ``restart``
    number of each event replaced by its process's place in the rank's file (0, 1, ...)."""
    from ddp_hpc.judge.tails import RankStream
    out = {}
    for r in range(ranks):
        evs = [{**e, "restart": k} for k, life in enumerate(lives(log_dir, r)) for e in life]
        out[r] = RankStream(r, Path(log_dir), evs)
    return out


def status_json(job: str, env: dict) -> dict:
    """``ddp-hpc status JOB --json`` (a job ddp_hpc submitted: its record is in DDP_HPC_HOME)."""
    p = subprocess.run([PY, "-m", "ddp_hpc", "status", job, "--json"], cwd=str(ROOT), env=env,
                       capture_output=True, text=True, timeout=300)
    try:
        return json.loads(p.stdout)
    except ValueError:
        return {"error": (p.stderr or p.stdout)[-2000:]}
