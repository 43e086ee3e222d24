"""slurm/train.sbatch as written: the #SBATCH lines sbatch reads (only those before the first
command count) ask for --no-kill, so with MAX_RESTARTS > 0 (the default 2) a lost node does not end
the job and the supervisor heals it inside the allocation (docs/restarts.md); the script parses."""

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "slurm" / "train.sbatch"


def _sbatch_lines(text: str) -> list[str]:
    """The #SBATCH options sbatch takes: those before the first line that is not a comment."""
    out = []
    for line in text.splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if line.startswith("#SBATCH "):
            out.append(line.split(None, 1)[1].strip())
    return out


def test_train_sbatch_asks_for_no_kill_where_sbatch_reads_it():
    text = SCRIPT.read_text()
    assert "--no-kill" in _sbatch_lines(text)
    assert '"${MAX_RESTARTS:-2}" = 0' in text         # the default supervises: --no-kill is what it needs
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
