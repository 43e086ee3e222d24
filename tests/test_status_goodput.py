"""Goodput in ``ddp-hpc status``: the detail view's line and breakdown, the ``goodput`` object of
``--json``, and the table's GOODPUT column where the terminal is wide enough. Log directories are
written as ranks write them; the scheduler answers like Slurm's sacct (a duck-typed SlurmCLI)."""
import json

import pytest

from ddp_hpc.status.collect import collect
from ddp_hpc.status.targets import StatusTarget
from ddp_hpc.status.view import render_detail, render_table, to_json

T0 = 1_800_000_000.0


class FakeSlurm:
    def __init__(self, sacct=()):
        self.sacct_rows = list(sacct)

    def cluster_name(self):
        return "test"

    def squeue(self, job_ids=None, **kw):
        return []

    def sacct(self, job_ids, completion=False, duplicates=False, **kw):
        return [r for r in self.sacct_rows if r["JobID"] in map(str, job_ids)]


def _sched(job: str) -> FakeSlurm:
    return FakeSlurm([{"JobID": job, "JobIDRaw": job, "State": "COMPLETED", "ExitCode": "0:0",
                       "Elapsed": "00:01:00", "Timelimit": "00:30:00", "NNodes": "1", "NodeList": "n1",
                       "JobName": "demo"}])


def _write(d, job: str, runs: list[tuple[int, float, int, int]]) -> None:
    """Two ranks' events: per run (restart, first time, first step, last step) a start, a step a
    second, and an end event a second after the last step of the last run."""
    d.mkdir(parents=True, exist_ok=True)
    for rank in (0, 1):
        with open(d / f"rank{rank}.events.jsonl", "a") as f:
            for restart, t0, first, last in runs:
                base = {"rank": rank, "job_id": job, "restart": restart, "host": "n1"}
                f.write(json.dumps({**base, "time": T0 + t0 - 5, "event": "start", "world_size": 2}) + "\n")
                for s in range(first, last + 1):
                    f.write(json.dumps({**base, "time": T0 + t0 + s - first, "event": "step", "step": s,
                                        "total_steps": 20, "loss": 1.0 / s}) + "\n")
            restart, t0, first, last = runs[-1]
            f.write(json.dumps({"rank": rank, "job_id": job, "restart": restart, "host": "n1",
                                "time": T0 + t0 + last - first + 1, "event": "end", "status": "completed"}) + "\n")


def _mark_restart(d, restart: int, rendezvous: dict, restored_at: float) -> None:
    """Each rank's marks of run ``restart`` as the ranks write them, right after its start event:
    the ``rendezvous`` event (its own times) and the ``restored`` event."""
    for rank in (0, 1):
        f = d / f"rank{rank}.events.jsonl"
        out = []
        for line in f.read_text().splitlines():
            out.append(line)
            e = json.loads(line)
            if e["event"] == "start" and e["restart"] == restart:
                base = {k: e[k] for k in ("rank", "job_id", "restart", "host")}
                out.append(json.dumps({**base, "time": e["time"] + 0.1, "event": "rendezvous", **rendezvous}))
                out.append(json.dumps({**base, "time": restored_at, "event": "restored", "step": 6,
                                       "source": "file", "seconds": 0.3}))
        f.write_text("\n".join(out) + "\n")


def test_detail_and_json_show_goodput_with_restart_phases(tmp_path):
    d = tmp_path / "run"
    _write(d, "55", [(0, 0.0, 1, 10), (1, 30.0, 7, 20)])    # run 1 starts at T0 + 25
    _mark_restart(d, 1, {"proc_start": T0 + 20, "called_at": T0 + 24, "up_at": T0 + 25}, T0 + 25.3)
    (d / "restarts.jsonl").write_text(json.dumps({
        "restart": 1, "job_id": "55", "fault_at": T0 + 9.5, "detected_at": T0 + 11, "stopped_at": T0 + 13,
        "trigger": "exited", "why": "rank 1 killed", "kind": "killed", "rank": 1, "node": "n1", "excluded": [],
        "nodes_before": ["n1"], "nodes_after": ["n1"], "world_before": 2, "world_after": 2}) + "\n")
    phases = {"detect": 1.5, "stop": 2.0, "start": 7.0, "import": 4.0, "rendezvous": 1.0, "restore": 0.3,
              "first_step": 4.7}     # judge.restarts.phases, from the marks above
    st = collect([StatusTarget("55", None, str(d))], _sched("55"), history=True, now=T0 + 100)[0]
    lines = render_detail(st, now=T0 + 100).splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("Goodput:"))
    # wall: the first step (T0) to the end event (T0 + 44); useful 19 s; restart 21 s; 3 steps again
    assert lines[i] == "Goodput:    43.2% of 44.0 s since the first step were useful steps (19.0 s)"
    assert lines[i + 1] == ("            lost: restarts 21.0 s (detect 1.5 + stop 2.0 + start 7.0 + import 4.0 + "
                            "rendezvous 1.0 + restore 0.3 + first_step 4.7), steps trained twice 3.0 s (3 steps), "
                            "other 1.0 s")
    g = json.loads(to_json(st.to_dict()))["goodput"]
    assert g["goodput"] == pytest.approx(19 / 44, abs=1e-4) and g["steps_redone"] == 3
    assert g["lost_s"]["restarts"] == 21.0 and g["restart_phases"] == pytest.approx(phases)


def test_table_has_a_goodput_column_where_the_terminal_is_wide_enough(tmp_path):
    d = tmp_path / "run"
    _write(d, "56", [(0, 0.0, 1, 10)])
    [row] = collect([StatusTarget("56", None, str(d))], _sched("56"), now=T0 + 100, brief=True)
    assert row.goodput.goodput == pytest.approx(9 / 10)   # the last second: the end event
    wide = render_table([row]).splitlines()
    assert "GOODPUT" in wide[0].split() and "90.0%" in wide[1].split()
    narrow = render_table([row], width=max(map(len, wide)) - 1).splitlines()
    assert "GOODPUT" not in narrow[0] and "90.0%" not in narrow[1]


@pytest.mark.parametrize("warm", [True, False])
def test_a_restart_from_the_warm_standby_says_so_beside_its_phases(tmp_path, warm):
    d = tmp_path / "run"
    _write(d, "57", [(0, 0.0, 1, 10), (1, 30.0, 7, 20)])
    _mark_restart(d, 1, {"proc_start": T0 + 20, "called_at": T0 + 20.1, "up_at": T0 + 20.5, "warm": warm},
                  T0 + 20.6)
    (d / "restarts.jsonl").write_text(json.dumps({
        "restart": 1, "job_id": "57", "fault_at": T0 + 9.5, "detected_at": T0 + 11, "stopped_at": T0 + 13,
        "trigger": "exited", "why": "rank 1 killed", "kind": "killed", "rank": 1, "node": "n1", "excluded": [],
        "nodes_before": ["n1"], "nodes_after": ["n1"], "world_before": 2, "world_after": 2}) + "\n")
    st = collect([StatusTarget("57", None, str(d))], _sched("57"), history=True, now=T0 + 100)[0]
    line = next(ln for ln in render_detail(st, now=T0 + 100).splitlines() if ln.strip().startswith("restart 1:"))
    assert line.endswith("(warm standby: the ranks had imported torch before the fault)") is warm, line
