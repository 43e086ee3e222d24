"""One job's state from the scheduler: squeue, else sacct, else ``sacct -c``, and what each
source that did not know the job said.

Each source knows less than the one before it, and each can be missing on a given cluster: squeue
forgets a job minutes after it ends, sacct needs slurmdbd ("accounting storage is disabled"
otherwise), ``sacct -c`` needs a job completion plugin. `query_slurm` asks them in that order,
stops at the first that knows the job, and says which one answered, so a reader can judge how
fresh the answer is. ``history`` also asks ``sacct -D`` for the earlier runs of a requeued job.

All Slurm commands go through :class:`ddp_hpc.slurm.cli.SlurmCLI` (the one module that runs them);
its rows are dicts whose key spelling (``JobID``/``job_id``/``JobId``) this module does not assume.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

from ddp_hpc.parsing import to_int
from ddp_hpc.slurm.cli import CONTROLLER_DOWN, SlurmCLI, SlurmError
from ddp_hpc.slurm.states import JobState, StateInfo, parse_state
from ddp_hpc.slurm.times import normalize_duration, timestamp

SQUEUE, SACCT, SACCT_C = "squeue", "sacct", "sacct -c"

#: How long one SlurmCLI keeps its answer to "which cluster is this, is the controller up?"
CLUSTER_CACHE_S = 60.0
#: How far Slurm's submit time may precede the record's before the row is taken for an older
#: job that had the same id (ids restart at 1 when a controller's state is wiped).
SUBMIT_SLACK_S = 600.0


@dataclass
class SourceState:
    """One job's state as one source tells it (``info``: the parsed state, ``source``: which one
    said it) and the facts that source knew."""

    info: StateInfo
    source: str
    tried: list[str] = field(default_factory=list)  # what each earlier source said
    elapsed: str | None = None
    time_limit: str | None = None
    nodes: int | None = None
    node_list: str | None = None
    reason: str | None = None
    exit_code: str | None = None
    restarts: int | None = None
    steps: list[dict] = field(default_factory=list)  # sacct job steps: id, state, exit_code
    history: list[dict] = field(default_factory=list)  # earlier runs of a requeued job
    history_source: str | None = None


def slurm_cli() -> tuple[SlurmCLI | None, str | None]:
    """(a SlurmCLI, None) when Slurm's commands are on PATH, else (None, why)."""
    cli = SlurmCLI()
    return (cli, None) if cli.available() else (None, "slurm: commands not found on PATH")


def current_cluster(cli: SlurmCLI | None) -> str | None:
    """This Slurm's ClusterName, or None when it cannot be asked."""
    return cluster_or_reason(cli)[0]


_CLUSTER_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cluster_or_reason(cli: SlurmCLI | None) -> tuple[str | None, str | None]:
    """(ClusterName, None), or (None, why) when the controller does not answer: then squeue is
    not asked either (each such command retries for many seconds before it gives up). Kept for
    a minute per SlurmCLI, so one status call (or a --watch loop) asks once."""
    if cli is None:
        return None, None
    hit = _CLUSTER_CACHE.get(cli)
    if hit and time.monotonic() - hit[0] < CLUSTER_CACHE_S:
        return hit[1]
    try:
        answer: tuple[str | None, str | None] = (cli.cluster_name(), None)
    except SlurmError as exc:  # an unreachable controller; anything else only means "do not filter"
        lines = exc.stderr.strip().splitlines()
        down = any(text in exc.stderr for text in CONTROLLER_DOWN)
        answer = (None, next((ln for ln in lines if "error" in ln or "fatal" in ln),
                             lines[0] if lines else "controller down") if down else None)
    _CLUSTER_CACHE[cli] = (time.monotonic(), answer)
    return answer


class NormalRow(dict):
    """A row whose keys are already in `_norm`'s spelling: `norm_get` looks up without
    rebuilding it (thousands of rows, a dozen lookups each)."""


def norm_get(row: dict, *names: str, default=None):
    """``row[name]`` for the first of ``names`` present, ignoring case, '_' and spaces."""
    idx = row if isinstance(row, NormalRow) else {_norm(k): v for k, v in row.items()}
    for n in names:
        v = idx.get(_norm(n))
        if v not in (None, ""):
            return v
    return default


def _norm(k) -> str:
    return str(k).lower().replace("_", "").replace(" ", "").replace("-", "")


def row_job_id(row: dict) -> str:
    # squeue's JobArrayID is "123_4" for an array task ("123" otherwise) while its JobID is the
    # task's own number; sacct's JobID is already "123_4" / "123.batch".
    return str(norm_get(row, "JobArrayID", "JobID", "JobIDRaw", "id", default="")).strip()


