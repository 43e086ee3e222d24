"""Atomic checkpoints, keep-last-K, and finding the newest checkpoint that really loads.

Why: a preempted or killed job must never lose what it had, and a requeued job must never load a
half-written file.  So a checkpoint is written to a temporary file in the same directory, flushed
and fsynced, then renamed over its final name (rename is atomic within one filesystem) and the
directory is fsynced so the rename survives a crash.  Readers only look at final names
(``ckpt-<step>.pt``), load with ``weights_only=True`` (no pickled code runs), check the format
marker, and skip anything broken with a warning, falling back to the next newest.
"""
from __future__ import annotations

import random
import re
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ddp_hpc.errors import HintError
from ddp_hpc.fsutil import atomic_write

FORMAT = "ddp_hpc.checkpoint/1"
REQUIRED_KEYS = ("format", "step", "epoch", "batch_in_epoch", "model", "optimizer")
_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")
_TMP_PREFIX = ".ckpt-tmp-"


class CheckpointError(HintError, RuntimeError):
    """A checkpoint another rank chose cannot be used here (e.g. checkpoint.dir is node-local)."""


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"ckpt-{step:09d}.pt"


def save_checkpoint(directory: str | Path, step: int, state: dict, keep_last: int = 3) -> Path:
    """Write `state` atomically as ckpt-<step>.pt in `directory`, then keep only the newest
    `keep_last` checkpoints.  Returns the final path.  Call from one rank only."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, step)
    atomic_write(final, lambda f: torch.save({"format": FORMAT, **state, "step": step}, f),
                 binary=True, tmp_prefix=_TMP_PREFIX)
    prune(directory, keep_last)
    return final


def list_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of final-named checkpoints, newest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _NAME.fullmatch(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


def prune(directory: str | Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints, and temp files of killed writers."""
    d = Path(directory)
    for _, p in list_checkpoints(d)[keep_last:]:
        try:
            p.unlink()
        except FileNotFoundError:
            pass
    for p in d.glob(_TMP_PREFIX + "*"):
        try:   # a writer's temp file is only ours to remove once no writer can be using it:
            # the single writer (rank 0) calls prune after its own rename, so any other is stale
            p.unlink()
        except FileNotFoundError:
            pass


def load_checkpoint(path: str | Path, map_location: Any = "cpu") -> dict:
    """Load and check one checkpoint (weights_only=True); raises ValueError when it is not one."""
    state = torch.load(path, map_location=map_location, weights_only=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not a ddp_hpc checkpoint (format marker missing)")
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise ValueError(f"{path} lacks keys {missing}")
    return state


def find_latest_valid(directory: str | Path, warn: Callable[[str], None] | None = None,
                      map_location: Any = "cpu") -> tuple[Path, dict] | None:
    """Newest checkpoint in `directory` that loads; broken ones are skipped with a warning."""
    warn = warn or (lambda m: warnings.warn(m, stacklevel=2))
    for _, path in list_checkpoints(directory):
        try:
            return path, load_checkpoint(path, map_location)
        except Exception as e:  # noqa: BLE001 - any failure to load means "skip this file"
            first = (str(e).strip().splitlines() or [""])[0]
            warn(f"skipping unusable checkpoint {path}: {type(e).__name__}: {first}")
    return None


# ----------------------------------------------------------------------------- RNG state

def rng_state() -> dict:
    """This process's RNG states in a weights_only-loadable form (no numpy arrays)."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)),
                  int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
