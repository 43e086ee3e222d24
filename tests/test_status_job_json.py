"""A job's status as JSON (``ddp-hpc status --json``, `JobStatus.to_dict`) and back
(`JobStatus.from_dict`, the job table's cached rows): the judgements a status holds as dataclasses
(stall, goodput, timing, gpus, picture) keep the keys the JSON always had, and come back from it
as the same dataclasses, equal to the ones that went in."""
from __future__ import annotations

import json

import picture_events as pe

from ddp_hpc.judge.compute import ComputeStragglers, Timing
from ddp_hpc.judge.goodput import Goodput
from ddp_hpc.judge.gpu import GpuReport
from ddp_hpc.judge.picture import Picture
from ddp_hpc.judge.timing import RunProgress, Stall, Stragglers
from ddp_hpc.status.collect import collect
from ddp_hpc.status.job import JobStatus
from ddp_hpc.status.targets import StatusTarget

#: the keys each judgement had in the JSON before it was a dataclass, in their order
KEYS = {
    "stall": ["ranks", "silent_for_s", "others_last_s", "threshold_s", "median_interval_s", "behind",
              "last_steps", "stacks", "no_stack", "hang"],
    "goodput": ["goodput", "wall_s", "useful_s", "lost_s", "restart_phases", "steps_redone", "step_s",
                "estimated"],
    "timing": ["ranks", "nodes", "slow_ranks", "slow_nodes", "lines", "measure", "ratio_threshold",
               "min_intervals", "compute"],
    "gpus": ["ranks", "idle", "lines", "idle_percent"],
    "picture": ["t0", "t1", "series", "marks", "lanes", "lane_kind", "bins"],
}
COMPUTE_KEYS = ["ranks", "nodes", "slow_ranks", "slow_nodes", "lines", "step_s", "ratio_threshold", "min_steps"]


def _filled() -> JobStatus:
    """A running job with every judgement filled, as the detail view would hold it."""
    stall = Stall(ranks=[3], silent_for_s=133.0, others_last_s=None, threshold_s=30.0, median_interval_s=1.0,
                  behind=[3], last_steps={"3": 41}, stacks={"0": "graph.py:979 in _engine_run_backward"},
                  no_stack=[3], hang="rank 3 is not in a collective")
    steps = Stragglers(ranks={"3": {"host": "n2", "step_s": 1.8, "intervals": 11, "ratio": 1.8, "slow": True}},
                       nodes={"n2": {"ranks": [2, 3], "step_s": 1.8, "ratio": 1.8, "slow": True}},
                       slow_ranks=[2, 3], slow_nodes=["n2"], lines=["n2 is 1.8x slower than the median node"],
                       measure="step event intervals", ratio_threshold=1.25, min_intervals=5)
    compute = ComputeStragglers(ranks={"5": {"host": "n3", "compute_s": 0.07, "ratio": 1.4, "wait_share": 0.2,
                                             "slow": True}},
                                nodes={"n3": {"ranks": [5], "compute_s": 0.07, "slow": False}}, slow_ranks=[5],
                                slow_nodes=[], lines=["rank 5 on n3 computes 1.4x slower"], step_s=0.1,
                                ratio_threshold=1.2, min_steps=20)
    gpus = GpuReport(ranks={"0": {"gpu": 0, "util_percent": 91, "host": "n1", "time": 1000.5, "xid_errors": [79]}},
                     idle={"0": {"util_percent": 7.0, "window_s": 60.0, "step_s": 0.5, "data_s": 0.3}},
                     lines=["rank 0 on n1: its GPU was 7% busy"], idle_percent=20.0)
    pic = Picture(t0=1000.0, t1=1600.0, series=[[1000.0, 25.5, 2.1, 0], [1002.0, None, 2.0, 0]],
                  marks=[{"kind": "restart", "time": 1400.0, "restart": 1, "inside": True, "phases": pe.PHASES}],
                  lanes=[{"label": "rank 0 (n1)", "ranks": "0", "hosts": ["n1"], "cells": [[0, 3, 2]],
                          "points": [], "partial": False}], lane_kind="rank", bins=240)
    return JobStatus(id="88", name="train", backend="sbatch", state="RUNNING", state_name="RUNNING",
                     source="squeue", tried=[], nodes=2, gpus_per_node=2, device="cuda", elapsed="00:10:00",
                     time_limit="01:00:00", restarts=1, log_dir="/runs/88",
                     progress=RunProgress(step=41, total_steps=800, percent=5.125), stall=stall,
                     goodput=Goodput.from_dict(pe.GOODPUT), timing=Timing(steps, compute), gpus=gpus, picture=pic,
                     last_events={0: {"event": "step", "step": 41}}, rank_exit_codes={1: 0},
                     rank_endings={0: "running", 1: "failed: ValueError"})


def _round_trip(st: JobStatus) -> JobStatus:
    return JobStatus.from_dict(json.loads(json.dumps(st.to_dict())))


def test_a_status_with_every_judgement_filled_survives_a_json_round_trip():
    st = _filled()
    back = _round_trip(st)
    assert back == st
    assert isinstance(back.stall, Stall) and isinstance(back.goodput, Goodput) and isinstance(back.gpus, GpuReport)
    assert isinstance(back.picture, Picture) and isinstance(back.timing, Timing)
    assert back.timing.by_step_time == st.timing.by_step_time and back.timing.by_compute == st.timing.by_compute


def test_the_json_keys_of_the_judgements_are_unchanged():
    d = json.loads(json.dumps(_filled().to_dict()))
    for name, keys in KEYS.items():
        assert list(d[name]) == keys, name
    assert list(d["timing"]["compute"]) == COMPUTE_KEYS
    # the lines of both: the compute's first
    assert d["timing"]["lines"] == ["rank 5 on n3 computes 1.4x slower", "n2 is 1.8x slower than the median node"]
    assert d["goodput"] == json.loads(json.dumps(pe.GOODPUT))
    assert d["stall"]["last_steps"] == {"3": 41} and d["gpus"]["ranks"]["0"]["xid_errors"] == [79]


def test_the_optional_parts_stay_out_of_the_json_as_before():
    """A picture without lanes (the detail view's) has no lane keys; timing judged by compute
    alone is the compute and its lines; an empty judgement is null."""
    st = _filled()
    pic = Picture(t0=1.0, t1=2.0, series=[], marks=[])
    only_compute = Timing(None, st.timing.by_compute)
    st.picture, st.timing, st.stall, st.gpus = pic, only_compute, None, None
    d = st.to_dict()
    assert list(d["picture"]) == ["t0", "t1", "series", "marks"]
    assert d["timing"] == {"compute": st.timing.by_compute.to_dict(), "lines": ["rank 5 on n3 computes 1.4x slower"]}
    assert d["stall"] is None and d["gpus"] is None
    assert _round_trip(st) == st


def test_a_real_detail_status_keeps_its_judgements_through_the_round_trip(tmp_path):
    """What the detail view assembles from a run's logs (picture with its lanes, goodput,
    stragglers) comes back equal."""
    st = collect([StatusTarget(pe.JOB, None, str(pe.write_run(tmp_path / "logs")))], None, None,
                 history=True, now=pe.T0 + 700.0, lanes=True)[0]
    assert st.picture is not None and st.picture.lanes and st.goodput is not None and st.timing is not None
    back = _round_trip(st)
    assert [getattr(back, k) for k in KEYS] == [getattr(st, k) for k in KEYS]
