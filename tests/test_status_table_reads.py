"""What the job table reads of many jobs and how it keeps what it saw (the cold view of
``status --limit 0``): the other ranks' event files only at their endings (a running job's
widened for its stall), the newest run summed up alone, the row cache one row per line, and the
final states of every ended job written in one batch.

Logs are written as the ranks write them; the scheduler answers like Slurm's squeue/sacct
(tests/test_status_timing.py's stand-in), ``now`` is injected.
"""
import json
import os
import time

import pytest

from ddp_hpc import fsutil, records
from ddp_hpc.judge import kept
from ddp_hpc.judge.reader import RunLogs
from ddp_hpc.status import rowcache
from ddp_hpc.status.collect import collect
from ddp_hpc.status.targets import StatusTarget, recent_targets

T0 = 1_800_000_000.0


def ev(rank, name, t, restart=0, **extra):
    return {"time": T0 + t, "event": name, "rank": rank, "job_id": "88", "restart": restart, "host": "n1",
            **extra}


def write(d, rank, events):
    d.mkdir(parents=True, exist_ok=True)
    with open(d / f"rank{rank}.events.jsonl", "a") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)


def failed_run(d, ranks=3, n_steps=60):
    """Two runs; in the second every rank stepped ``n_steps`` times, then rank 2 raised and the
    others lost it."""
    for r in range(ranks):
        run0 = [ev(r, "start", 0, world_size=ranks, total_steps=1000, device="cpu")]
        run0 += [ev(r, "step", s, step=s, loss=1.0, total_steps=1000) for s in range(1, 6)]
        run0 += [ev(r, "end", 7, status="preempted", step=5)]
        run1 = [ev(r, "start", 100, 1, world_size=ranks, total_steps=1000, device="cpu")]
        run1 += [ev(r, "step", 100 + s, 1, step=5 + s, loss=0.5, total_steps=1000) for s in range(1, n_steps + 1)]
        msg = "ValueError: bad batch" if r == 2 else "Connection closed by peer"
        run1 += [ev(r, "error", 200 + r, 1, exc_type="RuntimeError", message=msg),
                 ev(r, "end", 201 + r, 1, status="failed", exit_code=1)]
        write(d, r, run0 + run1)


def test_the_table_reads_the_other_ranks_endings_and_judges_the_same(tmp_path):
    failed_run(tmp_path)
    full, ends = RunLogs(tmp_path), RunLogs(tmp_path, ends_only=True)
    # rank 0's newest run whole and its earlier start events; the others from their newest step
    # on (not the first KiB and last 24 lines)
    assert ends.ranks[0].events == full.ranks[0].events[:1] + full.ranks[0].of_restart(1)
    assert [e["event"] for e in ends.ranks[1].events] == ["step", "error", "end"]
    assert ends.ranks[1].events[0]["step"] == 65 and ends.ranks[2].skipped > 0
    assert ends.outcome() == full.outcome() == "failed"
    assert ends.last_events() == full.last_events()
    assert ends.current_restart() == full.current_restart() == 1
    assert ends.progress() == full.progress() and ends.device() == full.device() == "cpu"
    assert ends.current_run() == full.runs()[-1] == full.current_run()
    assert [r.restart for r in full.runs()] == [0, 1]
    ends.widen()   # a running job: read as the read budget allows, as before
    assert len(ends.ranks[1].events) > 20 and not ends.ends_only
    assert ends.ranks[0].events == full.ranks[0].events


def test_a_ranks_ending_is_read_back_to_its_newest_step_at_most_END_LINES(tmp_path):
    from ddp_hpc.judge import tails
    events = [ev(1, "step", s, step=s) for s in range(1, 4)]
    events += [ev(1, "stack", 10 + i, stack="x" * 3000) for i in range(tails.END_LINES + 3)]
    write(tmp_path, 1, events)
    with open(tmp_path / "rank1.events.jsonl", "a") as f:
        f.write('{"time": 1, "event": "en')   # the writer mid-line
    got = tails.read_events(tmp_path / "rank1.events.jsonl", ends=True)
    assert [e["event"] for e in got.events] == ["stack"] * (tails.END_LINES - 1) and got.bad_lines == 1


