"""Events per node (``runlogs.nodelog``): real processes of one node hand their lines to one
forwarder, which appends them in few writes; the evidence of a failure reaches the file before the
process that wrote it dies, whoever else dies with it; a forwarder that is gone is replaced; the
readers (status, the supervisor's tail, the kept facts) read the per-node layout and the per-rank
one of earlier versions."""

import json
import multiprocessing as mp
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from ddp_hpc.judge import kept
from ddp_hpc.judge.nodefiles import log_events, rank_events, read_node_events
from ddp_hpc.judge.reader import RunLogs
from ddp_hpc.runlogs import nodelog
from ddp_hpc.runlogs.nodelog import NodeLog
from ddp_hpc.runlogs.writer import RunLog
from ddp_hpc.supervise.watch import EventTail

CTX = mp.get_context("spawn")
LINES = 60


def _writer(path: str, rank: int, n: int, go, appends=None) -> None:
    """A rank's process: ``n`` step lines, one per 0.05 s, then its end (urgent); the appends it
    made itself go to ``appends``."""
    log = NodeLog(path)
    go.wait(30)
    for i in range(n):
        log.write(json.dumps({"time": time.time(), "event": "step", "rank": rank, "step": i}) + "\n")
        time.sleep(0.05)
    log.write(json.dumps({"time": time.time(), "event": "end", "rank": rank, "status": "completed"}) + "\n",
              urgent=True)
    if appends is not None:
        appends.put(log.appends)
    log.close()


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_three_ranks_of_a_node_reach_one_file_in_a_few_appends(tmp_path):
    """This process is the node's forwarder (it writes first); three rank processes send their 60
    step lines each: every line arrives once, whole, and the forwarder appended them in about one
    write per second, not one per line."""
    path = tmp_path / "node0.events.jsonl"
    fwd = NodeLog(str(path))
    assert fwd.forwarder
    go, appends = CTX.Event(), CTX.Queue()
    procs = [CTX.Process(target=_writer, args=(str(path), r, LINES, go, appends)) for r in (1, 2, 3)]
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join(60)
    fwd.close()
    evs = _events(path)
    steps = {r: [e["step"] for e in evs if e["rank"] == r and e["event"] == "step"] for r in (1, 2, 3)}
    assert all(sorted(s) == list(range(LINES)) for s in steps.values()), steps
    assert sum(e["event"] == "end" for e in evs) == 3
    # 180 step lines over 3 s: each rank's end appended by the rank itself, the rest by the
    # forwarder, once a second and at each writer's close (about 10 appends). A writer appends a
    # line itself also when the forwarder's queue is full (Linux queues 10 datagrams by default:
    # a forwarder held up by a loaded machine); a third of the lines is the bound
    theirs = [appends.get(timeout=10) for _ in procs]
    assert all(n >= 1 for n in theirs) and sum(theirs) + fwd.appends <= 60, (theirs, fwd.appends)


