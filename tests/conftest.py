"""Shared pytest fixtures.  The main one is ``slurm_cluster``: a real multi-node Slurm for tests.

``slurm_cluster`` (session scope) starts ONE local cluster per test session with
``ddp_hpc.testcluster`` -- 4 nodes ``n1..n4`` in the default partition and 3 more, ``n5..n7``, in
a partition ``spare`` of their own (for a test that kills a node while others run), and 3 more,
``n8..n10``, in a partition ``spare2`` (the tests of xdist group "spare2" see it as theirs), each node in
its own network namespace with its own address and hostname, 4 fake GPUs per node (GRES), job
completion records (``sacct -c``) and, when MariaDB + slurmdbd are installed, full accounting
(plain ``sacct``, ``sacct -D``) -- and tears it down when the session ends.  Only one cluster
can run on a machine, so the fixture holds an exclusive ``fcntl.flock`` on
/tmp/ddp_hpc_testcluster.lock for the whole session; another
session waits for it (up to ``DDP_HPC_CLUSTER_LOCK_WAIT`` seconds, default 1200) and then skips.
The netns layout is used when ``ip`` and ``nsenter`` exist, the loopback one otherwise or when it
fails (``DDP_HPC_TESTCLUSTER_LAYOUT=loopback`` forces it); slurmdbd when it is installed and
starts.  ``DDP_HPC_TESTCLUSTER_DIR`` moves the state directory.

Without root, or without slurmd / slurmctld / munged, every test that uses the fixture or is marked
``@pytest.mark.cluster`` is skipped with the reason shown by ``pytest -ra``.  A test marked
``cluster`` gets the cluster started (and the skip logic) even when it does not name the fixture.

What the fixture yields (a :class:`SlurmTestCluster`)::

    def test_two_by_two(slurm_cluster):
        c = slurm_cluster
        c.nodes                      # ['n1', 'n2', 'n3', 'n4']: the default partition's
        c.spare_nodes                # ['n5', 'n6', 'n7']: partition c.spare_partition ('spare';
                                     # 'spare2', ['n8', 'n9', 'n10'] in xdist group "spare2")
        c.gpus_per_node              # 4
        c.env                        # os.environ + SLURM_CONF + PATH with the venv's bin first,
                                     # minus inherited SLURM_* / torchrun variables
        p = c.run(["srun", "-N2", "--ntasks-per-node=2", "python", "-m", "ddp_hpc.env", "--json"])
        p.returncode, p.stdout, p.stderr         # text, captured, never raises
        jid = c.sbatch("#!/bin/bash\\nsrun hostname\\n", "-N2", "--ntasks-per-node=1")
        c.wait(jid)                  # 'COMPLETED' | 'FAILED' | 'TIMEOUT' | 'CANCELLED' | ...
        c.output(jid)                # text of slurm-<jid>.out (batch jobs run in shared_dir)
        c.shared_dir                 # Path seen by every node, fresh per session (mode 1777)
        c.local_dir                  # same path on every node, each node's own folder behind it
        c.jobcomp_file               # Path of the jobcomp/filetxt records (`sacct -c`)
        c.accounting                 # 'slurmdbd' (plain sacct works) or 'jobcomp' (sacct disabled)
        c.need_node_failure()        # skip now where fail_node cannot work (not the netns layout)
        c.fail_node("n2")            # kill every process of n2 (a dead machine); c.revive_node("n2")
        c.stop_slurmdbd()            # switch to a jobcomp-only cluster (sacct: "accounting storage
        c.start_slurmdbd()           #   is disabled") and back; restarts slurmctld, keeps jobs
        c.cluster_name               # 'ddphpc' (job ids restart at 1 in every session)
        c.slurm_conf, c.state_dir, c.log_dir, c.partition, c.layout

Under pytest-xdist (``pytest -n 4 --dist loadgroup tests/cluster``, what scripts/test.sh runs) the
workers share ONE cluster: the first worker that needs it takes the machine's lock through a small
holder process (it keeps the lock until the run's controller exits) and starts the cluster; the
others attach to it; the controller stops it when the run ends.  Cluster tests then run side by
side, each taking a shared "gate"; a test marked ``cluster_exclusive`` (it kills a node, switches
accounting, restarts daemons or asserts on the whole queue) takes the gate alone: it waits for the
running cluster tests to end, and new ones wait for it.  Tests that share module state are kept
on one worker with ``@pytest.mark.xdist_group``.

Jobs run as root with the submitter's environment (sbatch/srun export ALL), so ``python`` inside a
job is the venv's.  sacct lags squeue by seconds and ``sbatch --wait`` notices the end late, so
``wait`` polls squeue, then reads the final state from ``scontrol`` and waits until accounting
(``sacct`` or ``sacct -c``) has the record too.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import multiprocessing
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

# One intra-op thread per rank process unless the caller chose (every process the tests start, the
# test cluster's jobs included, inherits it). A rank that runs `python -m ddp_hpc.run` without a
# launcher that shares out the cores (a bare srun, a single process) takes torch's default, one
# thread per core; with a dozen ranks on CI's 2 cores their OpenMP threads spin for each other:
# the demo's 204 steps cost 7.2 s of CPU with 2 threads against 4.6 s with 1 on a loaded machine,
# 15 s under heavier load. A real cluster gives each task its CPUs (the sbatch scripts set
# OMP_NUM_THREADS to them); the tests of that rule pass their own environment.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The unit tests that start ranks with start_method="forkserver" (FAST in their files) fork them
# from one server per test process that imported these once: torch (1.7 s of CPU per process),
# torch._dynamo (1.5 s more, which DDP's constructor imports in every rank) and ours. One list for
# the whole run: the forkserver starts once per process, with whichever list was set last.
multiprocessing.get_context("forkserver").set_forkserver_preload(
    ["torch", "torch.distributed", "torch._dynamo", "torch.nn.parallel", "ddp_hpc.dist",
     "ddp_hpc.train"])

LOCK_WAIT_S = float(os.environ.get("DDP_HPC_CLUSTER_LOCK_WAIT", "1200"))
TERMINAL = {"COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY",
            "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
_DROP_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
              "MASTER_PORT", "TORCHELASTIC_RUN_ID", "DDP_HPC_LAUNCHER", "DDP_HPC_NUM_NODES",
              "DDP_HPC_JOB_ID", "DDP_HPC_MASTER_PORT", "DDP_HPC_LOG_DIR", "CUDA_VISIBLE_DEVICES"}
_timings: dict[str, float] = {}


def cluster_skip_reason() -> str | None:
    """Why cluster tests cannot run here, or None."""
    if not sys.platform.startswith("linux"):
        return f"cluster tests need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return (f"cluster tests need root to start the local Slurm cluster (running as uid "
                f"{os.geteuid()}); run pytest as root")
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    missing = [p for p in ("slurmd", "slurmctld", "munged", "srun", "unshare") if not shutil.which(p, path=path)]
    if missing:
        return (f"cluster tests need Slurm + munge ({', '.join(missing)} not found); install with "
                "`python -m ddp_hpc.testcluster install --slurmdbd` (apt-get, as root)")
    return None


def _which_all(*progs: str) -> bool:
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return all(shutil.which(p, path=path) for p in progs)


class SlurmTestCluster:
    """Handle on the running test cluster (see the module docstring for the whole API)."""

    partition = "debug"
    spare_partition = "spare"

    def __init__(self, spec):
        self._spec = spec
        self.nodes: list[str] = list(spec.partition_nodes)
        self.spare_nodes: list[str] = list(spec.spare_node_names)
        #: every spare partition: ``spare`` (n5-n7) and ``spare2`` (n8-n10); a test in xdist group
        #: "spare2" sees the second as ``spare_partition`` / ``spare_nodes`` (`_spare_set`)
        self.spare_sets: dict[str, list[str]] = dict(spec.spare_sets)
        self.gpus_per_node: int = spec.gpus_per_node
        self.cluster_name: str = spec.cluster_name
        self.layout: str = spec.layout
        self.state_dir: Path = spec.state_dir
        self.slurm_conf: Path = spec.slurm_conf
        self.shared_dir: Path = spec.shared_dir
        self.local_dir: Path = spec.local_dir
        self.jobcomp_file: Path = spec.jobcomp_file
        self.log_dir: Path = spec.path("log")
        self.slurmdbd_available: bool = spec.slurmdbd
        venv_bin = str(Path(sys.executable).parent)
        env = {k: v for k, v in os.environ.items()
               if not (k.startswith("SLURM_") or k.startswith("SBATCH_") or k.startswith("SRUN_")
                       or k.startswith("SALLOC_") or k in _DROP_VARS)}
        env["SLURM_CONF"] = str(spec.slurm_conf)
        env["PATH"] = os.pathsep.join([venv_bin] + [p for p in env.get("PATH", "").split(os.pathsep)
                                                    if p and p != venv_bin])
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.env: dict[str, str] = env
        self._njobs = 0

    # -- commands ---------------------------------------------------------------------------
    def run(self, argv, **kw) -> subprocess.CompletedProcess:
        """``subprocess.run(argv)`` with text output captured, no exception on failure,
        ``env=self.env`` and a 300 s timeout unless given."""
        opts = dict(text=True, capture_output=True, check=False, env=self.env, timeout=300,
                    stdin=subprocess.DEVNULL)
        opts.update(kw)
        return subprocess.run([str(a) for a in argv], **opts)

    def sbatch(self, script_text: str, *args: str, cwd: Path | None = None) -> str:
        """Submit ``script_text`` (a whole batch script, ``#!`` line included) with extra sbatch
        ``args``; it runs in ``cwd`` (default ``shared_dir``), output in ``slurm-<id>.out``.
        Returns the job id as a string; raises with sbatch's stderr when it refuses."""
        self._njobs += 1
        scripts = self.shared_dir / "scripts"
        scripts.mkdir(exist_ok=True)
        path = scripts / f"job{self._njobs}-{os.getpid()}.sh"
        path.write_text(script_text)
        proc = self.run(["sbatch", "--parsable", *args, str(path)], cwd=str(cwd or self.shared_dir))
        if proc.returncode:
            raise RuntimeError(f"sbatch {' '.join(args)} {path} failed ({proc.returncode}): "
                               f"{proc.stderr.strip()}")
        return proc.stdout.strip().split(";")[0]

    def output(self, job_id: str, cwd: Path | None = None) -> str:
        """The batch output file ``slurm-<job_id>.out`` of a job submitted with :meth:`sbatch`."""
        path = Path(cwd or self.shared_dir) / f"slurm-{job_id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def queue_state(self, job_id: str) -> str | None:
        """The job's state while squeue still lists it (PENDING, RUNNING, ...), else None."""
        p = self.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], timeout=30)
        states = p.stdout.split()
        return states[0] if p.returncode == 0 and states else None

    def controller_state(self, job_id: str) -> str | None:
        p = self.run(["scontrol", "show", "job", "-o", str(job_id)], timeout=30)
        for word in p.stdout.split():
            if word.startswith("JobState="):
                return word.split("=", 1)[1]
        return None

    def accounting_state(self, job_id: str, completion: bool | None = None) -> str | None:
        """Final state from accounting: plain ``sacct`` with slurmdbd, ``sacct -c`` (the jobcomp
        file) otherwise or when ``completion`` is true.  None while there is no record yet."""
        if completion is None:
            completion = self.accounting != "slurmdbd"
        argv = ["sacct", *(["-c"] if completion else ["-X"]), "-n", "-P", "-o", "JobID,State",
                "-j", str(job_id)]
        state = None
        for line in self.run(argv, timeout=30).stdout.splitlines():
            jid, _, st = line.partition("|")
            if jid == str(job_id) and st:
                state = st.split()[0]  # "CANCELLED by 0" -> CANCELLED; the last record wins
        return state

    def wait(self, job_id: str, timeout: float = 120) -> str:
        """Block until the job has ended; returns its final state (COMPLETED, FAILED, TIMEOUT,
        CANCELLED, ...).  Raises TimeoutError naming the last state and the output file."""
        deadline = time.monotonic() + timeout
        delay = 0.1
        state = None
        while time.monotonic() < deadline:
            state = self.queue_state(job_id)
            if state is None or state in TERMINAL:
                break
            time.sleep(delay)
            delay = min(delay * 1.5, 1.0)
        else:
            raise TimeoutError(f"job {job_id} still {state} after {timeout:.0f} s; output so far:\n"
                               f"{self.output(job_id)[-2000:]}")
        final = self.controller_state(job_id) or state
        # Accounting lags squeue: wait until it has the record, so that a test may query it next.
        # slurmdbd misses jobs that ran while it was stopped; the jobcomp file never does.
        dbd_deadline = min(deadline, time.monotonic() + 20)
        while time.monotonic() < deadline:
            acct = self.accounting_state(job_id, completion=(self.accounting != "slurmdbd"
                                                             or time.monotonic() > dbd_deadline))
            if acct in TERMINAL:
                return acct
            time.sleep(0.3)
        if final in TERMINAL:
            return final
        raise TimeoutError(f"job {job_id} left the queue but no final state was recorded "
                           f"(scontrol: {final})")

    # -- accounting switch --------------------------------------------------------------------
    @property
    def accounting(self) -> str:
        """'slurmdbd' when plain sacct works, 'jobcomp' when only ``sacct -c`` does."""
        from ddp_hpc.testcluster import load_state
        from ddp_hpc.testcluster.health import accounting_mode
        return accounting_mode(self._spec, load_state(self.state_dir) or {})

    def need_node_failure(self) -> None:
        """Skip the test, before it starts anything, where `fail_node` cannot work: killing one
        node's processes needs each node in a network namespace of its own (the netns layout)."""
        if self.layout != "netns":
            pytest.skip(f"a node failure needs the netns layout; this cluster runs the {self.layout} "
                        "layout (no ip / nsenter, or DDP_HPC_TESTCLUSTER_LAYOUT)")

    def fail_node(self, node: str) -> list[int]:
        """Kill every process of ``node`` at once (slurmd, slurmstepd, ranks): a dead machine.
        Call `revive_node` afterwards (in a finally): later tests need every node. A test that
        fails a node calls `need_node_failure` first: here, with a job running, it is too late to
        skip (the job would run on, and the test would test nothing), so this fails instead."""
        if self.layout != "netns":
            raise RuntimeError(f"fail_node({node!r}) on the {self.layout} layout: call "
                               "slurm_cluster.need_node_failure() at the start of the test")
        from ddp_hpc.testcluster.nodefail import fail_node
        return fail_node(self.state_dir, node)

    def revive_node(self, node: str) -> None:
        from ddp_hpc.testcluster.nodefail import revive_node
        revive_node(self.state_dir, node)

    def stop_slurmdbd(self) -> None:
        """Make this a cluster without accounting storage (sacct: "Slurm accounting storage is
        disabled"; jobcomp records go on).  Skips the test when slurmdbd is not installed."""
        if not self.slurmdbd_available:
            pytest.skip("slurmdbd/MariaDB not installed: the cluster runs with jobcomp only")
        from ddp_hpc.testcluster import set_accounting
        set_accounting(self.state_dir, False)

    def start_slurmdbd(self) -> None:
        """Back to full accounting (plain sacct); jobs that ran meanwhile are only in ``sacct -c``."""
        if not self.slurmdbd_available:
            pytest.skip("slurmdbd/MariaDB not installed: the cluster runs with jobcomp only")
        from ddp_hpc.testcluster import set_accounting
        set_accounting(self.state_dir, True)


