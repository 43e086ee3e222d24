"""Watching one job step: its srun process, the ranks' events (read as they grow), the states of
its nodes; and stopping it.

A step needs stopping when srun ended (every rank gone, or srun's --kill-on-bad-exit ended it),
when a rank wrote that it failed because a peer did (a lost connection, a collective timeout:
srun may wait long for a node that is gone; a rank's own error is left to srun, which ends the
step when that rank exits, with its exit report, so its peers' errors then wait
`RAISED_GRACE_S`), when one of its nodes is lost (down, not
responding, powered off), or when no rank showed a sign of life (`LIFE_EVENTS`: a training step, an
epoch's end, an evaluation, a checkpoint, the evaluation's progress) for the stall timeout after
steps had begun (a hang the ranks' own collective timeout did not end), or for the hang limit
(``hang.StepClock``: a few times the run's own step time, 30 s at least) once the step times are
known, except while a checkpoint is being saved (its ``progress`` event of phase ``checkpoint``
came from a rank, that rank's ``checkpoint`` event not yet, whatever the others write: a big save
may take minutes; the stall timeout still applies). Once every rank wrote its ``end`` event,
neither applies: their processes get `END_GRACE_S` to tear down (torch's teardown takes seconds,
more on a loaded machine).

A draining node (DRAIN, DRAINING, DRAINED, FAIL, FAILING, MAINT, REBOOT_*, INVAL: "no new work")
is no reason to stop: Slurm lets the running step go on there. `node_health` tells it apart from
a lost node; the supervisor avoids it at the next restart (``plan.next_nodes``).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddp_hpc.judge.evidence import consequence_phrase
from ddp_hpc.parsing import to_float, to_int
from ddp_hpc.runlogs.schema import ANY_EVENTS_RE
from ddp_hpc.slurm.cli import SlurmCLI, SlurmError
from ddp_hpc.supervise.hang import StepClock

__all__ = ["EventTail", "StepEnd", "Watch", "NodeHealth", "LIFE_EVENTS", "node_condition", "node_health",
           "watch_step", "stop_step", "down_nodes"]

#: after a rank wrote that it lost a peer, how long srun gets to end the step by itself: enough
#: for srun's report of a rank killed by a signal (it comes at once), short since the step is
#: broken either way (a killed rank: srun ended the step 3.4 s after its peers' errors as they tore
#: down; a lost node: srun never does)
FAILED_GRACE_S = 1.0
#: the same grace when a rank also wrote an error of its own (it raised): its process is on its way
#: out, and srun's report of its exit code (the evidence a user reads) comes once it is gone; a
#: step killed first keeps none (under load the raising rank's teardown took more than 1 s)
RAISED_GRACE_S = 5.0
#: how often the nodes' states are asked (sinfo), seconds
NODE_EVERY_S = 3.0
#: once every rank wrote its end event, how long their processes get to tear down, seconds
END_GRACE_S = 120.0
#: events that show a rank is working: the stall timer starts at the first step and restarts at each
LIFE_EVENTS = frozenset({"step", "epoch", "eval", "checkpoint", "progress"})
#: sinfo's state suffixes (%T) of a node that does not answer: ``*`` not responding, ``~`` powered
#: off, ``%`` powering down
_GONE_FLAGS = ("*", "~", "%")
#: base states of a lost node
_GONE_STATES = ("down", "power_down", "powered_down", "powering_down")
#: base states of a node that takes no new work while its running steps go on: an admin's drain,
#: FAIL, maintenance, a reboot asked for, and INVAL (it registered with less than slurm.conf says:
#: Slurm gives it no job until its slurmd registers again)
_DRAIN_STATES = ("drain", "fail", "maint", "reboot", "inval")


class EventTail:
    """New events of run ``restart`` in a log directory's event files (one per node; one per rank
    in run directories of earlier versions), read incrementally.

    A poll costs one stat of the directory and one of each event file it knows, and reads only the
    files that grew (a job of thousands of ranks is polled every second for as long as it runs, on a
    shared filesystem whose metadata server every job shares). The directory is listed again only
    when its modification time changed, or changed within `RECENT_S` (a coarse clock may give two
    creations one time), or `RELIST_S` passed."""

    #: list the directory again while its last change is this recent, seconds
    RECENT_S = 2.0
    #: list it again at least this often, seconds
    RELIST_S = 30.0

    def __init__(self, log_dir: str | Path, restart: int):
        self.dir, self.restart = Path(log_dir), restart
        self._pos: dict[str, int] = {}
        self._rest: dict[str, bytes] = {}
        self._names: list[str] = []
        self._listed: tuple[int, float] | None = None   # (the directory's mtime_ns, when listed)

    def _files(self) -> list[str]:
        """The event files' names, listed again only when the directory may have changed."""
        try:
            mtime = os.stat(self.dir).st_mtime_ns
        except OSError:
            return []
        now = time.time()
        if (self._listed is None or mtime != self._listed[0] or now - mtime / 1e9 < self.RECENT_S
                or now - self._listed[1] > self.RELIST_S):
            try:
                self._names = sorted(n for n in os.listdir(self.dir) if ANY_EVENTS_RE.match(n))
            except OSError:
                return self._names
            self._listed = (mtime, now)
        return self._names

    def poll(self) -> list[dict]:
        out: list[dict] = []
        for name in self._files():
            path = os.path.join(self.dir, name)
            pos = self._pos.get(name, 0)
            try:
                size = os.stat(path).st_size
                if size == pos:
                    continue
                if size < pos:             # the file was replaced: read it from its start
                    pos, self._rest[name] = 0, b""
                with open(path, "rb") as f:
                    f.seek(pos)
                    chunk = f.read()
            except OSError:
                continue
            self._pos[name] = pos + len(chunk)
            lines = (self._rest.pop(name, b"") + chunk).split(b"\n")
            if lines[-1]:
                self._rest[name] = lines[-1]       # a line the writer has not ended yet
            for line in lines[:-1]:
                try:
                    ev = json.loads(line.decode("utf-8", errors="replace"))
                except ValueError:
                    continue
                if isinstance(ev, dict) and to_int(ev.get("restart"), 0) == self.restart:
                    out.append(ev)
        return out


