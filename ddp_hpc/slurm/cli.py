"""The one module of ddp_hpc that starts Slurm commands (sbatch, scontrol, scancel, squeue, sacct, sinfo).

Every command is an argument list built here (never a shell string), every job id a user typed is
validated here, every failure is one `SlurmError` (command line, exit status, stderr), and tests
swap the process runner for a recording one.

Output parsing was checked against Slurm 22.05.8 (Debian 12's slurm-wlm) on the real test cluster
(tests/cluster/test_slurmcli_cluster.py):

- squeue ``-O Field:Suffix``: an empty size after ':' means "no width limit" (a plain ``-O Field``
  cuts values at 20 characters), and the suffix is printed verbatim. We end every field with the
  ASCII unit separator and put the job name last, so names with spaces or ``|`` stay intact.
- sacct ``--parsable2 --delimiter=<US>``: the same separator; ``-c`` reads the job completion log
  (JobCompType=jobcomp/filetxt) and works without slurmdbd; ``-D`` lists every run of a requeued
  job. Plain sacct without slurmdbd fails with "Slurm accounting storage is disabled".
- ``scontrol show hostnames`` exits 0 even for an invalid host list; we look at its stderr.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence

from ddp_hpc.errors import HintError
from ddp_hpc.slurm.conf import CONF_HINT, NO_CONFIG, NO_CONFIG_HINT, config_problem
from ddp_hpc.slurm.hostlist import HostlistError, compress, expand, natural_key
from ddp_hpc.slurm.values import JOB_ID, NODE_NAME, SlurmArgumentError, gpus_in_gres, validate_job_id

__all__ = ["SlurmCLI", "SlurmError", "SlurmArgumentError", "validate_job_id", "gpus_in_gres"]

Runner = Callable[..., subprocess.CompletedProcess]

SEP = "\x1f"  # ASCII unit separator: never in job names, states, times or node lists
_SIGNAL = re.compile(r"(?:SIG)?[A-Z][A-Z0-9+-]*\Z|[0-9]+\Z")
_USER = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.@-]*\Z")

#: squeue -O fields, in output order; Name last so a separator in a job name cannot shift fields.
#: JobArrayID prints ``123_4`` for array tasks (what users and sacct call the job), JobID the
#: task's own numeric id.
SQUEUE_FIELDS = (
    "JobArrayID", "JobID", "ArrayJobID", "ArrayTaskID", "State", "Reason", "TimeUsed",
    "TimeLimit", "NumNodes", "RestartCnt", "NodeList", "Partition", "UserName", "SubmitTime",
    "StartTime", "EndTime", "Name",
)
#: sacct --format fields (22.05 has no restart counter; ``-D`` shows one row per run instead).
SACCT_FIELDS = (
    "JobID", "JobIDRaw", "State", "ExitCode", "Elapsed", "Timelimit", "NNodes", "NodeList",
    "Partition", "Submit", "Start", "End", "JobName",
)


#: commands that talk to slurmctld (sacct talks to slurmdbd, or reads the jobcomp file)
NEEDS_CONTROLLER = frozenset({"sbatch", "srun", "salloc", "squeue", "sinfo", "scontrol", "scancel",
                              "sbcast"})
CONTROLLER_DOWN = ("Unable to contact slurm controller", "Could not establish a configuration")
SLOW_S = 3.0


class SlurmError(HintError, RuntimeError):
    """A Slurm command failed; names the command line, its exit status and its stderr."""

    def __init__(self, argv: Sequence[str], returncode: int | None, stderr: str, hint: str = "",
                 status: str | None = None):
        self.argv = list(argv)
        self.command = shlex.join(self.argv)
        self.returncode = returncode
        self.stderr = stderr
        if status is None:
            status = ("could not be started" if returncode is None
                      else f"exited with status {returncode}")
        super().__init__(f"`{self.command}` {status}: {stderr.strip() or '(nothing on stderr)'}", hint)


def _default_runner(argv, *, input=None, cwd=None, env=None, timeout=None):
    return subprocess.run(
        argv, input=input, cwd=cwd, env=env, timeout=timeout, capture_output=True, text=True,
        check=False,
    )


class SlurmCLI:
    """Run Slurm's command line tools and parse their output into plain dicts.

    ``runner(argv, *, input=None, cwd=None, env=None, timeout=None) -> CompletedProcess`` starts
    one process (default: subprocess.run capturing text output); ``env`` is the environment for
    every command (default: this process's), e.g. one whose SLURM_CONF names a test cluster.
    """

    def __init__(self, runner: Runner | None = None, env: Mapping[str, str] | None = None,
                 timeout: float = 60.0, slow_note: Callable[[str], None] | None = None):
        self.runner = runner or _default_runner
        self.env = dict(env) if env is not None else None
        self.timeout = timeout
        #: called once with a message when a command has not finished after SLOW_S seconds
        self.slow_note = slow_note
        #: why the controller is known not to answer (set by the first command that found out);
        #: later commands that need it fail at once instead of retrying for seconds each
        self.controller_down: str | None = None
        #: the first line of the error of the sinfo that found no controller when a backend was
        #: chosen (``backends.choose``; ``submit -v`` shows it)
        self.unreachable: str | None = None

    # -- plumbing -------------------------------------------------------------------------------

    def _run(self, argv: list[str], *, input: str | None = None, cwd=None,
             env: Mapping[str, str] | None = None, hint: str = "") -> subprocess.CompletedProcess:
        full_env = self.env
        if env:
            full_env = {**(self.env if self.env is not None else os.environ), **env}
        problem = config_problem(full_env if full_env is not None else os.environ)
        if problem:
            raise SlurmError(argv, None, problem, CONF_HINT, status="not run")
        if self.controller_down and argv[0] in NEEDS_CONTROLLER:
            raise SlurmError(argv, None, self.controller_down, "is slurmctld reachable (scontrol ping)?",
                             status="not run: the controller did not answer an earlier command")
        timer = threading.Timer(SLOW_S, self.slow_note or (lambda _: None), (
            f"`{shlex.join(argv)}` has not answered for {SLOW_S:g} s; Slurm retries an "
            "unreachable controller for several seconds",))
        timer.daemon = True
        timer.start()
        try:
            done = self.runner(argv, input=input, cwd=cwd, env=full_env, timeout=self.timeout)
        except FileNotFoundError as exc:
            raise SlurmError(argv, None, str(exc), f"is Slurm installed and is `{argv[0]}` on "
                             "PATH? On a laptop use the local backend instead.") from exc
        except subprocess.TimeoutExpired as exc:
            raise SlurmError(argv, None, "(killed)", "is slurmctld reachable (scontrol ping)?",
                             status=f"did not finish within {self.timeout:g} s") from exc
        finally:
            timer.cancel()
        if done.returncode != 0:
            stderr = done.stderr or ""
            down = [ln for ln in stderr.splitlines() if any(t in ln for t in CONTROLLER_DOWN)]
            self.controller_down = self.controller_down or (down[0] if down and argv[0] in NEEDS_CONTROLLER else None)
            if not hint and NO_CONFIG in stderr:
                hint = NO_CONFIG_HINT
            if not hint and "accounting storage is disabled" in stderr + (done.stdout or ""):
                hint = ("sacct needs slurmdbd (AccountingStorageType=accounting_storage/slurmdbd); "
                        "sacct -c (completion=True) needs JobCompType in slurm.conf")
            raise SlurmError(argv, done.returncode, stderr or done.stdout or "", hint)
        return done

    @staticmethod
    def _records(argv: list[str], stdout: str, fields: Sequence[str],
                 trailing: bool) -> list[dict[str, str]]:
        """Split ``SEP``-separated lines into dicts; the last field may contain anything."""
        rows = []
        for line in stdout.splitlines():
            if not line.strip():
                continue
            if trailing and line.endswith(SEP):
                line = line[: -len(SEP)]
            values = line.split(SEP, len(fields) - 1)
            if len(values) != len(fields):
                raise SlurmError(argv, 0, f"cannot parse output line {line!r}: expected "
                                 f"{len(fields)} fields {list(fields)}")
            rows.append({f: v.strip() if f not in ("Name", "JobName") else v
                         for f, v in zip(fields, values)})
        return rows

    @staticmethod
    def _job_ids(job_ids: Iterable[object] | str | int) -> list[str]:
        if isinstance(job_ids, (str, int)):
            job_ids = [job_ids]
        ids = [validate_job_id(j) for j in job_ids]
        if not ids:
            raise SlurmArgumentError("no job ids given")
        return ids

    # -- commands -------------------------------------------------------------------------------

    def available(self) -> bool:
        """True when ``sbatch`` is on PATH (of ``env`` when one was given)."""
        path = (self.env or os.environ).get("PATH")
        return shutil.which("sbatch", path=path) is not None

    def sbatch(self, script_text: str, *, args: Sequence[str] = (), cwd=None,
               env: Mapping[str, str] | None = None) -> str:
        """Submit a batch script (passed on stdin) and return its job id.

        ``args`` are extra sbatch options as separate list items (``["--nodes=2"]``); ``env``
        adds variables to the submitting environment, which sbatch exports to the job.
        """
        if isinstance(args, str):
            raise TypeError(f"sbatch args must be a list of options, not the string {args!r}")
        if not script_text.startswith("#!"):
            raise SlurmArgumentError(f"batch script starts with {script_text[:40]!r}, not an "
                                     "interpreter line", "begin it with '#!/bin/bash'")
        argv = ["sbatch", "--parsable", *[str(a) for a in args]]
        done = self._run(argv, input=script_text, cwd=cwd, env=env)
        first = (done.stdout or "").strip().splitlines()
        job_id = first[-1].split(";", 1)[0].strip() if first else ""
        if not JOB_ID.fullmatch(job_id):
            raise SlurmError(argv, done.returncode, f"unexpected output {done.stdout!r} "
                             f"(stderr {done.stderr!r}): no job id")
        return job_id

    def sbcast(self, src: str, dest: str, *, force: bool = True, preserve: bool = False) -> None:
        """``sbcast [--force] [--preserve] SRC DEST``: copy one file to DEST on every node of the
        current allocation (SLURM_JOB_ID must be set).  DEST's folder must exist on each node."""
        for what, value in (("source", src), ("destination", dest)):
            if not isinstance(value, str) or not value or value.startswith("-") or "\n" in value:
                raise SlurmArgumentError(f"sbcast {what} {value!r} is not a usable path",
                                         "pass an absolute path")
        argv = ["sbcast"] + (["--force"] if force else []) + (["--preserve"] if preserve else []) + [src, dest]
        self._run(argv, hint="sbcast runs inside an allocation (sbatch/salloc) and needs the destination "
                             "folder to exist on every node; try data.stage_to=tmpdir")

    def requeue(self, job_id: object, exclude: Iterable[str] = ()) -> None:
        """``scontrol requeue JOB``: the job goes back to PENDING and later runs again. With
        ``exclude``, then ``scontrol update JobId=JOB ExcNodeList=...`` (its list plus these nodes):
        Slurm takes that only while the job pends, so right after the requeue (it waits BeginTime)."""
        job = validate_job_id(job_id)
        nodes = sorted(set(exclude))
        bad = [n for n in nodes if not NODE_NAME.fullmatch(str(n))]
        if bad:
            raise SlurmArgumentError(f"invalid node name(s) {bad!r} to exclude", "pass Slurm node names")
        self._run(["scontrol", "requeue", job])
        if nodes:
            shown = self._run(["scontrol", "show", "job", "-o", job]).stdout or ""
            m = re.search(r"\bExcNodeList=(\S+)", shown)
            had = expand(m.group(1)) if m and m.group(1) != "(null)" else []
            self._run(["scontrol", "update", f"JobId={job}", f"ExcNodeList={compress(sorted({*had, *nodes}))}"])

    def cancel(self, job_id: object, signal: str | int | None = None, batch: bool = False) -> None:
        """``scancel [--signal=SIG] [--batch] JOB``; with a signal the job keeps running unless
        it dies of it (USR1/USR2 ask ddp_hpc jobs to checkpoint)."""
        argv = ["scancel"]
        if signal is not None:
            sig = str(signal).upper()
            if not _SIGNAL.fullmatch(sig):
                raise SlurmArgumentError(f"invalid signal {signal!r}", "use a name such as USR1 or a number")
            argv.append(f"--signal={sig}")
        if batch:
            argv.append("--batch")
        argv.append(validate_job_id(job_id))
        self._run(argv)

    def kill_step(self, job_id: object, step_id: object) -> None:
        """``scancel --signal=KILL JOB.STEP``: every task of one job step killed at once (the
        supervisor ending a step it knows is broken; srun's own abort lets each task tear down)."""
        step = str(step_id).strip()
        if not step.isdigit():
            raise SlurmArgumentError(f"invalid Slurm step id {step_id!r}", "a step id is a number, such as 1")
        self._run(["scancel", "--signal=KILL", f"{validate_job_id(job_id)}.{step}"])

    def squeue(self, job_ids: Iterable[object] | None = None, user: str | None = None,
               *, all_states: bool = True) -> list[dict[str, str]]:
        """Jobs the controller still knows, one dict per job or array task, keyed by the squeue
        -O field names in `SQUEUE_FIELDS`. ``all_states`` includes jobs that ended less than
        MinJobAge (300 s by default) ago. Unknown job ids give an empty list, not an error."""
        argv = ["squeue", "--noheader", "--array",
                "--Format=" + ",".join(f"{f}:{SEP}" for f in SQUEUE_FIELDS)]
        if all_states:
            argv.append("--states=all")
        if job_ids is not None:
            argv.append("--jobs=" + ",".join(self._job_ids(job_ids)))
        if user is not None:
            if not _USER.fullmatch(user):
                raise SlurmArgumentError(f"invalid user name {user!r}")
            argv.append(f"--user={user}")
        try:
            done = self._run(argv)
        except SlurmError as exc:
            if job_ids is not None and "Invalid job id specified" in exc.stderr:
                return []
            raise
        return self._records(argv, done.stdout, SQUEUE_FIELDS, trailing=True)

    def sacct(self, job_ids: Iterable[object], completion: bool = False,
              duplicates: bool = False) -> list[dict[str, str]]:
        """Accounting rows (jobs and their steps, e.g. ``12.batch``) keyed by `SACCT_FIELDS`.

        ``completion=True`` reads the job completion log (``sacct -c``), which works without
        slurmdbd; ``duplicates=True`` (``-D``) keeps every run of a requeued job.

        Caveats seen with Slurm 22.05.8: ``sacct -c`` rows have no steps, give Timelimit in
        minutes (``2``, plain sacct ``00:02:00``) and the start time as Submit; and for a job whose
        name contains a space, jobcomp/filetxt writes ``Name=a b JobState=...`` which ``sacct -c`` splits at the space
        ("sacct: error: Unknown type b"), so that row's JobName is cut and its State is empty.
        """
        argv = ["sacct", "--parsable2", "--noheader", f"--delimiter={SEP}",
                "--format=" + ",".join(SACCT_FIELDS)]
        if completion:
            argv.append("--completion")
        if duplicates:
            argv.append("--duplicates")
        argv.append("--jobs=" + ",".join(self._job_ids(job_ids)))
        return self._records(argv, self._run(argv).stdout, SACCT_FIELDS, trailing=False)

    def sinfo_partitions(self) -> list[dict]:
        """One dict per partition: name, default, available (up/down/...), time_limit, nodes,
        node_list, node_states ({state: count}), and of its largest node gpus_per_node,
        cpus_per_node and mem_per_node_mb (0: unknown). ``--exact`` keeps nodes of different
        sizes on separate lines; without it sinfo prints a mixed group's minimum as ``4+``."""
        fields = ("R", "P", "a", "l", "D", "T", "N", "G", "c", "m")
        argv = ["sinfo", "--noheader", "--exact", "--format=" + SEP.join(f"%{f}" for f in fields)]
        parts: dict[str, dict] = {}
        unsized: set[tuple[str, str]] = set()     # (partition, key) seen with an inexact size
        for row in self._records(argv, self._run(argv).stdout, fields, trailing=False):
            part = parts.setdefault(row["R"], {
                "name": row["R"], "default": row["P"].endswith("*"), "available": row["a"],
                "time_limit": row["l"], "nodes": 0, "node_list": [], "node_states": {},
                "gpus_per_node": 0, "cpus_per_node": 0, "mem_per_node_mb": 0,
            })
            count = int(row["D"]) if row["D"].isdigit() else 0
            part["nodes"] += count
            part["node_states"][row["T"]] = part["node_states"].get(row["T"], 0) + count
            part["gpus_per_node"] = max(part["gpus_per_node"], gpus_in_gres(row["G"]))
            for key, text in (("cpus_per_node", row["c"]), ("mem_per_node_mb", row["m"])):
                if text.isdigit():
                    part[key] = max(part[key], int(text))
                else:                   # "4+" (a minimum), "N/A": the largest node is unknown
                    unsized.add((row["R"], key))
            try:
                part["node_list"].extend(expand(row["N"]) if row["N"] != "n/a" else [])
            except HostlistError:
                part["node_list"].append(row["N"])
        for name, key in unsized:
            parts[name][key] = 0
        for part in parts.values():  # sinfo lists a partition's nodes by state: one order whatever their states
            part["node_list"] = compress(sorted(set(part["node_list"]), key=natural_key)) if part["node_list"] else ""
        return list(parts.values())

    def cluster_name(self) -> str:
        """ClusterName from ``scontrol show config`` (job ids repeat across clusters/restarts)."""
        argv = ["scontrol", "show", "config"]
        for line in self._run(argv).stdout.splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "ClusterName":
                return value.strip()
        raise SlurmError(argv, 0, "no ClusterName line in the output")

    def node_states(self, nodes: Sequence[str]) -> dict[str, str]:
        """node -> its state as sinfo prints it (``idle``, ``alloc``, ``down*``: ``*`` = not responding)."""
        argv = ["sinfo", "--noheader", "--Node", "--nodes=" + compress(list(nodes)), "--format=%N" + SEP + "%T"]
        return {r["N"]: r["T"] for r in self._records(argv, self._run(argv).stdout, ("N", "T"), trailing=False)}

    def start_step(self, args: Sequence[str], env: Mapping[str, str], stderr=None) -> subprocess.Popen:
        """``srun ARGS...`` started, not waited for (a job step the caller supervises); srun's own
        messages go to ``stderr`` (default: this process's; ``subprocess.PIPE``: read as text)."""
        argv = ["srun", *[str(a) for a in args]]
        problem = config_problem(env)
        if problem:
            raise SlurmError(argv, None, problem, CONF_HINT, status="not run")
        return subprocess.Popen(argv, env=dict(env), stderr=stderr,
                                text=True if stderr is not None else None)

    def run_step(self, args: Sequence[str], env: Mapping[str, str], timeout: float) -> tuple[int | None, str]:
        """``srun ARGS...`` waited for at most ``timeout`` s: (its exit status, None when it was
        killed at the timeout; its stdout so far). A failed task is no error: the caller reads
        every task's output (the supervisor's health check of a step's nodes); srun's stderr
        goes where this process's does."""
        argv = ["srun", *[str(a) for a in args]]
        problem = config_problem(env)
        if problem:
            raise SlurmError(argv, None, problem, CONF_HINT, status="not run")
        with subprocess.Popen(argv, env=dict(env), stdout=subprocess.PIPE, text=True) as proc:
            try:
                out, _ = proc.communicate(timeout=timeout)
                return proc.returncode, out
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
                return None, out or ""

    def show_hostnames(self, expr: str) -> list[str]:
        """Slurm's own expansion of a host list (``scontrol show hostnames EXPR``)."""
        if not isinstance(expr, str) or not expr.strip() or expr.lstrip().startswith("-"):
            raise SlurmArgumentError(f"invalid host list {expr!r}: empty or starts with '-'")
        argv = ["scontrol", "show", "hostnames", expr]
        done = self._run(argv)
        if "Invalid hostlist" in (done.stderr or ""):
            raise SlurmError(argv, done.returncode, done.stderr)
        return (done.stdout or "").split()
