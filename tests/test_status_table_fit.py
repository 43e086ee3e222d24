"""What a new user sees first: the job table fits 100 columns (every column whole with
``--wide``), shows a rate for every kind of job and the total where one is known, marks the jobs
of another directory; the detail view of a failed plain script names rank{R}.out first and says
its exit in words. Built from JobStatus values and a hand-written run-log directory with fixed
times, compared with golden files under tests/golden/.

To rewrite the golden files after a deliberate change: ``DDP_HPC_UPDATE_GOLDEN=1 pytest
tests/test_status_table_fit.py``, then review the diff of tests/golden/status_*.txt.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ddp_hpc.judge.timing import RunProgress, Stall
from ddp_hpc.records import JobRecord
from ddp_hpc.status import view
from ddp_hpc.status.collect import collect
from ddp_hpc.status.job import JobStatus
from ddp_hpc.status.table import render_table
from ddp_hpc.status.targets import StatusTarget, submitted_here

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("DDP_HPC_UPDATE_GOLDEN") == "1"
T0 = 1_767_000_000.0
HERE = "/home/ada/proj"


def job(id, name, state, **kw) -> JobStatus:
    fields = dict(id=id, name=name, backend="sbatch", state=state, state_name=state.split()[0], source="squeue",
                  tried=[], nodes=2, gpus_per_node=4, device="cuda", elapsed="00:12:34", time_limit="04:00:00",
                  restarts=0, log_dir=f"/scratch/ada/proj/runs/{name}-{id}", cwd=HERE)
    fields.update(kw)
    return JobStatus(**fields)


def ten_jobs() -> list[JobStatus]:
    """Ten jobs of one user: ddp_hpc's loop (running with eval metrics and GPU use; a sweep's two
    tasks), plain scripts (a failed one, one reporting its total), a local job of another
    checkout, a stalled one, a pending one, a cancelled one, one that timed out after restarts."""
    loop = RunProgress(epoch=1, step=400, total_steps=800, percent=50.0, loss=0.4321, samples_per_s=25127.9,
                       eta_s=1234.0, updated=T0)
    return [
        job("4242", "resnet50", "RUNNING", progress=loop, eval_metrics={"accuracy": 0.9123, "loss": 0.3},
            gpu_percent=87.0),
        job("4243_0", "sweep", "COMPLETED", progress=RunProgress(epoch=2, step=800, total_steps=800, percent=100.0,
                                                                 loss=0.25, samples_per_s=9876.5, eta_s=0.0),
            eval_metrics={"accuracy": 0.9, "loss": 0.25}, overrides=["optim.lr=0.1", "seed=1"],
            log_dir="/scratch/ada/proj/runs/sweep-4243/0"),
        job("4243_1", "sweep", "COMPLETED", progress=RunProgress(epoch=2, step=800, total_steps=800, percent=100.0,
                                                                 loss=0.31, samples_per_s=9811.0, eta_s=0.0),
            eval_metrics={"accuracy": 0.8, "loss": 0.31}, overrides=["optim.lr=0.01", "seed=1"],
            log_dir="/scratch/ada/proj/runs/sweep-4243/1"),
        job("local-boom-20261129-145026-9892", "boom", "FAILED", backend="local", source="record", device="cpu",
            gpus_per_node=2, elapsed="00:00:09", time_limit=None, command=["python", "boom.py"],
            progress=RunProgress(step=101, loss=0.006256, steps_per_s=6.2, updated=T0),
            log_dir="/home/ada/proj/runs/boom-20261129-145026-9892"),
        job("4250", "train", "RUNNING", command=["python", "train.py"],
            progress=RunProgress(step=57, total_steps=300, percent=19.0, loss=1.234, steps_per_s=2.5, eta_s=97.0)),
        job("local-demo-20261129-135744-9ef7", "demo", "COMPLETED", backend="local", source="record", device="cpu",
            gpus_per_node=2, elapsed="00:00:11", time_limit=None, cwd="/home/ada/other-checkout",
            progress=RunProgress(epoch=2, step=87, total_steps=87, percent=100.0, loss=1.537, samples_per_s=25127.9,
                                 eta_s=0.0), log_dir="/home/ada/other-checkout/runs/demo-20261129-135744-9ef7"),
        job("4251", "bert-large", "RUNNING", progress=RunProgress(epoch=0, step=1200, total_steps=10000, percent=12.0,
                                                                  loss=2.5, samples_per_s=512.0, eta_s=7200.0),
            stall=Stall(ranks=[1], silent_for_s=130.0, others_last_s=2.0, threshold_s=30.0,
                        median_interval_s=1.0, behind=[], last_steps={"1": 1200})),
        job("4252", "resnet50", "PENDING", elapsed=None, nodes=None),
        job("4253", "resnet50", "CANCELLED by 1000", elapsed="00:01:02",
            progress=RunProgress(epoch=0, step=12, total_steps=800, percent=1.5, loss=6.9, samples_per_s=24000.0)),
        job("4254", "llm-7b", "TIMEOUT", restarts=2, nodes=3, node_range="2-4", elapsed="04:00:07",
            progress=RunProgress(epoch=0, step=5000, total_steps=20000, percent=25.0, loss=2.01, samples_per_s=300.5)),
    ]


def golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.write_text(text, encoding="utf-8")
    assert text == path.read_text(encoding="utf-8"), \
        f"{name} changed; review the difference and rerun with DDP_HPC_UPDATE_GOLDEN=1"


def test_ten_jobs_fit_100_columns_with_every_id_whole():
    jobs = ten_jobs()
    text = render_table(jobs, 100, HERE)
    golden("status_table_fit100.txt", text)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 100, max(lines, key=len)
    rows = {ln.split()[0]: ln for ln in lines[1:11]}
    assert list(rows) == [s.id for s in jobs]    # every id whole, in order
    # a rate for every kind of job: samples/s of ddp_hpc's loop, steps/s of a script
    assert "25128 smp/s" in rows["4242"] and "6.2 st/s" in rows["local-boom-20261129-145026-9892"]
    assert "s57/300" in rows["4250"] and "2.5 st/s" in rows["4250"]
    # the job of another checkout is marked and the mark explained; this directory's are not
    assert rows["local-demo-20261129-135744-9ef7"].split()[1] == "demo*"
    assert rows["local-boom-20261129-145026-9892"].split()[1] == "boom"
    assert lines[11].startswith("* submitted from another directory") and "--here" in lines[11]
    assert lines[12].startswith("more with --wide: ") and "LOG DIR" in lines[12]


def test_wide_shows_every_column_whole():
    jobs = ten_jobs()
    text = render_table(jobs, None, HERE)
    golden("status_table_wide.txt", text)
    head = text.splitlines()[0].split()
    for column in ("BACKEND", "NODESxGPUS", "ELAPSED/LIMIT", "RESTARTS", "RATE", "ETA", "EVAL", "OVERRIDES", "GPU%"):
        assert column in head
    assert "/scratch/ada/proj/runs/resnet50-4242" in text and "--wide" not in text
    assert "e1 s400/800 50%" in text and "00:12:34/04:00:00" in text


@pytest.mark.parametrize("width", [60, 80, 100, 120, 160])
def test_the_table_gives_way_in_order_and_never_cuts_an_id(width):
    jobs = ten_jobs()
    lines = render_table(jobs, width, HERE).splitlines()
    assert [ln.split()[0] for ln in lines[1:11]] == [s.id for s in jobs]
    if width >= 100:   # below that, a local id and the core columns alone are wider: best effort
        assert max(map(len, lines)) <= width, (width, max(lines, key=len))
    wider = render_table(jobs, width + 20, HERE).splitlines()
    assert len(wider[0].split()) >= len(lines[0].split())   # more room never shows fewer columns


def test_a_finished_script_shows_the_same_rate_as_a_running_one():
    """The kept summary of an ended job (judge/kept.py) holds the whole RunProgress, steps/s too:
    a row made from it reads like the running job's."""
    running = job("7", "s", "RUNNING", progress=RunProgress(step=50, steps_per_s=6.2))
    ended = JobStatus.from_dict(json.loads(json.dumps(job("7", "s", "FAILED", progress=RunProgress(
        step=50, steps_per_s=6.2)).to_dict())))
    for width in (None, 100):
        cells = [render_table([s], width).splitlines()[1].split() for s in (running, ended)]
        assert cells[0][cells[0].index("st/s") - 1] == cells[1][cells[1].index("st/s") - 1] == "6.2"