@dataclass
class StepEnd:
    """Why the step ended or was stopped (`plan.TRIGGERS`), srun's exit status, and when."""

    trigger: str
    returncode: int | None
    detected_at: float
    first_bad_at: float | None = None    # the first error event of a rank that lost a peer
    last_step_at: float | None = None    # the newest sign of life (`LIFE_EVENTS`) of any rank
    stall_s: float | None = None         # "stalled": the limit it outlasted, seconds
    down: list[str] = field(default_factory=list)   # nodes sinfo called down / not responding
    step_id: str | None = None           # the Slurm step the ranks run in (their rendezvous events)
    grace_s: float = FAILED_GRACE_S      # "rank failed": how long srun had to end the step itself


@dataclass(frozen=True)
class Watch:
    """What to watch: the step's nodes, the stall timeout (0: off), how often to look, the hang
    limit's floor (``hang.StepClock``; 0: off) and the clock itself, kept across a watch that goes
    on; going on after the stacks showed ranks busy outside a collective: the newest sign of life
    then (the stall timeout counts from it), when they were asked (``busy_at``) and how long the
    hang limit then waits, counted from ``busy_at`` (``hold_s``, until a step after ``busy_at``;
    None: no hang limit until then)."""

    nodes: tuple[str, ...]
    stall_timeout_s: float = 0.0
    every_s: float = 1.0
    hang_floor_s: float = 0.0
    last_step_at: float | None = None
    busy_at: float | None = None
    hold_s: float | None = None
    clock: StepClock | None = None


def node_condition(state: str) -> str:
    """``lost`` (down, not responding, powered off: its ranks are gone), ``draining`` (drain, fail,
    maintenance, a reboot asked for, an invalid registration: no new work, running steps go on)
    or ``up``, from sinfo's
    ``%T`` (``idle``, ``mixed``, ``draining``, ``drained*``, ``down~``, ``allocated+drain`` ...)."""
    text = (state or "").strip().lower()
    if text.endswith(_GONE_FLAGS):
        return "lost"
    base = text.rstrip("$@^-#!*~%")
    words = base.replace("+", " ").split()
    if any(w.startswith(_GONE_STATES) for w in words[:1]):
        return "lost"
    if any(w.startswith(_DRAIN_STATES) for w in words) or text.endswith(("$", "@")):
        return "draining"
    return "up"


@dataclass(frozen=True)
class NodeHealth:
    """The nodes sinfo calls lost, and those it calls draining (each sorted)."""

    lost: tuple[str, ...] = ()
    draining: tuple[str, ...] = ()


def node_health(cli: SlurmCLI, nodes) -> NodeHealth:
    """Which of ``nodes`` are lost and which draining (nothing known when sinfo fails)."""
    try:
        states = cli.node_states(list(nodes))
    except SlurmError:
        return NodeHealth()
    cond = {n: node_condition(s) for n, s in states.items()}
    return NodeHealth(tuple(sorted(n for n, c in cond.items() if c == "lost")),
                      tuple(sorted(n for n, c in cond.items() if c == "draining")))


def down_nodes(cli: SlurmCLI, nodes) -> list[str]:
    """The nodes of ``nodes`` that sinfo calls lost: down, not responding or powered off (not a
    draining one: its steps go on)."""
    return list(node_health(cli, nodes).lost)


