"""``ddp-hpc status`` (also ``python -m ddp_hpc.status``): the job status command.

    ddp-hpc status                          # recent ddp_hpc jobs as a table (100 columns, or
                                            # the terminal's width; --wide: every column whole)
    ddp-hpc status --here                   # only the jobs submitted from this directory
    ddp-hpc status 1234                     # one job: state (and which source said so), progress,
                                            # each rank's last event, first failing rank +
                                            # traceback, exit codes, requeues
    ddp-hpc status 1234 --logs -n 20        # rank-prefixed tails of the rank logs
    ddp-hpc status 1234 --logs --rank 3 --follow
    ddp-hpc status 1234 --stacks            # ask a running job's ranks for their Python stacks
    ddp-hpc status --watch 5                # refresh the table every 5 s
    ddp-hpc status 1234 --source sacct-c    # ask one source only (compare them)
    ddp-hpc status 1234 --html report.html  # one self-contained page: diagnosis, charts, timelines
    ... --json                              # every view as JSON

Jobs are found through their job records (``$DDP_HPC_HOME/jobs``, written by ddp_hpc.submit), so
the command works from any directory. The state comes from squeue, else sacct, else ``sacct -c``
(job completion records), else the run logs; local-backend jobs from their process ids and logs.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time

from ddp_hpc import records
from ddp_hpc.errors import HintError, report
from ddp_hpc.fsutil import atomic_write
from ddp_hpc.runlogs.schema import rank_out, text_log
from ddp_hpc.slurm.query import current_cluster, slurm_cli
from ddp_hpc.status import view
from ddp_hpc.status.collect import collect
from ddp_hpc.status.html import render_html
from ddp_hpc.status.stacks import ask_stacks, render_stacks, silence_causes
from ddp_hpc.status.targets import StatusError, is_slurm_id, job_targets, recent_targets
from ddp_hpc.text import ArgumentParser, HelpFormatter, prog

FIT_COLUMNS = 100  # the table's width into a pipe or file (a terminal: its own width)
FOLLOW_STATE_S = 5.0  # --follow: how often to ask whether the job still runs
LOGS, OUTS = text_log("*"), rank_out("*")  # rank*.log, rank*.out
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=prog("status"), formatter_class=HelpFormatter,
        description="State, progress, logs and the failing rank of ddp_hpc jobs.")
    p.add_argument("job", nargs="?", help="job id (Slurm id, array task id 123_4, or local-...); "
                                          "without one: a table of the recent jobs")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--logs", action="store_true",
                   help=f"show rank-prefixed tails of the ranks' training logs ({LOGS}); of a "
                        f"script job, its own output ({OUTS})")
    p.add_argument("--rank", type=int, help="with --logs: only this rank")
    p.add_argument("-n", "--lines", type=int, default=10, metavar="N",
                   help="with --logs: last N lines per file")
    p.add_argument("--out", dest="files", action="store_const", const="out",
                   help=f"with --logs: the ranks' raw stdout/stderr ({OUTS}: tracebacks, srun "
                        f"messages) instead of their training logs ({LOGS})")
    p.add_argument("--all-files", dest="files", action="store_const", const="all",
                   help=f"with --logs: both {LOGS} and {OUTS}")
    p.add_argument("--follow", "-f", action="store_true",
                   help="with --logs: keep printing new lines until the job ends (Ctrl-C stops)")
    p.add_argument("--watch", nargs="?", type=float, const=5.0, metavar="SECONDS",
                   help="refresh the view every SECONDS (5 when not given) until Ctrl-C")
    p.add_argument("--count", type=int, metavar="N", help="with --watch: stop after N refreshes")
    p.add_argument("--limit", type=int, default=20, metavar="N",
                   help="table: the N most recent jobs (0 for all)")
    p.add_argument("--wide", action="store_true",
                   help=f"table: every column whole, however wide (default: fit the terminal, "
                        f"{FIT_COLUMNS} columns into a pipe or file)")
    p.add_argument("--here", action="store_true",
                   help="table: only the jobs submitted from this directory or one below it (jobs "
                        "from elsewhere are marked * otherwise)")
    p.add_argument("--source", choices=("auto", "squeue", "sacct", "sacct-c", "logs"),
                   default="auto",
                   help="where the state comes from: auto (squeue, else sacct, else sacct -c, else "
                        "the logs) or only the one named, to compare them")
    p.add_argument("--stacks", action="store_true",
                   help="ask every rank of a running job for the Python stacks of all its "
                        "threads (SIGURG to the ranks) and show where each one is")
    p.add_argument("--html", metavar="FILE",
                   help="write one self-contained HTML page of the job (no server or network needed "
                        "to view it): the failure diagnosis, samples/s and loss over time, restart "
                        "phases and goodput when known, every rank's timeline")
    p.add_argument("--log-dir", metavar="DIR",
                   help="log directory of a job that has no job record (e.g. a hand-written sbatch)")
    return p


def _check(args, parser: argparse.ArgumentParser) -> None:
    """Refuse contradicting or out-of-range options (argparse's error: usage, message, exit 2)."""
    me = parser.prog
    if args.job is not None and not _JOB_ID.fullmatch(args.job):
        parser.error(f"job id {args.job!r} (command line) is not a job id: use digits like 1234, an "
                     f"array task like 1234_5, or a local-... id as listed by `{me}`")
    if (args.rank is not None or args.follow or args.files) and not args.logs:
        parser.error(f"--rank, --follow, --out and --all-files go with --logs: "
                     f"{me} JOBID --logs --rank R --follow")
    if (args.wide or args.here) and args.job is not None:
        parser.error(f"--wide and --here go with the table of jobs, not with a job id: {me} --here --wide")
    if args.logs and args.job is None:
        parser.error(f"--logs needs a job id: {me} JOBID --logs")
    if args.stacks and (args.job is None or args.logs or args.watch is not None):
        parser.error(f"--stacks needs a job id and goes alone: {me} JOBID --stacks")
    if args.html is not None and (args.job is None or args.logs or args.stacks or args.watch is not None
                                  or args.json):
        parser.error(f"--html FILE needs a job id and goes alone: {me} JOBID --html report.html")
    if args.html is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.html))):
        parser.error(f"--html {args.html}: the folder {os.path.dirname(os.path.abspath(args.html))} does not "
                     "exist; create it or give a FILE in an existing folder")
    if args.follow and args.watch is not None:
        parser.error("--follow and --watch do not combine: --follow already keeps printing")
    if args.lines < 0:
        parser.error(f"-n {args.lines}: the number of lines must be 0 or more")
    if args.limit < 0:
        parser.error(f"--limit {args.limit}: give 0 (all jobs) or a positive number")
    if args.rank is not None and args.rank < 0:
        parser.error(f"--rank {args.rank}: ranks start at 0")
    if args.watch is not None and args.watch <= 0:
        parser.error(f"--watch {args.watch:g}: the refresh interval must be more than 0 seconds")
    if args.count is not None and (args.count < 1 or args.watch is None):
        parser.error("--count N goes with --watch and must be 1 or more")