def test_here_is_this_directory_or_one_below_it(tmp_path):
    (tmp_path / "proj" / "jobs").mkdir(parents=True)
    (tmp_path / "proj2").mkdir()
    here = str(tmp_path / "proj")
    assert submitted_here(here, here) and submitted_here(str(tmp_path / "proj" / "jobs"), here)
    assert not submitted_here(str(tmp_path / "proj2"), here)    # a sibling that shares the prefix
    assert not submitted_here(str(tmp_path), here)
    assert submitted_here(None, here) and submitted_here(here, None)    # not known: not marked
    os.symlink(tmp_path / "proj", tmp_path / "link")
    assert submitted_here(str(tmp_path / "link"), here)


@pytest.mark.parametrize("code, words", [("1:0", "exit status 1"), ("0:9", "killed by signal 9 (SIGKILL)"),
                                         ("137:0", "exit status 137 (128 + 9: killed by SIGKILL)"),
                                         ("0:0", "exit status 0"), ("weird", "weird")])
def test_exit_codes_in_words(code, words):
    assert view.exit_words(code) == words


# -- the detail view of a failed plain script (ddp-hpc submit -N 2 -G 2 boom.py, rank 3 raises)

BOOM = "local-boom-20261129-145026-9892"
TB = 'Traceback (most recent call last):\n  File "/tmp/s43/boom.py", line 17, in <module>\n' \
     '    raise RuntimeError("boom")\nRuntimeError: boom\n'


