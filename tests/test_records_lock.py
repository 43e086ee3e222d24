"""Job records written by several processes at once (the local driver, ``ddp-hpc cancel``,
``ddp-hpc status``, the supervisor): each rewrite is made under the record's lock, from what its
file holds then, so no writer loses another's fields. Real processes, real files."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from ddp_hpc import records


def _record(tmp_path: Path) -> tuple[dict, Path]:
    env = {"DDP_HPC_HOME": str(tmp_path / "home")}
    rec = records.JobRecord(id="local-x-1", cluster="c", name="x", backend="local", nodes=1, gpus_per_node=2,
                            time_limit=None, log_dir=str(tmp_path), config=None, overrides=[],
                            submitted_at=1.0, cwd=str(tmp_path))
    return env, records.write_record(rec, env)


def _final(code: int) -> dict:
    return records.local_final("CANCELLED", 1.0, 2.0 + code, "test", exit_code=str(code))


def test_a_record_read_before_another_process_wrote_keeps_what_that_one_wrote(tmp_path):
    """The local driver read the record, then `ddp-hpc cancel` stored the final state, then the
    driver writes its pids: the final state stays."""
    env, path = _record(tmp_path)
    driver = records.load_record("local-x-1", environ=env)
    cancel = ("import sys; from ddp_hpc import records; env = {'DDP_HPC_HOME': sys.argv[1]}; "
              "rec = records.load_record('local-x-1', environ=env); "
              "records.store_final(rec, {None: records.local_final('CANCELLED', 1.0, 5.0, 'cancel')}, env); "
              "rec = records.load_record('local-x-1', environ=env); rec.pids = []; records.update_record(rec, env)")
    subprocess.run([sys.executable, "-c", cancel, env["DDP_HPC_HOME"]], check=True, timeout=60)
    driver.pids, driver.pid_times = [11, 12], [1.0, 1.0]
    records.update_record(driver, env)
    got = json.loads(path.read_text())
    assert got["final"]["state"] == "CANCELLED" and got["final"]["source"] == "cancel", got
    assert got["pids"] == [11, 12] and driver.final == got["final"]      # the caller's copy is current
    assert not list(path.parent.glob(".*lock"))                          # no lock file is left behind


WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from ddp_hpc import records
    env, what, n, go = {"DDP_HPC_HOME": sys.argv[1]}, sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    while not go.exists():
        time.sleep(0.001)
    for i in range(n):
        rec = records.load_record("local-x-1", environ=env)
        if what == "pids":          # the local driver
            rec.pids = [i]
            records.update_record(rec, env)
        elif what == "final":       # cancel and status
            records.store_final(rec, {None: records.local_final("CANCELLED", 1.0, 2.0 + i, "t", exit_code=str(i))},
                                env)
        else:                       # the supervisor: appends a restart
            rec.alloc_restarts.append({"i": i})
            records.update_record(rec, env)
""")


def test_concurrent_writers_lose_no_update(tmp_path):
    env, path = _record(tmp_path)
    rec = records.load_record("local-x-1", environ=env)
    rec.alloc_restarts = []
    records.update_record(rec, env)
    n, go = 150, tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, env["DDP_HPC_HOME"], what, str(n), str(go)])
             for what in ("pids", "final", "restarts")]
    go.touch()
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0]
    got = json.loads(path.read_text())
    assert got["pids"] == [n - 1] and got["final"]["exit_code"] == str(n - 1), got
    assert [r["i"] for r in got["alloc_restarts"]] == list(range(n)), got
    assert not list(path.parent.glob(".*lock"))


def test_store_finals_of_many_records_keeps_later_writes_and_locks_a_record_given_twice_once(tmp_path):
    """A record given twice is locked once (flock is not reentrant: twice would wait on itself)."""
    env, path = _record(tmp_path)
    other = records.JobRecord.from_dict({**json.loads(path.read_text()), "id": "local-y-2"})
    other_path = records.write_record(other, env)
    stale = [records.load_record(i, environ=env) for i in ("local-x-1", "local-y-2")]
    for rid in ("local-x-1", "local-y-2"):      # pids written after the batch's records were read
        fresh = records.load_record(rid, environ=env)
        fresh.pids = [7]
        records.update_record(fresh, env)
    assert records.store_finals([(r, {None: _final(3)}) for r in stale] + [(stale[0], {None: _final(3)})]) == 2
    for p in (path, other_path):
        got = json.loads(p.read_text())
        assert got["pids"] == [7] and got["final"]["exit_code"] == "3", got


APPENDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from ddp_hpc.supervise.loop import _to_record
    task, n, go = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    while not go.exists():
        time.sleep(0.001)
    for i in range(n):
        _to_record(f"local-x-1_{task}", {"task": task, "i": i})
""")


def test_supervisors_of_two_array_tasks_restarting_at_once_keep_each_others_rows(tmp_path):
    """Array tasks share their array's record; each task's supervisor appends its restarts to it
    (supervise.loop._to_record): no row of either is lost."""
    env, path = _record(tmp_path)
    n, go = 100, tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", APPENDER, task, str(n), str(go)],
                              env={**os.environ, **env}) for task in ("0", "1")]
    go.touch()
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    rows = json.loads(path.read_text())["alloc_restarts"]
    for task in ("0", "1"):
        assert [r["i"] for r in rows if r["task"] == task] == list(range(n)), rows
    assert not list(path.parent.glob(".*lock"))