def run(args, me: str) -> int:
    cli, note = slurm_cli()
    if cli is not None:   # a silent wait of many seconds looks like a hang: say what is slow
        cli.slow_note = lambda msg: print(f"{me}: {msg}", file=sys.stderr, flush=True)
    only = None if args.source == "auto" else args.source.replace("sacct-c", "sacct -c")
    if args.job is None:
        def render():
            here = os.getcwd()
            sts = collect(recent_targets(args.limit, here if args.here else None), cli, note, only=only,
                          brief=not args.json)
            if args.json:
                return view.to_json([s.to_dict() for s in sts])
            if args.here and not sts:
                return f"no jobs submitted from {here} or below it ({me} without --here lists them all)\n"
            return view.render_table(sts, None if args.wide else _width(), here)
    else:
        targets = job_targets(args.job, args.log_dir,
                              current_cluster(cli) if is_slurm_id(args.job) else None)
        if args.logs:
            return _logs(args, targets, cli, note)
        if args.stacks:
            return _stacks(args, targets, cli)
        if args.html is not None:
            return _html(args, targets, cli, note, only)

        def render():
            sts = collect(targets, cli, note, history=True, only=only)
            if not args.log_dir and all(t.record is None for t in targets) and all(map(_unknown, sts)):
                raise StatusError(
                    f"job {args.job!r}: no job record in {records.records_dir()}, and neither "
                    f"squeue, sacct nor sacct -c could tell about it"
                    + (f" ({'; '.join(sts[0].tried)})" if sts and sts[0].tried else ""),
                    f"check the id with `{me}`; for a job submitted without ddp_hpc.submit "
                    "pass --log-dir DIR")
            if args.json:
                return view.to_json(sts[0].to_dict() if len(sts) == 1 else [s.to_dict() for s in sts])
            return "\n".join(view.render_detail(s) for s in sts)
    if args.watch is None:
        sys.stdout.write(render())
    else:
        view.watch(render, args.watch, args.count, header=not args.json)
    return 0