def _ev(rank: int, t: float, event: str, **kw) -> dict:
    return {"time": T0 + t, "event": event, "rank": rank, "job_id": BOOM, "restart": 0,
            "host": "n1" if rank < 2 else "n2", **kw}


def write_boom(d: Path) -> None:
    """Four ranks of a plain script as the exec wrapper writes them: rank 3 raises at step 100,
    the others are stopped with SIGTERM; rank*.log holds the wrapper's two lines, rank*.out the
    script's prints and rank 3's traceback."""
    d.mkdir(parents=True)
    for r in range(4):
        evs = [_ev(r, 0, "start", world_size=4, num_nodes=2, local_rank=r % 2, pid=100 + r, total_steps=None,
                   epochs=None, launcher="exec/local", command=["python", "boom.py"], device="cpu",
                   instrumented=True)]
        evs += [_ev(r, 1 + s / 10, "step", epoch=None, step=s, total_steps=None, loss=1 / s, lr=0.01,
                    samples_per_s=None, metrics=None, steps_per_s=6.2, compute_s=0.01) for s in (2, 50, 100)]
        if r == 3:
            evs += [_ev(3, 12, "error", exc_type="RuntimeError", message="boom", traceback=TB, exit_code=1,
                        signal=None),
                    _ev(3, 12.01, "end", status="failed", exit_code=1, signal=None, step=101, duration_s=12.0)]
        else:
            evs.append(_ev(r, 12.1, "end", status="killed", exit_code=None, signal="SIGTERM", step=100,
                           duration_s=12.1))
        (d / f"rank{r}.events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))
        (d / f"rank{r}.log").write_text(f"exec: started python as pid {100 + r}\nexec: command ended\n")
        (d / f"rank{r}.out").write_text("step 0 0.52\n" + (TB if r == 3 else ""))


def test_detail_of_a_failed_script_names_its_output_first(tmp_path, utc):
    d = tmp_path / "runs" / "boom"
    write_boom(d)
    rec = JobRecord(id=BOOM, cluster="vm", name="boom", backend="local", nodes=2, gpus_per_node=2, time_limit=None,
                    log_dir=str(d), config=None, overrides=[], submitted_at=T0 - 1, cwd=str(tmp_path), pids=[],
                    pid_times=[], command=["python", "boom.py"],
                    final={"elapsed": "00:00:13", "ended_at": T0 + 12.5, "exit_code": "1:0", "state": "FAILED",
                           "state_name": "FAILED", "reason": "rank 3 exited with 1", "seen_at": T0 + 12.5,
                           "source": "the local driver", "started_at": T0 - 0.5, "time_limit": None})
    st = collect([StatusTarget(BOOM, rec, str(d))], None, None, history=True, now=T0 + 60)[0]
    text = view.render_detail(st, now=T0 + 60, unicode=False).replace(str(d), "<LOG_DIR>")
    golden("status_detail_script_failed.txt", text)
    lines = text.splitlines()
    at = lines.index("Log dir:    <LOG_DIR>")
    assert lines[at + 1:at + 3] == [
        "            rank{R}.out  your script's output: prints and tracebacks, read it first",
        "            rank{R}.log  ddp_hpc's notes (exec: lines)"]
    assert "Exit:       exit status 1" in lines and "1:0" not in text and "Exit codes" not in text
    assert "First failure: rank 3 on n2 (restart 0, from error event): RuntimeError: boom" in lines
    assert st.to_dict()["exit_code"] == "1:0"    # --json keeps Slurm's raw form
    assert view.files_guide(script=True).startswith("rank{R}.out = your script's output")
    assert view.files_guide().startswith("rank{R}.log = the training log: read it first")


def test_short_ids_leave_room_for_more_columns():
    """Slurm's short ids: the same jobs but the local ones keep their shape and whole states,
    and one job keeps its backend too: the table gives way only as far as it must."""
    slurm = [s for s in ten_jobs() if not s.id.startswith("local-")]
    lines = render_table(slurm, 100, HERE).splitlines()
    assert max(map(len, lines)) <= 100 and "NODESxGPUS" in lines[0].split()
    assert "STALLED 00:02:10" in lines[5] and "CANCELLED by 1000" in lines[7] and "e1 s400/800 50%" in lines[1]
    one = render_table(slurm[:1], 100, HERE).splitlines()
    assert one[0].split()[:3] == ["ID", "NAME", "BACKEND"] and one[1].split()[:3] == ["4242", "resnet50", "sbatch"]
    assert one[-1] == "more with --wide: ETA, EVAL, GPU%, LOG DIR, LIMIT, RESTARTS"
