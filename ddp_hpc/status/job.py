"""One job's status as the views show it: a plain value, built by `ddp_hpc.status.assemble` from
the job's resolved state and sources, rendered by `ddp_hpc.status.view` as a table row, a detail
page or JSON.

The table's row fills the first group of fields (who the job is, its state, shape, time,
progress, stall); the detail view fills the same ones and the second group (the failure, every
rank's ending, exit codes, history, restarts, stragglers, staging, flight recorder), which a row
leaves at their empty defaults. Both are views over one resolved job (`Resolved.row`,
`Resolved.detail`), so a row never differs from the head of the detail page.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ddp_hpc.judge.compute import Timing
from ddp_hpc.judge.goodput import Goodput
from ddp_hpc.judge.gpu import GpuReport
from ddp_hpc.judge.picture import Picture
from ddp_hpc.judge.reader import Failure, RunProgress
from ddp_hpc.judge.timing import Stall
from ddp_hpc.slurm.states import JobState

__all__ = ["JobStatus"]


@dataclass
class JobStatus:
    """Everything the status command knows about one job (or array task): the row, then the
    detail view's facts."""

    # -- the row: what the table shows (and the head of the detail page)
    id: str
    name: str | None
    backend: str | None
    state: str  # label shown to the user, e.g. "CANCELLED by 0" or "UNKNOWN(FOO)"
    state_name: str  # JobState member name
    source: str  # which source gave the state
    tried: list[str]
    nodes: int | None  # the nodes the newest run runs or ran on (None: not known yet)
    gpus_per_node: int | None
    device: str | None  # "cpu", "cuda", ... as the run's start events tell it; None: not told
    elapsed: str | None
    time_limit: str | None
    restarts: int
    log_dir: str | None
    cwd: str | None = None
    submitted_at: float | None = None
    reason: str | None = None
    node_list: str | None = None
    progress: RunProgress | None = None
    notes: list[str] = field(default_factory=list)
    command: list[str] | None = None  # a script/module/function job: what every rank ran
    stall: Stall | None = None  # a running job's silent ranks (ddp_hpc.judge.timing.stall)
    eval_metrics: dict | None = None  # the newest eval event's metrics
    eval_step: int | None = None
    overrides: list[str] | None = None  # an array task's overrides (the record's array[i])
    node_range: str | None = None  # "2-4": submitted with --nodes MIN-MAX
    #: useful step time / wall time since the first step, and the rest by part
    #: (ddp_hpc.judge.goodput, rounded as --json shows it); a row has it when it read every run of rank 0
    goodput: Goodput | None = None
    gpu_percent: float | None = None  # a running job's mean GPU use, the ranks' newest samples (judge.gpu)
    # -- the detail view's facts (a row leaves them empty)
    last_events: dict[int, dict] = field(default_factory=dict)
    failure: Failure | None = None
    exit_code: str | None = None
    steps: list[dict] = field(default_factory=list)
    rank_exit_codes: dict[int, int] = field(default_factory=dict)
    scheduler_history: list[dict] = field(default_factory=list)
    history_source: str | None = None
    runs: list[dict] = field(default_factory=list)
    rank_endings: dict[int, str] = field(default_factory=dict)  # from the current run's end events
    #: rank -> how it ended by the evidence (kind raised|exited|killed|vanished|stuck|consequence|
    #: stopped|lost|completed|preempted|running, text, basis, times): ddp_hpc.judge.attribution
    rank_classification: dict[str, dict] = field(default_factory=dict)
    #: per-rank and per-node step times and compute, the slow ones (judge.timing.stragglers, judge.compute)
    timing: Timing | None = None
    flight: list[str] = field(default_factory=list)  # the flight recorder's dumps (judge.flightrec)
    staging: list[dict] = field(default_factory=list)  # per node leader and source (status/staging.py)
    #: the in-allocation restarts (ddp_hpc.supervise), each with lost_s: judge.restarts.alloc_restarts
    alloc_restarts: list[dict] = field(default_factory=list)
    tensorboard: bool = False  # TensorBoard's event files in the log directory (runlogs.tboard)
    gpus: GpuReport | None = None  # each rank's newest GPU sample and the idle GPUs (judge.gpu.gpus)
    #: the run in time: samples/s and loss series, marks, and for --html the per-rank lanes
    #: (ddp_hpc.judge.picture.build)
    picture: Picture | None = None
    #: where the current run's state came from (rank 0's ``restored`` event, judge.restarts.restored_text)
    restored: str | None = None

    @property
    def job_state(self) -> JobState:
        return JobState[self.state_name]

    @property
    def script(self) -> bool:
        """The user's own script, module or function (the record's ``command``), not ddp_hpc's
        loop: what it printed and raised is in ``rank*.out``; its ``rank*.log`` holds only the
        exec wrapper's start and end lines."""
        return self.command is not None

    def to_dict(self) -> dict:
        """The fields as plain data for JSON: the nested dataclasses (progress, failure, stall,
        goodput, timing, gpus, picture) become dicts, the rest is shared with this status rather
        than deep-copied (copying 8,192 ranks' events and classifications was most of ``status
        --json``'s time)."""
        d = dict(vars(self))
        if self.progress is not None:  # numbers only: a shallow copy is a copy
            d["progress"] = dict(vars(self.progress))
        if self.failure is not None:
            d["failure"] = dataclasses.asdict(self.failure)
        for name in _NESTED:
            if (value := getattr(self, name)) is not None:
                d[name] = value.to_dict()
        d["last_events"] = {str(k): v for k, v in self.last_events.items()}
        d["rank_exit_codes"] = {str(k): v for k, v in self.rank_exit_codes.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "JobStatus":
        """The status `to_dict` gave (after a JSON round trip): the job table's cached rows."""
        d = dict(d, progress=RunProgress(**d["progress"]) if d.get("progress") else None,
                 failure=Failure(**d["failure"]) if d.get("failure") else None)
        for name, kind in _NESTED.items():
            if d.get(name) is not None:
                d[name] = kind.from_dict(d[name])
        for name in ("last_events", "rank_exit_codes", "rank_endings"):   # JSON made the ranks strings
            d[name] = {int(k): v for k, v in (d.get(name) or {}).items()}
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


#: the fields that hold a judgement's dataclass, and its class (each has ``to_dict`` and ``from_dict``)
_NESTED = {"stall": Stall, "goodput": Goodput, "timing": Timing, "gpus": GpuReport, "picture": Picture}
