"""``python -m ddp_hpc.status``: the job status command.

    python -m ddp_hpc.status                      # recent ddp_hpc jobs as a table
    python -m ddp_hpc.status 1234                 # one job: state (and which source said so),
                                                  # progress, each rank's last event, first
                                                  # failing rank + traceback, exit codes, requeues
    python -m ddp_hpc.status 1234 --logs -n 20    # rank-prefixed tails of the rank logs
    python -m ddp_hpc.status 1234 --logs --rank 3 --follow
    python -m ddp_hpc.status --watch 5            # refresh the table every 5 s
    python -m ddp_hpc.status 1234 --source sacct-c  # ask one source only (compare them)
    ... --json                                    # every view as JSON

Jobs are found through their job records (``$DDP_HPC_HOME/jobs``, written by ddp_hpc.submit), so
the command works from any directory. The state comes from squeue, else sacct, else ``sacct -c``
(job completion records), else the run logs; local-backend jobs from their process ids and logs.
"""
from __future__ import annotations

import argparse
import re
import sys
import time

from ddp_hpc import records
from ddp_hpc.status import view
from ddp_hpc.status.collect import (Target, collect, current_cluster, slurm_cli,
                                    targets_from_records)

FOLLOW_STATE_S = 5.0  # --follow: how often to ask whether the job still runs
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


