"""A hand-written run for the picture's tests (sparklines, the HTML page): 4 ranks on 2 nodes, a
first run that stages data, steps, checkpoints and stalls 150 s, an in-allocation restart (with
the marks its phases are read from: the supervisor's stopped_at, each rank's rendezvous and
restored events; and a goodput object in goodput's shape), and a second
run in which rank 3 raises and the others lose their peer. Every time is fixed (T0 + seconds),
so what is drawn can be compared with a golden file."""
from __future__ import annotations

import json
from pathlib import Path

T0 = 1_767_000_000.0
JOB = "4242"
HOSTS = {0: "n1", 1: "n1", 2: "n2", 3: "n2"}
FAIL_RANK = 3
RESTART_AT = T0 + 400.0     # the second run's start
ERROR_AT = T0 + 580.0       # rank 3's error
#: the restart's phases as judge.restarts.phases reads them from the marks below: the fault at 340,
#: detected at 342, the old step gone at 345.5, the new processes at 396, init_process_group at
#: 400, up at 401.5, the state restored at 404, the first step at 420 (80 s in all)
PHASES = {"detect": 2.0, "stop": 3.5, "start": 50.5, "import": 4.0, "rendezvous": 1.5, "restore": 2.5,
          "first_step": 16.0}
GOODPUT = {"goodput": 0.71, "wall_s": 600.0, "useful_s": 426.0,
           "lost_s": {"restarts": 80.0, "stalls": 150.0, "checkpoint": 1.5}, "restart_phases": PHASES,
           "steps_redone": 3, "step_s": 0.5, "estimated": []}   # judge.goodput.Goodput.to_dict's shape


def _ev(rank: int, t: float, name: str, restart: int, **kw) -> dict:
    return {"time": T0 + t, "event": name, "rank": rank, "job_id": JOB, "restart": restart,
            "host": HOSTS[rank], **kw}


def rank_events(rank: int, marks: bool = True) -> list[dict]:
    out = [_ev(rank, 0.0, "start", 0, world_size=4, num_nodes=2, local_rank=rank % 2, pid=100 + rank,
               total_steps=800, epochs=1, launcher="slurm", device="cpu")]
    if rank % 2 == 0:   # the node leaders staged the data
        out.append(_ev(rank, 20.0, "stage", 0, node=HOSTS[rank], method="copy", src="/data/train", bytes=10**9,
                       files=1, seconds=18.0, mb_per_s=55.5))
    step = 0
    for i in range(60):   # 2 s apart from t=30; a 150 s stall after the 40th step event
        t = 30.0 + 2.0 * i + (150.0 if i >= 40 else 0.0)
        step += 5
        out.append(_ev(rank, t, "step", 0, epoch=0, step=step, total_steps=800, loss=round(2.0 - 0.02 * i, 4),
                       lr=0.1, samples_per_s=800.0 + 10 * (i % 8), data_s=0.35 if 10 <= i < 15 else 0.01))
        if rank == 0 and i in (19, 49):
            out.append(_ev(rank, t + 0.5, "checkpoint", 0, step=step, path=f"/ckpt/step{step}.pt",
                           blocking_s=0.4, write_s=1.2))
    out.append(_ev(rank, 300.0, "end", 0, status="killed", step=step, exit_code=None, signal="SIGTERM"))
    out.append(_ev(rank, 400.0, "start", 1, world_size=4, num_nodes=2, local_rank=rank % 2, pid=200 + rank,
                   total_steps=800, epochs=1, launcher="slurm", device="cpu"))
    if marks:
        out += [_ev(rank, 401.5, "rendezvous", 1, proc_start=T0 + 396.0, called_at=T0 + 400.0, up_at=T0 + 401.5),
                _ev(rank, 404.0, "restored", 1, step=250, source="file", path="/ckpt/step250.pt", seconds=2.5)]
    for i in range(80):
        out.append(_ev(rank, 420.0 + 2.0 * i, "step", 1, epoch=0, step=300 + 5 * i, total_steps=800,
                       loss=round(0.9 - 0.004 * i, 4), lr=0.1, samples_per_s=850.0 + 5 * (i % 4), data_s=0.01))
    if rank == FAIL_RANK:
        out += [_ev(rank, 580.0, "error", 1, exc_type="ValueError", message="bad batch 4711",
                    traceback="Traceback (most recent call last):\nValueError: bad batch 4711\n"),
                _ev(rank, 580.2, "end", 1, status="failed", step=695, exit_code=1, signal=None)]
    else:
        out += [_ev(rank, 590.0, "error", 1, exc_type="RuntimeError",
                    message="Connection closed by peer [10.0.0.2]:4100"),
                _ev(rank, 590.2, "end", 1, status="failed", step=695, exit_code=1, signal=None)]
    return out


def restart_row(with_phases: bool = True) -> dict:
    row = {"restart": 1, "job_id": JOB, "fault_at": T0 + 340.0, "detected_at": T0 + 342.0, "trigger": "stall",
           "why": "no step for 150 s", "kind": "stuck", "rank": 2, "node": "n2", "basis": "step events",
           "excluded": [], "nodes_before": ["n1", "n2"], "nodes_after": ["n1", "n2"], "world_before": 4,
           "world_after": 4}
    return {**row, "stopped_at": T0 + 345.5} if with_phases else row


def write_run(log_dir: Path, phases: bool = True) -> Path:
    """The run's files in ``log_dir``: every rank's events and ``rank{R}.out``, restarts.jsonl."""
    log_dir.mkdir(parents=True, exist_ok=True)
    for r in HOSTS:
        (log_dir / f"rank{r}.events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in rank_events(r, phases)))
        (log_dir / f"rank{r}.out").write_text("ValueError: bad batch 4711\n" if r == FAIL_RANK else "")
    (log_dir / "restarts.jsonl").write_text(json.dumps(restart_row(phases)) + "\n")
    return log_dir