def base_id(job_id: str) -> str:
    """``123_4.batch`` -> ``123_4``: the job (or array task) a step row belongs to."""
    return job_id.split(".", 1)[0]


def _call(tried: list[str], label: str, fn, *args, **kwargs):
    """Run one SlurmCLI query; a failure (no accounting, no daemon) becomes a note, not a crash."""
    try:
        rows = fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any failure of an external source is reported
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        tried.append(f"{label}: {first}")
        return None
    return list(rows or [])


def _matches(row: dict, expect: dict | None) -> bool:
    """False when the row is clearly another job that reused the id: a different name, submitted
    well before the record, or (squeue, never restarted) submitted well after it. A requeue
    resets Slurm's submit time, so rows of restarted jobs are not judged by a late submit time."""
    if not expect:
        return True
    name = norm_get(row, "JobName", "Name")
    if name and expect.get("name") and str(name) != str(expect["name"]):
        return False
    sub = timestamp(norm_get(row, "Submit", "SubmitTime"))
    at = expect.get("submitted_at")
    if sub is None or not at:
        return True
    if sub < float(at) - SUBMIT_SLACK_S:
        return False
    restarts = norm_get(row, "RestartCnt", "Restarts")
    if restarts is not None and str(restarts).strip() == "0" and sub > float(at) + SUBMIT_SLACK_S:
        return False
    return True


def _by_job(rows: list[dict], expect: dict[str, dict]) -> dict[str, list[dict]]:
    """Rows keyed by job / array-task id (steps included under their job), wrong jobs dropped;
    ``<array id>_*`` also holds the rows of all of an array's tasks. One pass however many jobs."""
    out: dict[str, list[dict]] = {}
    for row in rows:
        jid = row_job_id(row)
        if not jid:
            continue
        key = base_id(jid)
        parent = key.split("_", 1)[0]
        exp = expect.get(key) or expect.get(parent)
        if "." not in jid and not _matches(row, exp):
            continue
        out.setdefault(key, []).append(row)
        if parent != key:
            out.setdefault(f"{parent}_*", []).append(row)
    return out


def job_ids_to_ask(ids: list[str]) -> list[str]:
    """The ids to name on squeue's / sacct's command line: an array task ``123_4`` as its array
    ``123`` (both list every task of an array asked for by its id), each id once, in order."""
    return list(dict.fromkeys(i.split("_", 1)[0] for i in ids))


def _view_from_rows(rows: list[dict], source: str, tried: list[str]) -> SourceState:
    # a RESIZING row is no run of its own: Slurm's record of a --no-kill job before it lost a node
    jobs = [r for r in rows if "." not in row_job_id(r)
            and parse_state(norm_get(r, "State", default="")).job_state is not JobState.RESIZING]
    jobs = jobs or [r for r in rows if "." not in row_job_id(r)]
    steps = [r for r in rows if "." in row_job_id(r)]
    cur = jobs[-1] if jobs else rows[-1]
    restarts = norm_get(cur, "Restarts", "RestartCnt", "restart_count")
    st = SourceState(
        info=parse_state(norm_get(cur, "State", "StateCompact", "st", default="")),
        source=source, tried=list(tried),
        elapsed=normalize_duration(norm_get(cur, "Elapsed", "TimeUsed", "Time")),
        time_limit=normalize_duration(norm_get(cur, "Timelimit", "TimeLimit")),
        nodes=to_int(norm_get(cur, "NNodes", "NumNodes", "Nodes")),
        node_list=norm_get(cur, "NodeList", "Nodelist"),
        reason=norm_get(cur, "Reason", "ReasonList"),
        exit_code=norm_get(cur, "ExitCode", "DerivedExitCode"),
        restarts=to_int(restarts),
        steps=[{"id": row_job_id(r), "state": parse_state(norm_get(r, "State", default="")).label,
                "exit_code": norm_get(r, "ExitCode")} for r in steps],
    )
    if len(jobs) > 1:  # sacct -D / jobcomp: one row per run of a requeued job
        st.history = [_history_row(r) for r in jobs]
        st.history_source = source
    return st


def _history_row(r: dict) -> dict:
    return {"state": parse_state(norm_get(r, "State", default="")).label,
            "start": norm_get(r, "Start", "StartTime"), "end": norm_get(r, "End", "EndTime"),
            "exit_code": norm_get(r, "ExitCode"), "elapsed": normalize_duration(norm_get(r, "Elapsed"))}