class StatusError(Exception):
    """A request status cannot answer; the message names the value and the fix."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ddp_hpc.status",
        description="State, progress, logs and the failing rank of ddp_hpc jobs.")
    p.add_argument("job", nargs="?", help="job id (Slurm id, array task id 123_4, or local-...)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--logs", action="store_true", help="show rank-prefixed tails of the rank logs")
    p.add_argument("--rank", type=int, help="with --logs: only this rank")
    p.add_argument("-n", "--lines", type=int, default=10, metavar="N",
                   help="with --logs: last N lines per file (default 10)")
    p.add_argument("--out", dest="files", action="store_const", const="out", default="log",
                   help="with --logs: the ranks' stdout/stderr (rank*.out: tracebacks, srun "
                        "messages) instead of their text logs (rank*.log)")
    p.add_argument("--all-files", dest="files", action="store_const", const="all",
                   help="with --logs: both rank*.log and rank*.out")
    p.add_argument("--follow", "-f", action="store_true",
                   help="with --logs: keep printing new lines until the job ends (Ctrl-C stops)")
    p.add_argument("--watch", nargs="?", type=float, const=5.0, metavar="SECONDS",
                   help="refresh the view every SECONDS (default 5) until Ctrl-C")
    p.add_argument("--count", type=int, metavar="N", help="with --watch: stop after N refreshes")
    p.add_argument("--limit", type=int, default=20, metavar="N",
                   help="table: the N most recent jobs (default 20; 0 for all)")
    p.add_argument("--source", choices=("auto", "squeue", "sacct", "sacct-c", "logs"),
                   default="auto",
                   help="where the state comes from: auto (squeue, else sacct, else sacct -c, else "
                        "the logs) or only the one named, to compare them")
    p.add_argument("--log-dir", metavar="DIR",
                   help="log directory of a job that has no job record (e.g. a hand-written sbatch)")
    return p


def _check(args, parser) -> None:
    def bad(msg):
        parser.error(msg)
    if args.job is not None and not _JOB_ID.match(args.job):
        bad(f"job id {args.job!r} (command line) is not a job id: use digits like 1234, an array "
            f"task like 1234_5, or a local-... id as listed by `python -m ddp_hpc.status`")
    if (args.rank is not None or args.follow or args.files != "log") and not args.logs:
        bad("--rank, --follow, --out and --all-files go with --logs: "
            "python -m ddp_hpc.status JOBID --logs --rank R --follow")
    if args.logs and args.job is None:
        bad("--logs needs a job id: python -m ddp_hpc.status JOBID --logs")
    if args.follow and args.watch is not None:
        bad("--follow and --watch do not combine: --follow already keeps printing")
    if args.lines < 0:
        bad(f"-n {args.lines}: the number of lines must be 0 or more")
    if args.limit < 0:
        bad(f"--limit {args.limit}: give 0 (all jobs) or a positive number")
    if args.rank is not None and args.rank < 0:
        bad(f"--rank {args.rank}: ranks start at 0")
    if args.watch is not None and args.watch <= 0:
        bad(f"--watch {args.watch:g}: the refresh interval must be more than 0 seconds")
    if args.count is not None and (args.count < 1 or args.watch is None):
        bad("--count N goes with --watch and must be 1 or more")


def job_targets(job_id: str, log_dir: str | None, cluster: str | None = None) -> list[Target]:
    """The targets for ``status JOBID``: from the job record (this cluster's first: ids repeat
    across clusters), or a bare id (+ --log-dir)."""
    try:
        try:
            rec = records.load_record(job_id, cluster=cluster) if cluster else None
        except records.JobRecordError:
            rec = None
        rec = rec or records.load_record(job_id)
    except records.JobRecordError as exc:
        return [Target(job_id, None, log_dir)] if log_dir or _slurm_id(job_id) else _raise(exc)
    tasks = targets_from_records([rec])
    if "_" in job_id and rec.array:
        tasks = [t for t in tasks if t.id == job_id] or tasks
    if log_dir:
        for t in tasks:
            t.log_dir = log_dir
    return tasks


def _slurm_id(job_id: str) -> bool:
    return bool(re.match(r"^\d+(_\d+)?$", job_id))


def _raise(exc):
    raise StatusError(str(exc))


def recent_targets(limit: int) -> list[Target]:
    recs = list(reversed(records.list_records()))  # newest first
    if limit:
        recs = recs[:limit]
    return targets_from_records(recs)


def run(args) -> int:
    cli, note = slurm_cli()
    out = sys.stdout.write
    only = None if args.source == "auto" else args.source.replace("sacct-c", "sacct -c")

    if args.job is not None:
        targets = job_targets(args.job, args.log_dir,
                              current_cluster(cli) if _slurm_id(args.job) else None)
        if args.logs:
            return _logs(args, targets, cli, note)

        def render():
            sts = collect(targets, cli, note, history=True, only=only)
            if all(s.source == "none" or (s.source == "logs" and s.state_name == "UNKNOWN"
                                          and not s.last_events) for s in sts) and \
                    all(t.record is None for t in targets) and not args.log_dir:
                raise StatusError(
                    f"job {args.job!r}: no job record in {records.records_dir()}, and neither "
                    f"squeue, sacct nor sacct -c could tell about it"
                    + (f" ({'; '.join(sts[0].tried)})" if sts and sts[0].tried else "")
                    + ".\nHINT: check the id with `python -m ddp_hpc.status`; for a job submitted "
                    "without ddp_hpc.submit pass --log-dir DIR.")
            if args.json:
                return view.to_json(sts[0].to_dict() if len(sts) == 1 else [s.to_dict() for s in sts])
            return "\n".join(view.render_detail(s) for s in sts)
    else:
        def render():
            sts = collect(recent_targets(args.limit), cli, note, only=only)
            return view.to_json([s.to_dict() for s in sts]) if args.json else view.render_table(sts)

    if args.watch is None:
        out(render())
    else:
        view.watch(render, args.watch, args.count, header=not args.json)
    return 0


def _logs(args, targets, cli, note) -> int:
    if len(targets) > 1:
        raise StatusError(f"job {args.job} is an array of {len(targets)} tasks; --logs needs one "
                          f"task: e.g. {targets[0].id}")
    t = targets[0]
    if not t.log_dir:
        raise StatusError(f"job {args.job}: no log directory known (no job record).\n"
                          f"HINT: pass --log-dir DIR.")
    if not view.rank_files(t.log_dir, args.rank, args.files) and not args.follow:
        which = f"rank {args.rank} " if args.rank is not None else ""
        raise StatusError(f"job {args.job}: no {which}log files (rank*.log, rank*.out) in {t.log_dir}.\n"
                          f"HINT: the job may not have started yet; add --follow to wait for them.")
    if args.follow:
        last = {"at": -1e9, "active": True}

        def active() -> bool:  # squeue still listing it (even in a state we do not know) counts
            # ask the scheduler at most every FOLLOW_STATE_S: squeue is an RPC to slurmctld
            if time.monotonic() - last["at"] >= FOLLOW_STATE_S:
                st = collect([t], cli, note)[0]
                last.update(at=time.monotonic(), active=st.source == "squeue" or st.job_state.active)
            return last["active"]
        view.follow_logs(t.log_dir, args.rank, args.lines, active, args.json, kind=args.files)
        return 0
    recs = view.logs_tail(t.log_dir, args.rank, args.lines, args.files)
    sys.stdout.write(view.to_json(recs) if args.json else view.render_logs(recs))
    return 0


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(args, parser)
    try:
        return run(args)
    except StatusError as exc:
        print(f"ddp_hpc.status: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