def _html(args, targets, cli, note, only) -> int:
    """Write the page of one job (`ddp_hpc.status.html`) and say where it is."""
    if len(targets) > 1:
        raise StatusError(f"job {args.job} is an array of {len(targets)} tasks; --html draws one task",
                          f"give a task id, e.g. {targets[0].id}")
    st = collect(targets, cli, note, history=True, only=only, lanes=True)[0]
    if _unknown(st) and targets[0].record is None and not args.log_dir:
        raise StatusError(f"job {args.job!r}: no job record in {records.records_dir()} and no scheduler knows it",
                          f"check the id with `{prog('status')}`; for a job submitted without ddp_hpc.submit "
                          "pass --log-dir DIR")
    page = render_html(st)
    atomic_write(args.html, lambda f: f.write(page.encode("utf-8")), binary=True)
    print(f"{args.html}: the page of job {st.id} ({st.state}, {len(page) >> 10} KiB)")
    return 0


def _width() -> int:
    """The table's width: $COLUMNS, else the terminal's (wider or narrower than FIT_COLUMNS: a
    table that wraps is unreadable); FIT_COLUMNS into a pipe or file."""
    if os.environ.get("COLUMNS", "").isdigit() or sys.stdout.isatty():
        return max(40, shutil.get_terminal_size().columns)
    return FIT_COLUMNS


def _stacks(args, targets, cli) -> int:
    found = []
    for t in targets:
        how, answers, silent = ask_stacks(t, cli)
        causes = silence_causes(t.log_dir, silent)
        found.append({"id": t.id, "asked_with": how, "stacks": answers, "silent_ranks": silent,
                      "silent_causes": {str(r): c for r, c in causes.items()}})
        if not args.json:
            sys.stdout.write(render_stacks(t.id, how, answers, silent, causes))
    if args.json:
        sys.stdout.write(view.to_json(found[0] if len(found) == 1 else found))
    return 0


def _unknown(st) -> bool:
    """No source knew the job: the scheduler did not list it and there are no run logs."""
    return st.source == "none" or (st.source == "logs" and st.state_name == "UNKNOWN"
                                   and not st.last_events)


def _logs(args, targets, cli, note) -> int:
    if len(targets) > 1:
        raise StatusError(f"job {args.job} is an array of {len(targets)} tasks; --logs needs one task",
                          f"give a task id, e.g. {targets[0].id}")
    t = targets[0]
    # a script / module / function job has no training log: its rank*.log holds the exec
    # wrapper's start and end lines, its own output is in rank*.out
    script = t.record is not None and t.record.command is not None and t.record.config is None
    kind = args.files or ("out" if script else "log")
    if not t.log_dir:
        raise StatusError(f"job {args.job}: no log directory known (no job record)",
                          "pass --log-dir DIR")
    if not view.rank_files(t.log_dir, args.rank, kind) and not args.follow:
        which = f"rank {args.rank} " if args.rank is not None else ""
        raise StatusError(f"job {args.job}: no {which}log files ({LOGS}, {OUTS}) in {t.log_dir}",
                          "the job may not have started yet; add --follow to wait for them")
    if not args.json:  # on stderr: stdout stays exactly the log lines (for grep and pipes)
        print(view.files_guide(script), file=sys.stderr, flush=True)
        if script and not args.files:
            print(f"a script job: its own output ({OUTS}); --all-files adds the wrapper's start and end "
                  f"lines ({LOGS})", file=sys.stderr, flush=True)
    if args.follow:
        last = {"at": -1e9, "active": True}

        def active() -> bool:  # squeue still listing it (even in a state we do not know) counts
            # ask the scheduler at most every FOLLOW_STATE_S: squeue is an RPC to slurmctld
            if time.monotonic() - last["at"] >= FOLLOW_STATE_S:
                st = collect([t], cli, note)[0]
                last.update(at=time.monotonic(), active=st.source == "squeue" or st.job_state.active)
            return last["active"]
        view.follow_logs(t.log_dir, args.rank, args.lines, active, args.json, kind=kind)
        return 0
    recs = view.logs_tail(t.log_dir, args.rank, args.lines, kind)
    sys.stdout.write(view.to_json(recs) if args.json else view.render_logs(recs))
    return 0


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(args, parser)
    try:
        return run(args, parser.prog)
    except HintError as exc:  # StatusError, a missing job record, a failing Slurm command
        report(parser.prog, exc)
        return 1
    except BrokenPipeError:
        return 0