def test_events_since_an_offset_are_only_those_appended_after_it(tmp_path, monkeypatch):
    from ddp_hpc.judge import tails
    write(tmp_path, 0, [ev(0, "step", s, step=s) for s in range(1, 4)])
    p = tmp_path / "rank0.events.jsonl"
    offset = p.stat().st_size
    assert tails.read_events(p, since=offset).events == []
    with open(p, "a") as f:
        f.write("\n".join(json.dumps(ev(0, "step", s, step=s)) for s in range(4, 30)) + '\n{"event": "st')
    got = tails.read_events(p, since=offset)
    assert [e["step"] for e in got.events] == list(range(4, 30)) and got.bad_lines == 1
    monkeypatch.setattr(tails, "TAIL_MAX_BYTES", 1000)   # more than that appended: its end, whole lines
    got = tails.read_events(p, since=offset)
    assert [e["step"] for e in got.events] == list(range(30 - len(got.events), 30)) and got.bad_lines == 1
    assert 4 < len(got.events) < 26


class Squeue:
    """squeue lists job 88 RUNNING (rows as SlurmCLI returns them)."""

    def cluster_name(self):
        return "test"

    def squeue(self, job_ids=None, **kw):
        return [{"JobID": "88", "JobArrayID": "88", "State": "RUNNING", "Reason": "None", "TimeUsed": "5:00",
                 "TimeLimit": "1:00:00", "NumNodes": "1", "RestartCnt": "0", "NodeList": "n1", "Name": "demo"}]

    def sacct(self, job_ids, **kw):
        return []


