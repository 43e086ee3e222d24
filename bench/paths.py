"""How far a value travels through ddp_hpc, counted one way for both paths of
docs/architecture.md ("The submit path", "The status path"):

- submit: ``ddp-hpc submit --backend local -N 1 -G 1 hello.py`` from its argv
  (``ddp_hpc.submit.cli.main``) to the rank's process start, counted in this process: the submit
  command parses, chooses the backend, plans, writes the run directory, the record and
  ``local-plan.json``, and starts the driver. The child processes are not traced; they add the
  driver (``python -m ddp_hpc.backends.localdriver PLAN``: reads the plan, starts the rank through
  ``ddp_hpc.launch``, keeps the final state in the record) and, per rank, the wrapper
  (``python -m ddp_hpc.exec -- python hello.py``: torchrun's variables, signal forwarding, the
  start/end events), which then starts the script. The tool waits for the driver to end.
- status: a failed 3-rank Slurm job (synthetic run logs, rank 2 raised first; a scheduler
  stand-in answering like sacct), its detail view (``ddp-hpc status 88``) and the table
  (``ddp-hpc status``), from the job's record to the rendered text.

For each it prints the ddp_hpc modules whose functions ran, the distinct cross-module edges
(a callee module returning into a different caller module, counted once per caller/callee
pair: one "climb back up" each), and the total cross-module returns. The caller of a frame is
the nearest ddp_hpc frame below it (a call through argparse, ``sorted`` or
``dataclasses.replace`` counts as made by the ddp_hpc module that made it); a generator's yield
counts as a return. The status views also say how often ``records.final_of`` ran.

    python bench/paths.py                          # this tree (-v: every edge, its returns)
    git worktree add /tmp/old 37f317e              # or: git archive 37f317e | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old python bench/paths.py      # an older tree, the same tool
"""
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

T0 = 1_800_000_000.0


class Trace:
    """Modules entered, call edges, and cross-module returns while a function runs."""

    def __init__(self):
        self.modules: set[str] = set()
        self.returns: Counter = Counter()   # (callee module, caller module) -> returns
        self.final_of = 0                   # calls of records.final_of

    def _profile(self, frame, event, arg):
        if event not in ("call", "return"):
            return
        mod = frame.f_globals.get("__name__", "")
        if not mod.startswith("ddp_hpc"):
            return
        if event == "call":
            self.modules.add(mod)
            self.final_of += frame.f_code.co_name == "final_of"
            return
        back = frame.f_back
        while back is not None and not back.f_globals.get("__name__", "").startswith("ddp_hpc"):
            back = back.f_back
        caller = back.f_globals["__name__"] if back is not None else ""
        if caller and caller != mod:
            self.returns[(mod, caller)] += 1

    def run(self, fn):
        sys.setprofile(self._profile)
        try:
            return fn()
        finally:
            sys.setprofile(None)

    def lines(self, name: str, verbose: bool = False) -> str:
        out = (f"{name}: {len(self.modules)} modules, {len(self.returns)} distinct cross-module "
               f"edges, {sum(self.returns.values())} cross-module returns"
               + (f"; records.final_of ran {self.final_of} times" if name.startswith("status") else "")
               + "\n    " + " ".join(sorted(_short(m) for m in self.modules)))
        if verbose:   # each edge, the most returns first
            out += "".join(f"\n      {n:5d}  {_short(callee)} -> {_short(caller)}"
                           for (callee, caller), n in self.returns.most_common())
        return out


def _short(module: str) -> str:
    return module.removeprefix("ddp_hpc.")


# -- submit: argv -> the rank's process start (local backend, a script job) -------------------

def _wait_for(pid: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:   # reaped already, or not our child: watch /proc
            if not Path(f"/proc/{pid}").exists():
                return
        time.sleep(0.1)
    raise TimeoutError(f"the local driver (pid {pid}) still runs after {timeout:g} s")


def submit_path(tmp: Path) -> Trace:
    from ddp_hpc import records
    from ddp_hpc.submit.cli import main
    (tmp / "hello.py").write_text("print('hello')\n")
    os.chdir(tmp)
    argv = ["--backend", "local", "-N", "1", "-G", "1", "--log-dir", str(tmp / "runs"), "hello.py"]
    trace = Trace()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        rc = trace.run(lambda: main(argv))
    if rc != 0:
        raise SystemExit(f"submit failed ({rc}):\n{err.getvalue()}")
    for rec in records.list_records():
        for pid in (rec.pids or [])[:1]:
            _wait_for(int(pid))
    return trace


# -- status: a failed job's detail view and the table -----------------------------------------

class Sacct:
    """squeue knows no job; sacct says every job asked for FAILED."""

    def cluster_name(self):
        return "c1"

    def squeue(self, job_ids=None, **kw):
        return []

    def sacct(self, job_ids, **kw):
        return [{"JobID": j, "JobIDRaw": j, "State": "FAILED", "ExitCode": "1:0", "Elapsed": "00:03:21",
                 "Timelimit": "01:00:00", "NNodes": "1", "NodeList": "n1", "JobName": "t"} for j in job_ids]


def _ev(rank, name, t, **extra):
    return {"time": T0 + t, "event": name, "rank": rank, "job_id": "88", "restart": 0, "host": "n1", **extra}


def failed_job(tmp: Path, records) -> None:
    """Job 88: 3 ranks stepped 19 times, then rank 2 raised and the others lost it."""
    d = tmp / "run"
    d.mkdir()
    for r in range(3):
        evs = [_ev(r, "start", 0, world_size=3, total_steps=1000, device="cpu")]
        evs += [_ev(r, "step", s, step=s, loss=1.0, total_steps=1000) for s in range(1, 20)]
        msg = "ValueError: bad batch" if r == 2 else "Connection closed by peer"
        evs += [_ev(r, "error", 30 + r, exc_type="RuntimeError", message=msg),
                _ev(r, "end", 31 + r, status="failed", exit_code=1)]
        (d / f"rank{r}.events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))
    records.write_record(records.JobRecord(
        id="88", cluster="c1", name="t", backend="sbatch", nodes=1, gpus_per_node=3, time_limit="01:00:00",
        log_dir=str(d), config=None, overrides=[], submitted_at=T0, cwd="/", command=["python", "t.py"]))


def status_paths(tmp: Path) -> dict[str, Trace]:
    from ddp_hpc import records
    from ddp_hpc.status import view
    from ddp_hpc.status.collect import collect
    from ddp_hpc.status.targets import recent_targets
    failed_job(tmp, records)
    now = T0 + 100
    views = {"status detail": lambda: view.render_detail(collect(recent_targets(0), Sacct(), now=now)[0], now=now),
             "status table": lambda: view.render_table(collect(recent_targets(0), Sacct(), now=now, brief=True))}
    traces = {}
    for name, fn in views.items():
        traces[name] = Trace()
        traces[name].run(fn)
    return traces


def main() -> None:
    import ddp_hpc
    print(f"tree: {Path(ddp_hpc.__file__).parent.parent}")
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as d:
        os.environ["DDP_HPC_HOME"] = str(Path(d) / "home-submit")
        traces = {"submit": submit_path(Path(d))}
        os.chdir(here)
        os.environ["DDP_HPC_HOME"] = str(Path(d) / "home-status")
        traces.update(status_paths(Path(d)))
    for name, trace in traces.items():
        print(trace.lines(name, verbose="-v" in sys.argv[1:]))


if __name__ == "__main__":
    main()
