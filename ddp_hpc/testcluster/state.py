"""The test cluster's record of itself: ``<state dir>/state.json`` lists the spec and everything
that was created, written before each next step so ``down`` can always undo a half-made cluster."""

from __future__ import annotations

import json
from pathlib import Path

from ddp_hpc.fsutil import atomic_write_text

from .spec import ClusterError, ClusterSpec

STATE_FILE = "state.json"
STAMP = ".ddp_hpc_testcluster"


def state_path(state_dir: Path) -> Path:
    return Path(state_dir) / STATE_FILE


def load_state(state_dir: Path) -> dict | None:
    try:
        return json.loads(state_path(state_dir).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ClusterError(f"cannot read {state_path(state_dir)}: {exc}",
                           "remove the cluster by hand (see the file) or delete the state dir.") from exc


def save_state(spec: ClusterSpec, state: dict) -> None:
    atomic_write_text(state_path(spec.state_dir), json.dumps(state, indent=1))