class _Seen:
    """What the run's events told so far: the first rank that lost a peer and the first that
    raised, the newest sign of life, the step times (`hang.StepClock`), the ranks heard from and
    those that ended."""

    def __init__(self, watch: Watch) -> None:
        self.first_bad: float | None = None
        self.raised_at: float | None = None    # the first error of a rank's own (not a lost peer)
        self.last_step, self.quiet = watch.last_step_at, watch.busy_at
        self.clock = watch.clock if watch.clock is not None else StepClock(watch.hang_floor_s)
        self.hold_s = watch.hold_s
        self.exiting = False                 # a rank ended or its interpreter exits: no hang limit
        self.saving: set = set()             # ranks whose save was announced and is not done: no hang limit
        self.ranks: set = set()
        self.ended: set = set()
        self.last_end: float | None = None
        self.step_id: str | None = None

    def add(self, ev: dict) -> None:
        self.clock.add(ev)
        name, t = ev.get("event"), to_float(ev.get("time"))
        if name == "rendezvous" and ev.get("step_id") is not None:
            self.step_id = str(ev["step_id"])
        self.ranks.add(ev.get("rank"))
        if name == "end":
            self.ended.add(ev.get("rank"))
            self.last_end = max(self.last_end or 0.0, t or time.time())
        self.exiting = self.exiting or name == "end" or (name == "progress" and ev.get("phase") == "exit")
        if name in ("progress", "checkpoint", "step"):   # each rank's own save: another's events end none
            if name == "progress" and ev.get("phase") == "checkpoint":
                self.saving.add(ev.get("rank"))
            else:
                self.saving.discard(ev.get("rank"))
        alive = name == "step" or (self.last_step is not None and name in LIFE_EVENTS)
        if alive and t is not None:
            self.last_step = max(self.last_step or t, t)
        if self.quiet is not None and name == "step" and (t or 0) > self.quiet:
            self.quiet = None
        lost_peer = name == "error" and consequence_phrase(ev.get("message"), ev.get("exc_type"))
        if lost_peer and self.first_bad is None:
            self.first_bad = t or time.time()
        if name == "error" and not lost_peer and self.raised_at is None:
            self.raised_at = t or time.time()

    def stalled(self, watch: Watch, now: float) -> float | None:
        """The limit the run outlasted without a sign of life, None while it did not. Once every
        rank ended, only `END_GRACE_S` after the last end (the processes tear down)."""
        if self.ranks and self.ended >= self.ranks:
            return END_GRACE_S if self.last_end is not None and now - self.last_end > END_GRACE_S else None
        if self.last_step is None:
            return None
        fast = None if self.exiting or self.saving else self.hold_s if self.quiet else self.clock.limit()
        since = max(self.quiet or self.last_step, self.last_step)   # a hold counts from the busy answer
        hits = [x for x, t in ((watch.stall_timeout_s, self.last_step), (fast, since)) if x and now - t > x]
        return min(hits) if hits else None


def watch_step(proc: subprocess.Popen, tail: EventTail, cli: SlurmCLI, watch: Watch,
               stopping=lambda: False, on_training=None) -> StepEnd:
    """Wait until the step ended or needs stopping (`stopping()`: the supervisor was told to end);
    ``on_training()`` is called once, when the first training step is seen."""
    seen = _Seen(watch)
    next_nodes = time.monotonic() + NODE_EVERY_S
    while True:
        rc = proc.poll()
        for ev in tail.poll():
            seen.add(ev)
        if on_training is not None and seen.last_step is not None and rc is None:
            on_training()
            on_training = None
        now = time.time()
        end = StepEnd("exited", rc, now, seen.first_bad, seen.last_step, step_id=seen.step_id)
        if rc is not None or stopping():
            return end
        grace = FAILED_GRACE_S if seen.raised_at is None else RAISED_GRACE_S
        if seen.first_bad is not None and now - seen.first_bad > grace:
            end.trigger, end.grace_s = "rank failed", grace
            return end
        if time.monotonic() >= next_nodes:
            next_nodes = time.monotonic() + NODE_EVERY_S
            if down := down_nodes(cli, watch.nodes):
                end.trigger, end.down = "node down", down
                return end
        if (limit := seen.stalled(watch, now)) is not None:
            end.trigger, end.stall_s = "stalled", limit
            return end
        time.sleep(watch.every_s)


def stop_step(proc: subprocess.Popen, timeout: float = 8.0) -> int | None:
    """End the step: srun's own abort (two SIGINTs within a second: Slurm kills every task), then,
    if srun still runs after ``timeout`` (it waits KillWait + 2 s for a node that does not answer),
    SIGKILL for srun."""
    if proc.poll() is None:
        for _ in range(2):
            try:
                proc.send_signal(signal.SIGINT)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