_held_lock = []  # the open lock file while this session holds the machine's cluster
RUN_VAR = "DDP_HPC_TESTCLUSTER_RUN"  # set by an xdist controller for its workers: its pid
# The process that holds the machine's cluster lock for a whole xdist run: it takes the lock,
# says "locked" (or "busy HOLDER"), and keeps it until the run's controller has exited or it is
# sent SIGTERM (by the controller, after it has stopped the cluster).
_HOLDER = r"""
import os, signal, sys, time
from ddp_hpc.testcluster import lock
wait, controller = float(sys.argv[1]), int(sys.argv[2])
f = lock.acquire(wait)
if f is None:
    print("busy " + lock.holder(), flush=True)
    sys.exit(1)
f.seek(0)
f.truncate()
f.write(f"pid {os.getpid()} (for the pytest-xdist run of pid {controller})\n")
f.flush()
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print("locked", flush=True)
while True:
    try:
        os.kill(controller, 0)
    except ProcessLookupError:
        break
    time.sleep(1)
"""
_holder_proc = []


def _run_dir(config) -> Path | None:
    """This xdist run's folder of shared files (coordination lock, record, gate), seen from a
    worker or from the controller; None outside xdist."""
    if hasattr(config, "workerinput"):
        run = os.environ.get(RUN_VAR)
    elif getattr(config, "_ddp_hpc_run", None):
        run = config._ddp_hpc_run
    else:
        return None
    return Path(f"/tmp/ddp_hpc_testcluster.run-{run}") if run else None