def _urgent_then_die(path: str, go) -> None:
    log = NodeLog(path)
    go.wait(30)
    log.write(json.dumps({"time": time.time(), "event": "step", "rank": 1, "step": 7}) + "\n")
    log.write(json.dumps({"time": time.time(), "event": "error", "rank": 1, "exc_type": "RuntimeError",
                          "message": "boom"}) + "\n", urgent=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _forward_forever(path: str, ready) -> None:
    log = NodeLog(path)
    ready.set() if log.forwarder else None
    time.sleep(600)


def test_a_ranks_error_reaches_the_file_though_the_whole_node_is_killed(tmp_path):
    """The node's forwarder (another process) and the rank are killed right after the rank wrote
    its error: the error is in the file; the step line the forwarder held (under a second old) may
    be lost with it, the evidence is not."""
    path = tmp_path / "node0.events.jsonl"
    ready, go = CTX.Event(), CTX.Event()
    fwd = CTX.Process(target=_forward_forever, args=(str(path), ready))
    fwd.start()
    assert ready.wait(60)
    rank = CTX.Process(target=_urgent_then_die, args=(str(path), go))
    rank.start()
    go.set()
    rank.join(60)
    os.kill(fwd.pid, signal.SIGKILL)
    fwd.join(10)
    assert rank.exitcode == -signal.SIGKILL
    errors = [e for e in _events(path) if e["event"] == "error"]
    assert errors and errors[0]["message"] == "boom"


def test_a_writer_takes_the_place_of_a_forwarder_that_is_gone(tmp_path):
    """The forwarder is killed: the next line of a writer finds no one there, and that writer
    forwards from then on; nothing it writes afterwards is lost."""
    path = tmp_path / "node0.events.jsonl"
    ready = CTX.Event()
    fwd = CTX.Process(target=_forward_forever, args=(str(path), ready))
    fwd.start()
    assert ready.wait(60)
    me = NodeLog(str(path))
    assert not me.forwarder
    os.kill(fwd.pid, signal.SIGKILL)
    fwd.join(10)
    for i in range(5):
        me.write(json.dumps({"time": time.time(), "event": "step", "rank": 0, "step": i}) + "\n")
    assert me.forwarder
    me.close()
    assert [e["step"] for e in _events(path)] == list(range(5))


def test_a_writer_flush_waits_until_the_forwarder_appended(tmp_path):
    """A writer's line sits with the forwarder (under a second); a flush with ``wait`` returns once
    the forwarder appended it (what the script wrapper does before it reads the rank's last step)."""
    path = tmp_path / "node0.events.jsonl"
    fwd = NodeLog(str(path))
    try:
        other = NodeLog(str(path))
        other.write('{"time": 1, "event": "step", "rank": 1, "step": 1}\n')
        assert path.read_text() == ""
        assert other.flush(wait=True) and _events(path)[0]["step"] == 1
        other.close()
    finally:
        fwd.close()


def test_run_logs_of_two_nodes_read_by_rank(tmp_path, monkeypatch):
    """RunLog of 4 ranks on 2 nodes (the launcher's GROUP_RANK): two node files; status reads
    each rank's events from them, the failing rank's urgent error is there though its steps were
    batched, and a rank's events come in time order."""
    for r in range(4):     # each rank's variables as a torchrun-style launcher sets them
        for k, v in {"RANK": r, "WORLD_SIZE": 4, "LOCAL_RANK": r % 2, "LOCAL_WORLD_SIZE": 2, "GROUP_RANK": r // 2,
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500}.items():
            monkeypatch.setenv(k, str(v))
        log = RunLog(tmp_path, r, job_id="7", console=False)
        log.event("start", world_size=4, num_nodes=2, local_rank=r % 2)
        log.event("step", step=1, total_steps=10)
        if r == 3:
            log.event("error", exc_type="ValueError", message="bad batch", traceback=None)
        log.event("end", status="failed" if r == 3 else "completed", step=1)
        log.close()
    from ddp_hpc.runlogs.nodelog import close_all
    close_all()
    assert sorted(n for n in os.listdir(tmp_path) if "events" in n and "tfevents" not in n) == [
        "node0.events.jsonl", "node1.events.jsonl"]
    streams = log_events(tmp_path)
    assert sorted(streams) == [0, 1, 2, 3]
    assert [e["event"] for e in streams[3].events] == ["start", "step", "error", "end"]
    assert rank_events(tmp_path, 0).events[0]["event"] == "start"
    f = RunLogs(tmp_path).first_failure(assume_failed=True)
    assert f is not None and f.rank == 3 and "bad batch" in f.summary


def test_a_node_file_read_for_the_table_gives_each_ranks_ending(tmp_path):
    """The job table reads of a big node file only its end: each rank's events back to its
    newest step; node 0's file whole (rank 0's progress). The kept facts' stamp names the node
    files read."""
    def line(rank, t, event, **kw):
        return json.dumps({"time": t, "event": event, "rank": rank, "job_id": "9", "restart": 0, "host": "n",
                           **kw}) + "\n"
    for node in (0, 1):
        ranks = (2 * node, 2 * node + 1)
        text = "".join(line(r, 0.0, "start", world_size=4, num_nodes=2, total_steps=500) for r in ranks)
        text += "".join(line(r, 1.0 + s, "step", step=s, total_steps=500, loss=1.0) for s in range(1, 400)
                        for r in ranks)
        text += "".join(line(r, 500.0, "end", status="completed", step=399) for r in ranks)
        (tmp_path / f"node{node}.events.jsonl").write_text(text)
    logs = RunLogs(tmp_path, ends_only=True)
    assert [e["event"] for e in logs.ranks[3].events] == ["step", "end"]
    assert len(logs.ranks[0].events) == 401 and logs.ranks[1].events[-1]["event"] == "end"
    assert logs.outcome() == "completed"
    summary = kept.summarize(logs)
    assert [f[0] for f in summary["stamp"][1]] == ["node0.events.jsonl", "node1.events.jsonl"]
    assert kept.kept_logs(summary, tmp_path) is not None
    with open(tmp_path / "node1.events.jsonl", "a") as f:      # a late line: the kept facts no longer hold
        f.write(line(3, 501.0, "stack", stack="x"))
    assert kept.kept_logs(summary, tmp_path) is None
    whole = read_node_events(tmp_path / "node1.events.jsonl")
    assert len(whole[2].events) == 401 and len(whole[3].events) == 402


def test_the_supervisors_idle_poll_opens_no_file(tmp_path, monkeypatch):
    """Once read, an event file that did not grow is only stat'ed: an idle poll opens nothing;
    a line appended to one node file is read from that file alone, and a new file is found."""
    (tmp_path / "node0.events.jsonl").write_text('{"event": "step", "rank": 0, "restart": 0, "step": 1}\n')
    (tmp_path / "rank5.events.jsonl").write_text('{"event": "step", "rank": 5, "restart": 0, "step": 1}\n')
    tail = EventTail(tmp_path, 0)
    assert sorted(e["rank"] for e in tail.poll()) == [0, 5]
    opened = []
    real_open = open

    def counting_open(path, *a, **kw):
        opened.append(os.path.basename(str(path)))
        return real_open(path, *a, **kw)
    monkeypatch.setattr("builtins.open", counting_open)
    assert tail.poll() == [] and opened == []
    with real_open(tmp_path / "node0.events.jsonl", "a") as f:
        f.write('{"event": "step", "rank": 1, "restart": 0, "step": 2}\n')
    assert [e["rank"] for e in tail.poll()] == [1] and opened == ["node0.events.jsonl"]
    time.sleep(0.01)
    (tmp_path / "node1.events.jsonl").write_text('{"event": "step", "rank": 2, "restart": 0, "step": 2}\n')
    assert [e["rank"] for e in tail.poll()] == [2]


@pytest.mark.parametrize("flush", [False, True])
def test_a_late_line_after_close_is_appended_directly(tmp_path, flush):
    path = tmp_path / "node0.events.jsonl"
    log = NodeLog(str(path))
    log.write('{"event": "step", "rank": 0, "step": 1}\n')
    if flush:
        log.flush()
    log.close()
    log.write('{"event": "end", "rank": 0}\n')
    assert [e["event"] for e in _events(path)] == ["step", "end"]


def test_a_forwarders_close_ends_its_thread_without_waiting_out_the_read_timeout(tmp_path, monkeypatch):
    """A forwarder's thread reads with a timeout (`FLUSH_S`); a shut-down datagram socket polls
    readable while a read of it says EAGAIN, which such a read retried until the timeout ended: every
    forwarding rank spun a core for that long at its exit, and its close waited as long. Here the
    timeout is a minute: close and the thread's end must not wait for it."""
    monkeypatch.setattr(nodelog, "FLUSH_S", 60.0)
    path = tmp_path / "node0.events.jsonl"
    log = NodeLog(str(path))
    assert log.forwarder
    log.write('{"event": "step", "rank": 0, "step": 1}\n')
    thread = next(t for t in threading.enumerate() if t.name == "ddp_hpc-node-events")
    closer = threading.Thread(target=log.close)
    closer.start()
    closer.join(20)
    thread.join(20)
    assert not closer.is_alive() and not thread.is_alive(), "close waited out the forwarder's 60 s read timeout"
    assert [e["step"] for e in _events(path)] == [1]


def test_a_ranks_events_are_found_in_whichever_node_file_holds_them(tmp_path):
    """Rank 0 runs on a job's first node under every launcher, but a task layout of the user's own
    (srun --distribution=arbitrary) can put it elsewhere: it is looked for in the other files."""
    (tmp_path / "node0.events.jsonl").write_text('{"time": 1, "event": "start", "rank": 5}\n')
    (tmp_path / "node1.events.jsonl").write_text('{"time": 1, "event": "start", "rank": 0}\n'
                                                 '{"time": 2, "event": "end", "rank": 0}\n')
    assert [e["event"] for e in rank_events(tmp_path, 0).events] == ["start", "end"]
    assert [e["rank"] for e in rank_events(tmp_path, 5).events] == [5]
    assert rank_events(tmp_path, 9).events == []


def test_a_flush_asked_of_a_closing_forwarder_is_answered(tmp_path):
    """A writer waits for the forwarder's answer to its flush (the script wrapper, at its rank's
    end); a forwarder that closes with that request still queued appends and answers it, so the
    writer is not held up."""
    path = tmp_path / "node0.events.jsonl"
    fwd = NodeLog(str(path))
    other = NodeLog(str(path))
    other.write('{"time": 1, "event": "step", "rank": 1, "step": 1}\n')
    other._client.sendto(b"\0flush", other._addr)     # as flush(wait=True) asks, then the close
    fwd.close()
    other._client.settimeout(5)
    assert other._client.recv(64) == b"\0flushed"
    assert _events(path)[0]["step"] == 1
    other.close()


def test_the_training_cores_run_log_begins_with_its_start(tmp_path):
    """The training core's set-up may write before its start event (the sweep of snapshots ended
    jobs left, from a thread): those events follow the start, at their time then; an error
    before any start lets them go at once."""
    log = RunLog(tmp_path, 0, job_id="5", console=False, node=0, start_first=True)
    log.event("memsnap", status="swept", why="freed 1 folder", step=None)
    log.event("start", world_size=1)
    log.event("step", step=1)
    early = RunLog(tmp_path / "early", 0, job_id="6", console=False, node=0, start_first=True)
    early.event("memsnap", status="swept", why="freed 2 folders", step=None)
    early.event("error", exc_type="ValueError", message="bad config")
    from ddp_hpc.runlogs.nodelog import close_all
    close_all()
    evs = rank_events(tmp_path, 0).events
    assert [e["event"] for e in evs] == ["start", "memsnap", "step"] and evs[0]["time"] <= evs[1]["time"]
    assert [e["event"] for e in rank_events(tmp_path / "early", 0).events] == ["error", "memsnap"]
