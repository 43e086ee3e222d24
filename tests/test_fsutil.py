"""ddp_hpc.fsutil: atomic writes leave a file with the permissions any new file of the process
gets (the umask decides, as for open()), never wider; real files, a real umask per process."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import pytest

WRITES = textwrap.dedent("""
    import os, sys, json
    os.umask(int(sys.argv[2], 8))
    from pathlib import Path
    from ddp_hpc import fsutil, records
    from ddp_hpc.train.checkpoint import save_checkpoint
    d = Path(sys.argv[1])
    fsutil.atomic_write_text(d / "text", "x")
    fsutil.atomic_write_json(d / "json", {"a": 1})
    fsutil.atomic_write_texts([(d / "many", "y")])
    save_checkpoint(d / "ckpt", 1, {"w": 1})
    env = {"DDP_HPC_HOME": str(d / "home")}
    rec = records.JobRecord(id="7", cluster="c", name="n", backend="sbatch", nodes=1, gpus_per_node=1,
                            time_limit=None, log_dir=str(d), config=None, overrides=[], submitted_at=0.0,
                            cwd=str(d))
    path = records.write_record(rec, env)
    rec = records.load_record("7", environ=env)
    rec.pids = [1]
    records.update_record(rec, env)
    records.store_final(rec, {None: records.local_final("COMPLETED", 1.0, 2.0, "test")}, env)
    print(json.dumps({"text": str(d / "text"), "json": str(d / "json"), "many": str(d / "many"),
                      "checkpoint": str(d / "ckpt" / "ckpt-000000001.pt"), "record": str(path)}))
""")


@pytest.mark.parametrize("umask, expect", [("077", 0o600), ("022", 0o644), ("027", 0o640), ("002", 0o664)])
def test_atomic_writes_follow_the_umask(tmp_path, umask, expect):
    import json
    p = subprocess.run([sys.executable, "-c", WRITES, str(tmp_path), umask], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    made = json.loads(p.stdout.splitlines()[-1])
    modes = {what: stat.S_IMODE(os.stat(path).st_mode) for what, path in made.items()}
    assert modes == dict.fromkeys(made, expect), {k: oct(v) for k, v in modes.items()}


def test_file_size_is_zero_for_no_file(tmp_path):
    from ddp_hpc.fsutil import file_size
    (tmp_path / "f").write_text("abc")
    assert [file_size(tmp_path / "f"), file_size(tmp_path / "none"), file_size(None)] == [3, 0, 0]