def pytest_configure(config):
    # A test run started in the background of a script (`cmd &` without job control) inherits
    # SIGINT ignored, and so would every process a test starts: the tests that stop a job, a
    # wrapper or srun's stand-in with SIGINT (Ctrl-C, srun's abort) would wait for nothing. The
    # run takes SIGINT as a terminal gives it; its children inherit the default.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if not hasattr(config, "workerinput") and config.getoption("dist", "no") != "no":
        config._ddp_hpc_run = str(os.getpid())   # the workers, started after this, inherit it
        os.environ[RUN_VAR] = config._ddp_hpc_run


@contextlib.contextmanager
def _flocked(path: Path, mode: int = fcntl.LOCK_EX):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)


def _record(d: Path) -> dict:
    try:
        return json.loads((d / "record.json").read_text())
    except FileNotFoundError:
        return {}


def _save_record(d: Path, rec: dict) -> None:
    tmp = d / "record.json.tmp"
    tmp.write_text(json.dumps(rec))
    os.replace(tmp, d / "record.json")


def _join_run(d: Path) -> str | None:
    """On an xdist worker: make sure the run holds the machine's cluster lock (the first worker
    to ask starts the holder process); the skip reason when it stays busy."""
    d.mkdir(exist_ok=True)
    with _flocked(d / "coord.lock"):
        rec = _record(d)
        if rec:
            return rec.get("busy")
        from ddp_hpc.testcluster import lock
        proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(LOCK_WAIT_S), os.environ[RUN_VAR]],
                                stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                start_new_session=True)
        _holder_proc.append(proc)
        answer = proc.stdout.readline().strip()
        if answer != "locked":
            proc.wait()
            rec = {"busy": f"the Slurm test cluster stayed busy for {LOCK_WAIT_S:.0f} s "
                           f"({lock.LOCK_FILE} held by {answer[5:] or 'an unknown process'}); only "
                           "one may run per machine"}
        else:
            rec = {"holder": proc.pid}
        _save_record(d, rec)
        return rec.get("busy")