def query_slurm(job_ids: list[str], cli, expect: dict[str, dict] | None = None,
                history: bool = False, controller_down: str | None = None,
                only: str | None = None) -> tuple[dict[str, SourceState], list[str]]:
    """State of each Slurm job id from squeue, else sacct, else sacct -c, and what the sources that
    did not know a job said. Ids no source knows are absent from the result; ``expect`` maps id ->
    {name, submitted_at} to reject reused ids. ``history`` also asks ``sacct -D`` for the earlier
    runs of requeued jobs; ``only`` names the one source to ask."""
    q = _Query([str(j) for j in job_ids], cli, expect or {}, history)
    if q.ids:
        use = {only} if only else {SQUEUE, SACCT, SACCT_C}
        if SQUEUE in use:
            q.ask_squeue(controller_down)
        if SACCT in use:
            q.ask_sacct()
        if SACCT_C in use:
            q.ask_sacct_c()
    return q.found, q.tried


@dataclass
class _Query:
    """One pass over the sources for a batch of ids: each source fills in what the ones before it
    did not know, and ``tried`` collects why a source did not answer."""

    ids: list[str]
    cli: object  # ddp_hpc.slurm.cli.SlurmCLI
    expect: dict[str, dict]
    history: bool
    found: dict[str, SourceState] = field(default_factory=dict)
    tried: list[str] = field(default_factory=list)
    sacct_answered: bool = False

    def missing(self) -> list[str]:
        return [j for j in self.ids if j not in self.found]

    def rows_of(self, by: dict[str, list[dict]], want: str) -> list[dict] | None:
        """The rows of job ``want`` (or of all its array tasks) in ``by`` (`_by_job`)."""
        if want in by:
            return by[want]
        return by.get(f"{want}_*")

    def ask(self, label: str, ids: list[str], **kwargs) -> dict[str, list[dict]] | None:
        """One call of one source for all of ``ids`` (array tasks asked for by their array's id:
        a short command line however many tasks), its rows grouped by job once."""
        fn = self.cli.squeue if label == SQUEUE else self.cli.sacct
        rows = _call(self.tried, label, fn, job_ids_to_ask(ids), **kwargs)
        if rows is None:
            return None
        return _by_job([NormalRow((_norm(k), v) for k, v in r.items()) for r in rows], self.expect)

    def ask_squeue(self, controller_down: str | None) -> None:
        if controller_down:
            self.tried.append(f"{SQUEUE}: not asked, the controller does not answer "
                              f"({controller_down.strip()})")
            return
        rows = self.ask(SQUEUE, self.ids)
        for j in self.ids if rows is not None else ():
            if (r := self.rows_of(rows, j)) is not None:
                self.found[j] = _view_from_rows(r, SQUEUE, [])
        if rows is not None and self.missing():
            self.tried.append(f"{SQUEUE}: job not listed (ended more than MinJobAge ago, or unknown)")

    def ask_sacct(self) -> None:
        missing = self.missing()
        if not (missing or self.history):
            return
        rows = self.ask(SACCT, self.ids if self.history else missing, duplicates=self.history)
        self.sacct_answered = rows is not None
        for j in missing if rows is not None else ():
            if (r := self.rows_of(rows, j)) is not None:
                self.found[j] = _view_from_rows(r, SACCT, self.tried)
        for j in self.ids if self.history and rows is not None else ():
            if j in self.found and (r := self.rows_of(rows, j)) is not None:
                st, hist = self.found[j], _view_from_rows(r, SACCT, self.tried)
                st.history, st.history_source = hist.history, "sacct -D"
                st.steps = st.steps or hist.steps
                st.exit_code = st.exit_code or hist.exit_code
                if hist.history:
                    st.restarts = max(st.restarts or 0, len(hist.history) - 1)
        if rows is not None and self.missing():
            self.tried.append(f"{SACCT}: job not found")

    def ask_sacct_c(self) -> None:
        missing = self.missing()
        if not (missing or (self.history and not self.sacct_answered)):
            return
        rows = self.ask(SACCT_C, self.ids if self.history else missing, completion=True)
        for j in self.ids if rows is not None else ():
            if (r := self.rows_of(rows, j)) is None:
                continue
            if j not in self.found:
                self.found[j] = _view_from_rows(r, SACCT_C, self.tried)
            elif self.history and not self.found[j].history:
                st, hist = self.found[j], _view_from_rows(r, SACCT_C, self.tried)
                st.history, st.history_source = hist.history, SACCT_C
                st.exit_code = st.exit_code or hist.exit_code
        if rows is not None and self.missing():
            self.tried.append(f"{SACCT_C}: job not found")