def test_a_running_jobs_row_judges_a_slow_rank_by_its_own_steps(tmp_path):
    """Rank 1 steps every 30 s and was last heard 100 s ago: within 10 x its own interval, so not
    stalled; from its ending alone (one step, no interval) the others' 1 s would call it so."""
    write(tmp_path, 0, [ev(0, "start", 0, world_size=2)] + [ev(0, "step", s, step=s) for s in range(1, 400)])
    write(tmp_path, 1, [ev(1, "start", 0, world_size=2)] + [ev(1, "step", s, step=s // 30)
                                                             for s in range(30, 330, 30)])
    target = StatusTarget("88", None, str(tmp_path))
    table = collect([target], Squeue(), now=T0 + 400, brief=True)[0]
    detail = collect([target], Squeue(), now=T0 + 400)[0]
    assert table.state == detail.state == "RUNNING"
    assert table.stall is None and detail.stall is None


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_HPC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def record(job_id, log_dir, final=None):
    rec = records.JobRecord(id=job_id, cluster="c1", name="train", backend="sbatch", nodes=1, gpus_per_node=1,
                            time_limit="01:00:00", log_dir=str(log_dir), config=None, overrides=[],
                            submitted_at=time.time(), cwd="/", command=["python", "t.py"], final=final)
    records.write_record(rec)
    return rec


def test_the_row_cache_is_one_json_document_one_row_per_line(home, tmp_path):
    for i in range(3):
        failed_run(tmp_path / f"j{i}", ranks=2, n_steps=3)
        record(str(700 + i), tmp_path / f"j{i}")
    first = [s.to_dict() for s in collect(recent_targets(0), brief=True)]
    path = rowcache.cache_path()
    lines = path.read_text().splitlines()
    assert len(lines) == 3 + 2 and set(json.loads(path.read_text())["rows"]) == {"700", "701", "702"}
    # a damaged row costs that row only; the others are taken as kept and written back as read
    kept = {ln.rstrip(",") for ln in lines if '"701"' not in ln}
    path.write_text("\n".join(ln if '"701"' not in ln else ln[:40] for ln in lines) + "\n")
    assert set(rowcache.load().rows) == {"700", "702"}
    again = [s.to_dict() for s in collect(recent_targets(0), brief=True)]
    assert again == first
    assert kept <= {ln.rstrip(",") for ln in path.read_text().splitlines()}
    assert len(json.loads(path.read_text())["rows"]) == 3


def test_the_final_states_of_many_jobs_are_written_in_one_batch(home, tmp_path, monkeypatch):
    recs = [record(str(900 + i), tmp_path / f"d{i}") for i in range(20)]
    same = {"state": "COMPLETED", "state_name": "COMPLETED", "seen_at": 1.0}
    kept = record("999", tmp_path / "d", final=same)
    before = os.stat(kept.path).st_ino
    other = json.loads(open(recs[3].path).read())   # another process adds pids since they were read
    open(recs[3].path, "w").write(json.dumps(dict(other, pids=[4242])))
    synced = []
    real = fsutil._fsync_file
    monkeypatch.setattr(fsutil, "_fsync_file", lambda p: synced.append(p) or real(p))
    batch = [(r, {None: {"state": "FAILED", "state_name": "FAILED", "seen_at": 2.0}}) for r in recs]
    assert records.store_finals(batch + [(kept, {None: dict(same, seen_at=5.0)})]) == 20
    assert len(synced) == 20                       # the unchanged record is not rewritten
    assert os.stat(kept.path).st_ino == before
    assert all(records.load_record(r.id).final["state"] == "FAILED" for r in recs)
    assert records.load_record(recs[3].id).pids == [4242]
    assert not [p for p in os.listdir(records.records_dir()) if p.endswith(".tmp")]


def test_a_batch_that_cannot_be_written_leaves_every_file_as_it_was(tmp_path):
    a = tmp_path / "a.json"
    a.write_text("old\n")
    with pytest.raises(OSError):
        fsutil.atomic_write_texts([(a, "new\n"), (tmp_path / "missing" / "b.json", "new\n")])
    assert a.read_text() == "old\n" and os.listdir(tmp_path) == ["a.json"]


class Sacct:
    """squeue knows no job; sacct says every job asked for ended ``state``."""

    def __init__(self, state="FAILED"):
        self.state = state

    def cluster_name(self):
        return "c1"

    def squeue(self, job_ids=None, **kw):
        return []

    def sacct(self, job_ids, **kw):
        return [{"JobID": j, "JobIDRaw": j, "State": self.state, "ExitCode": "1:0", "Elapsed": "00:03:21",
                 "Timelimit": "01:00:00", "NNodes": "1", "NodeList": "n1", "JobName": "train"} for j in job_ids]


def rows(cli=None):
    """The table's rows (``status --limit 0``) as plain data, without the row cache."""
    if rowcache.cache_path().exists():
        rowcache.cache_path().unlink()
    return {s.id: s.to_dict() for s in collect(recent_targets(0), cli, brief=True)}


def test_an_ended_jobs_row_comes_from_what_its_record_keeps_of_its_logs(home, tmp_path):
    """The first table that sees a job end keeps the row's facts of its logs in its final state;
    later tables (a new row cache) show the same row without reading the logs, also after the log
    directory is gone, and read them again when they changed or the record has no such facts."""
    for i in range(2):
        failed_run(tmp_path / f"j{i}", ranks=3, n_steps=4)
        record(str(800 + i), tmp_path / f"j{i}")
    first = rows(Sacct())
    assert first["800"]["progress"]["step"] == 9 and first["800"]["device"] == "cpu"
    final = records.load_record("800").final
    assert final["state"] == "FAILED" and final["logs"]["outcome"] == "failed"
    assert kept.kept_logs(final["logs"], tmp_path / "j0") is not None
    assert rows(Sacct()) == first              # from the summary: the same row
    later = rows()                              # no scheduler: the state from the record too
    assert later == {k: dict(v, source="record", tried=later[k]["tried"]) for k, v in first.items()}
    for r in range(3):                          # the logs gone: the kept facts still tell the row
        (tmp_path / "j0" / f"rank{r}.events.jsonl").unlink()
    os.rmdir(tmp_path / "j0")
    gone = rows()["800"]
    assert (gone["state"], gone["progress"], gone["device"]) == ("FAILED", first["800"]["progress"], "cpu")
    # a record without the facts (an older ddp_hpc) reads the logs; so does one whose logs changed
    rec = records.load_record("801")
    rec.final = {k: v for k, v in rec.final.items() if k != "logs"}
    records.update_record(rec)
    assert rows()["801"]["progress"] == first["801"]["progress"]
    write(tmp_path / "j1", 0, [ev(0, "step", 300, 1, step=77, loss=0.25, total_steps=1000)])
    assert rows(Sacct())["801"]["progress"]["step"] == 77


def test_a_node_range_jobs_row_from_the_kept_facts_shows_the_nodes_its_run_got(home, tmp_path):
    for r in range(2):
        write(tmp_path / "j", r, [ev(r, "start", 0, world_size=2, num_nodes=3), ev(r, "end", 5, status="completed")])
    rec = record("810", tmp_path / "j")
    rec.nodes, rec.min_nodes = 4, 2
    records.update_record(rec)
    first = rows(Sacct("COMPLETED"))["810"]
    assert records.load_record("810").final["logs"]["num_nodes"] == 3
    assert rows(Sacct("COMPLETED"))["810"] == first and (first["nodes"], first["node_range"]) == (3, "2-4")


def test_kept_facts_answer_as_the_table_reads_the_logs(tmp_path):
    failed_run(tmp_path)
    (tmp_path / "slurm-88.out").write_text("srun: error: n1: task 2: Exited with exit code 7\n")
    logs = RunLogs(tmp_path, ends_only=True)
    got = kept.kept_logs(kept.summarize(logs), tmp_path)
    assert (got.outcome(), got.current_run(), got.progress(), got.device(), got.current_restart()) == (
        logs.outcome(), logs.current_run(), logs.progress(), logs.device(), logs.current_restart())
    # srun's codes: kept when read (a job that did not complete), else read when asked
    assert got.srun_exit_codes() == logs.srun_exit_codes() == {2: 7}
    assert kept.summarize(logs, {2: 7})["srun_codes"] == {"2": 7} and kept.summarize(logs)["srun_codes"] is None
    assert kept.summarize(RunLogs(tmp_path)) is None   # a detail view's reading is not kept
    assert kept.kept_logs(dict(kept.summarize(logs), v=0), tmp_path) is None


def test_kept_facts_are_read_again_when_another_ranks_event_file_changes(home, tmp_path):
    """The facts come from every rank's ending: a late write by rank 2 (its file grew, the
    directory did not change) makes them stale, and the table reads the logs again."""
    failed_run(tmp_path / "j", ranks=3, n_steps=4)
    record("820", tmp_path / "j")
    first = rows(Sacct())["820"]
    summary = records.load_record("820").final["logs"]
    assert kept.kept_logs(summary, tmp_path / "j") is not None
    dir_mtime = os.stat(tmp_path / "j").st_mtime_ns
    with open(tmp_path / "j" / "rank2.events.jsonl", "a") as f:   # rank 2's end, late
        f.write(json.dumps(ev(2, "end", 210, 1, status="killed", signal="SIGKILL")) + "\n")
    assert os.stat(tmp_path / "j").st_mtime_ns == dir_mtime        # only the file changed
    assert kept.kept_logs(summary, tmp_path / "j") is None
    again = rows(Sacct())["820"]
    assert again["state"] == first["state"] == "FAILED"
    assert records.load_record("820").final["logs"]["end_signals"] == {"2": "SIGKILL"}   # re-read, kept


def completed_run(d, ranks=3):
    """Every rank stepped to 100 and ended completed; rank 0 evaluated; the other ranks' files
    end in a damaged line."""
    for r in range(ranks):
        evs = [ev(r, "start", 0, world_size=ranks, total_steps=100, device="cpu")]
        evs += [ev(r, "step", s, step=s * 10, loss=1.0 / s, total_steps=100) for s in range(1, 11)]
        evs += [ev(0, "eval", 11, step=100, metrics={"acc": 0.9})] if r == 0 else []
        write(d, r, evs + [ev(r, "end", 12, status="completed", step=100)])
        with open(d / f"rank{r}.events.jsonl", "a") as f:
            f.write("" if r == 0 else "not an event\n")


def test_a_completed_jobs_row_reads_rank_0s_events_alone(home, tmp_path):
    """The scheduler (or the final state the record keeps) says the job completed: its row comes
    from rank 0's events (progress, eval, device) and the other ranks' files are not read (their
    damaged lines are not seen); a job that did not complete reads every rank's ending."""
    for name in ("j0", "j1", "j2"):
        completed_run(tmp_path / name)
    record("820", tmp_path / "j0")
    row = rows(Sacct("COMPLETED"))["820"]
    assert (row["state"], row["progress"]["step"], row["progress"]["percent"], row["device"]) == (
        "COMPLETED", 100, 100.0, "cpu")
    assert row["eval_metrics"] == {"acc": 0.9} and not [n for n in row["notes"] if "unreadable" in n]
    facts = records.load_record("820").final["logs"]
    assert facts["rank0_only"] is True and facts["bad_lines"] == {"0": 0}
    record("821", tmp_path / "j1", final={"state": "COMPLETED", "state_name": "COMPLETED", "seen_at": 1.0,
                                           "elapsed": "00:00:12"})   # an older record: no facts kept
    assert not [n for n in rows()["821"]["notes"] if "unreadable" in n]
    record("822", tmp_path / "j2")
    failed = rows(Sacct("FAILED"))["822"]
    assert "2 unreadable lines in the event streams skipped" in failed["notes"]
    assert records.load_record("822").final["logs"]["rank0_only"] is False


def test_rank_0s_earlier_runs_are_decoded_only_where_the_newest_run_cannot_tell(tmp_path):
    """The table decodes rank 0's newest run and its earlier start and eval events; its whole
    file where the newest run has no step with total_steps, or another rank ran a newer run."""
    write(tmp_path / "a", 0, [ev(0, "start", 0, world_size=1), ev(0, "step", 1, step=1, total_steps=9),
                              ev(0, "eval", 2, metrics={"acc": 0.5}), ev(0, "start", 5, 1, world_size=1),
                              ev(0, "step", 6, 1, step=2, total_steps=9)])
    got = RunLogs(tmp_path / "a", ends_only=True)
    assert [e["event"] for e in got.ranks[0].events] == ["start", "eval", "start", "step"]
    assert got.last_eval()["metrics"] == {"acc": 0.5} and got.progress() == RunLogs(tmp_path / "a").progress()
    write(tmp_path / "b", 0, [ev(0, "start", 0), ev(0, "step", 1, step=1, total_steps=9), ev(0, "start", 5, 1)])
    assert len(RunLogs(tmp_path / "b", ends_only=True).ranks[0].events) == 3   # no total_steps since
    write(tmp_path / "c", 0, [ev(0, "start", 0), ev(0, "step", 1, step=1, total_steps=9)])
    write(tmp_path / "c", 0, [ev(0, "start", 5, 1), ev(0, "step", 6, 1, step=2, total_steps=9)])
    write(tmp_path / "c", 1, [ev(1, "start", 9, 2)])
    assert len(RunLogs(tmp_path / "c", ends_only=True).ranks[0].events) == 4   # rank 1's run 2