def _acquire_lock(config) -> str | None:
    """Take the machine's cluster lock for this session (for the whole run under xdist); the
    skip reason when it stays busy."""
    d = _run_dir(config)
    if d is not None:
        return _join_run(d)
    if _held_lock:
        return None
    from ddp_hpc.testcluster import lock

    def tell(holder):
        sys.stderr.write(f"\n[slurm_cluster] waiting up to {LOCK_WAIT_S:.0f} s for {lock.LOCK_FILE} "
                         f"(held by {holder})\n")
    f = lock.acquire(LOCK_WAIT_S, on_wait=tell)
    if f is None:
        return (f"the Slurm test cluster stayed busy for {LOCK_WAIT_S:.0f} s ({lock.LOCK_FILE} held "
                f"by {lock.holder()}); only one may run per machine")
    _held_lock.append(f)
    return None


def _wants_cluster(item) -> bool:
    return item.get_closest_marker("cluster") is not None or \
        "slurm_cluster" in getattr(item, "fixturenames", ())


def pytest_collection_finish(session):
    """Wait for the cluster lock here, before any test runs, so the wait does not count against
    a test's pytest-timeout; only when a selected test needs the cluster."""
    if cluster_skip_reason() or not any(_wants_cluster(i) for i in session.items):
        return
    reason = _acquire_lock(session.config)
    if reason:
        for item in session.items:
            if _wants_cluster(item):
                item.add_marker(pytest.mark.skip(reason=reason))


def _start_cluster():
    """Start the test cluster, best layout first; returns (spec, notes on what failed)."""
    from ddp_hpc.testcluster import ClusterError, ClusterSpec, down, up
    state_dir = Path(os.environ.get("DDP_HPC_TESTCLUSTER_DIR", "/tmp/ddp_hpc_testcluster"))
    layouts = ["netns", "loopback"] if _which_all("ip", "nsenter") else ["loopback"]
    if os.environ.get("DDP_HPC_TESTCLUSTER_LAYOUT") in layouts:
        layouts = [os.environ["DDP_HPC_TESTCLUSTER_LAYOUT"]]
    dbd = _which_all("slurmdbd", "mariadbd", "mariadb-install-db", "sacctmgr")
    attempts = [(lay, d) for lay in layouts for d in ([True, False] if dbd else [False])]
    down(state_dir)  # we hold the lock: anything recorded there is stale
    notes = []
    for layout, with_dbd in attempts:  # best first; fall back rather than lose every test
        candidate = ClusterSpec(nodes=4, spare_nodes=3, spare_partitions=2, gpus_per_node=4, layout=layout,
                                slurmdbd=with_dbd, state_dir=state_dir)
        try:
            up(candidate)
        except ClusterError as exc:
            notes.append(f"{layout}{' + slurmdbd' if with_dbd else ''}: {exc}")
            sys.stderr.write(f"\n[slurm_cluster] could not start {notes[-1]}\n")
            continue
        return candidate, notes
    raise ClusterError("the Slurm test cluster did not start:\n" + "\n".join(notes))


def _shared_cluster(d: Path) -> SlurmTestCluster:
    """On an xdist worker: the run's one cluster, started by the first worker that needs it."""
    from ddp_hpc.testcluster import ClusterError, ClusterSpec
    with _flocked(d / "coord.lock"):
        rec = _record(d)
        if rec.get("error"):
            raise ClusterError(rec["error"])
        if not rec.get("spec"):
            t0 = time.monotonic()
            try:
                spec, notes = _start_cluster()
            except ClusterError as exc:
                _save_record(d, {**rec, "error": str(exc)})
                raise
            rec.update(spec=spec.to_json(), notes=notes, up_s=time.monotonic() - t0)
            _save_record(d, rec)
    cluster = SlurmTestCluster(ClusterSpec.from_json(rec["spec"]))
    cluster.startup_notes = rec["notes"]
    return cluster


@pytest.fixture
def utc(monkeypatch):
    """Local times (a record's, a restart's) printed in UTC, so golden files hold anywhere."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.fixture(autouse=True)
def _spare_set(request):
    """A test in xdist group "spare2" gets the second spare partition as its ``spare_partition``
    and ``spare_nodes``: the two groups' tests, which each take a whole spare partition (2 nodes
    and a spare, a node killed), run side by side on two workers instead of one after another."""
    if "slurm_cluster" not in request.fixturenames:
        yield
        return
    c = request.getfixturevalue("slurm_cluster")
    groups = {str(m.args[0]) for m in request.node.iter_markers("xdist_group") if m.args}
    name = "spare2" if "spare2" in groups and "spare2" in c.spare_sets else "spare"
    c.spare_partition, c.spare_nodes = name, list(c.spare_sets.get(name, c.spare_nodes))
    yield


@pytest.fixture(scope="session")
def slurm_cluster(request):
    """A running 4-node Slurm test cluster for the whole session (see this module's docstring)."""
    reason = cluster_skip_reason()
    if reason:
        pytest.skip(reason)
    busy = _acquire_lock(request.config)  # normally taken at collection already
    if busy:
        pytest.skip(busy)
    d = _run_dir(request.config)
    if d is not None:   # xdist: the controller stops it when the run ends
        yield _shared_cluster(d)
        return
    from ddp_hpc.testcluster import down
    try:
        t0 = time.monotonic()
        spec, notes = _start_cluster()
        _timings["up"] = time.monotonic() - t0
        cluster = SlurmTestCluster(spec)
        cluster.startup_notes = notes
        try:
            yield cluster
        finally:
            t0 = time.monotonic()
            down(spec.state_dir)
            _timings["down"] = time.monotonic() - t0
    finally:
        _held_lock.pop().close()


#: CPU seconds of the xdist workers (``pytest_testnodedown``): (in their own process, in the processes
#: they started and waited for: ranks, launchers, CLI commands; a detached job's driver is not counted)
_worker_cpu: list[tuple[float, float]] = []


def _cpu_seconds() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


#: CPU seconds each test's phases took (own process + waited children), by node id, in the controller
_test_cpu: dict[str, float] = {}
_phase_cpu_start = [0.0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report carries the CPU it took (the test's process and the processes it started
    and waited for), so the summary can name the tests that cost the CPU of a CPU-bound run."""
    outcome = yield
    now = sum(_cpu_seconds())
    rep = outcome.get_result()
    rep.user_properties = [*rep.user_properties, ("ddp_hpc_cpu_s", now - _phase_cpu_start[0])]
    _phase_cpu_start[0] = now


def pytest_runtest_logstart(nodeid, location):
    _phase_cpu_start[0] = sum(_cpu_seconds())


def pytest_runtest_logreport(report):
    for key, value in report.user_properties:
        if key == "ddp_hpc_cpu_s":
            _test_cpu[report.nodeid] = _test_cpu.get(report.nodeid, 0.0) + value


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The xdist controller: keep what a worker's CPU report says (printed in the summary)."""
    cpu = getattr(node, "workeroutput", {}).get("ddp_hpc_cpu")
    if cpu:
        _worker_cpu.append(tuple(cpu))


def pytest_sessionfinish(session):
    """The xdist controller, once every worker is done: stop the run's cluster, let the lock go.
    A worker reports its CPU seconds to the controller (the summary's "CPU" line: where a CPU-bound
    run's time went, the tests' own process against the processes they start)."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["ddp_hpc_cpu"] = _cpu_seconds()
    d = None if hasattr(session.config, "workerinput") else _run_dir(session.config)
    if d is None or not d.exists():
        return
    rec = _record(d)
    if rec.get("spec"):
        from ddp_hpc.testcluster import ClusterSpec, down
        t0 = time.monotonic()
        down(ClusterSpec.from_json(rec["spec"]).state_dir)
        _timings.update(up=rec["up_s"], down=time.monotonic() - t0)
    if rec.get("holder"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(rec["holder"], signal.SIGTERM)
        from ddp_hpc.testcluster import lock
        lock.release(lock.acquire(30))   # returns once the holder has let it go
    shutil.rmtree(d, ignore_errors=True)


_exclusive = []  # the gate's open lock files while this worker runs a block of exclusive tests


@contextlib.contextmanager
def _gate(config, exclusive: bool):
    """Under xdist: cluster tests hold the run's gate shared, a ``cluster_exclusive`` test alone.
    A turnstile keeps new tests out while an exclusive one waits, so it is not starved.  Back to
    back exclusive tests keep the gate (see pytest_runtest_teardown): one wait for the others."""
    d = _run_dir(config)
    if d is None:
        yield
        return
    if exclusive:
        if not _exclusive:
            for name in ("turnstile.lock", "gate.lock"):
                _exclusive.append(os.open(d / name, os.O_RDWR | os.O_CREAT, 0o666))
                fcntl.flock(_exclusive[-1], fcntl.LOCK_EX)
        yield
    else:
        with _flocked(d / "turnstile.lock"):
            pass
        with _flocked(d / "gate.lock", fcntl.LOCK_SH):
            yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if _exclusive and (nextitem is None or nextitem.get_closest_marker("cluster_exclusive") is None):
        while _exclusive:
            os.close(_exclusive.pop())


def _heal(cluster, groups: set[str], when: str) -> None:
    """Bring back a node a test left out of service (drained, down, its slurmd dead), and name it
    in the report (a warning): one bad node never fails the tests after it. The default
    partition's nodes always (no test takes them down on purpose); a spare partition's only for a
    test of its own xdist group, whose tests run one after another: another group's test may be
    killing or draining its nodes on purpose right now (a deliberate drain's reason starts with
    ``heal.DELIBERATE`` and is left alone in any case)."""
    from ddp_hpc.testcluster.heal import heal
    mine = [n for g, nodes in getattr(cluster, "spare_sets", {}).items() if g in groups for n in nodes]
    if found := heal(cluster.state_dir, nodes=[*cluster.nodes, *mine]):
        warnings.warn(f"test cluster {when}: {'; '.join(f'{n} was {s}' for n, s in found.items())}; "
                      "brought back", stacklevel=2)


@pytest.fixture(autouse=True)
def _cluster_marker(request):
    """Tests marked ``cluster`` get the cluster (and its skip logic) without naming the fixture;
    every cluster test passes the gate (see :func:`_gate`)."""
    if request.node.get_closest_marker("cluster") is not None:
        request.getfixturevalue("slurm_cluster")
    if "slurm_cluster" not in request.fixturenames:
        yield
        return
    exclusive = request.node.get_closest_marker("cluster_exclusive") is not None
    with _gate(request.config, exclusive):
        cluster = request.getfixturevalue("slurm_cluster")
        groups = {str(m.args[0]) for m in request.node.iter_markers("xdist_group") if m.args}
        _heal(cluster, groups, "before this test")
        yield
        _heal(cluster, groups, "after this test")
        if cluster.slurmdbd_available and cluster.accounting != "slurmdbd":
            cluster.start_slurmdbd()  # a test switched accounting off and did not switch it back


@pytest.fixture(autouse=True)
def _signal_wakeup_fd_left_free():
    """A test that starts a rank's hang watchdog in this process (``ddp_hpc.report`` with
    ``DDP_HPC_LOG_DIR`` set opens one) must stop it: the watchdog holds the process's signal
    wakeup fd, and a later test's watchdog in the same pytest worker would then find it taken."""
    yield
    if threading.current_thread() is not threading.main_thread():
        return
    old = signal.set_wakeup_fd(-1)
    if old != -1:
        pytest.fail("this test left a signal wakeup fd set (a HangWatch it started is still "
                    "running): stop it, e.g. with ddp_hpc.progress.close()")


DURATIONS = Path(__file__).with_name("cluster") / "durations.json"
DEFAULT_DURATION_S = 30
#: the unit tests' seconds per file (``--dist loadfile``: a file is what a worker takes), from a full
#: run's ``--durations=0`` (scripts/durations.py writes both files); a file not listed counts
#: DEFAULT_FILE_S
FILE_DURATIONS = Path(__file__).with_name("durations.json")
DEFAULT_FILE_S = 20


def _group(item) -> str:
    names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                    for m in item.iter_markers("xdist_group")})
    return "_".join(names) or item.nodeid


def _plan_for_xdist(config, items) -> None:
    """On an xdist worker with ``--dist loadgroup``: order the tests longest group first (by the
    seconds in tests/cluster/durations.json; a test not listed counts DEFAULT_DURATION_S), the
    exclusive tests of a group last in it; and write down each test's group for the controller's
    scheduler (:func:`pytest_xdist_make_scheduler`)."""
    d = _run_dir(config)
    if hasattr(config, "workerinput") and not getattr(config.option, "loadgroup", False):
        _longest_files_first(items)   # xdist set ``dist`` to "no" on its workers: loadfile here
    if d is None or not getattr(config.option, "loadgroup", False):   # xdist sets it on workers
        return
    try:
        seconds = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        seconds = {}
    weight: dict[str, float] = {}
    for item in items:
        weight[_group(item)] = weight.get(_group(item), 0) + seconds.get(item.nodeid, DEFAULT_DURATION_S)
    index = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-weight[_group(item)], _group(item),
                                 item.get_closest_marker("cluster_exclusive") is not None, index[id(item)]))
    d.mkdir(exist_ok=True)
    tmp = d / f"groups.json.{os.getpid()}"
    tmp.write_text(json.dumps({item.nodeid: _group(item) for item in items}))
    os.replace(tmp, d / "groups.json")


def _longest_files_first(items) -> None:
    """On an xdist worker of another ``--dist`` than loadgroup (loadfile): the files longest first (by
    tests/durations.json), each file's tests in their order. xdist's own order (most tests first)
    left the few long real-process files for last, where one worker ran them while the others
    had nothing left."""
    try:
        seconds = json.loads(FILE_DURATIONS.read_text())
    except (OSError, ValueError):
        seconds = {}
    index = {id(item): i for i, item in enumerate(items)}

    def file_of(item) -> str:
        return item.nodeid.split("::", 1)[0]

    items.sort(key=lambda item: (-seconds.get(file_of(item), DEFAULT_FILE_S), file_of(item), index[id(item)]))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` with the groups the workers wrote down (pytest-xdist 3.8 marks a group
    by changing the test's nodeid, which pytest 9.2 no longer lets it do: its own loadgroup would
    spread a group over workers), in the workers' order (longest first)."""
    if config.getoption("dist", "no") == "loadfile":
        config.option.loadscopereorder = False   # keep the workers' order: longest file first
        return None
    d = _run_dir(config)
    if d is None or config.getoption("dist", "no") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:   # asked only once every worker has collected
                self.groups = json.loads((d / "groups.json").read_text())
            return self.groups.get(nodeid, nodeid)

    config.option.loadscopereorder = False   # keep the workers' order
    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    _plan_for_xdist(config, items)
    reason = cluster_skip_reason()
    if not reason:
        return
    for item in items:
        if _wants_cluster(item):
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_terminal_summary(terminalreporter):
    if _worker_cpu:
        own, kids = (sum(c[i] for c in _worker_cpu) for i in (0, 1))
        terminalreporter.write_line(
            f"CPU of the {len(_worker_cpu)} workers: {own:.0f} s in their own processes (the tests, collection), "
            f"{kids:.0f} s in the processes they started and waited for (ranks, launchers, commands)")
    if _test_cpu:
        top = sorted(_test_cpu.items(), key=lambda kv: -kv[1])[:int(os.environ.get("DDP_HPC_TEST_CPU_TOP", "15"))]
        terminalreporter.write_line(
            f"CPU of the tests, {sum(_test_cpu.values()):.0f} s in all; the {len(top)} that took most "
            "(set-up, call, teardown; with the processes each started and waited for):")
        for nodeid, cpu in top:
            terminalreporter.write_line(f"  {cpu:6.1f} s  {nodeid}")
    if _timings:
        terminalreporter.write_line(
            "slurm_cluster: " + ", ".join(f"{k} {v:.1f} s" for k, v in _timings.items()))
