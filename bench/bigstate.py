"""The training state of the restart and goodput benches (bench/restart.py, bench/goodput.py): the
demo's MLP (jobs/demo.yaml) made wide enough for about ``state_mb`` MB of checkpointed state, and
what a run of it measured: the checkpoint file's bytes and the step time.

The state is the model's parameters plus SGD's momentum buffer (the demo's optimizer, momentum
0.9): 8 bytes per fp32 parameter. ``overrides(150)`` gives ``model.kwargs.hidden=2176`` at
``model.kwargs.depth=5`` (about 19M parameters, about 151 MB); ``overrides(0)`` nothing (the demo's
tiny model). The file on disk is what `checkpoint_bytes` reports (it adds the step, the RNG states
and the data position).
"""
from __future__ import annotations

import statistics
from pathlib import Path

__all__ = ["DEPTH", "params", "hidden_for", "overrides", "checkpoint_bytes", "step_s"]

#: hidden layers of the big MLP (the demo's in_dim 32 and 10 classes are kept)
DEPTH = 5
IN_DIM, CLASSES = 32, 10
#: bytes of state per parameter: fp32 weight + fp32 momentum
BYTES_PER_PARAM = 8


def params(hidden: int, depth: int = DEPTH) -> int:
    """Parameters of the demo's MLP (``ddp_hpc.examples.models.MLP``) of this width and depth."""
    return (IN_DIM + 1) * hidden + (depth - 1) * (hidden + 1) * hidden + (hidden + 1) * CLASSES


def hidden_for(state_mb: float, depth: int = DEPTH) -> int:
    """The width (a multiple of 64) whose model + momentum is closest to ``state_mb`` MB (10^6 bytes)."""
    target = state_mb * 1e6 / BYTES_PER_PARAM
    return min(range(64, 16385, 64), key=lambda h: abs(params(h, depth) - target))


def overrides(state_mb: float) -> list[str]:
    """The config overrides for a state of about ``state_mb`` MB; none for 0 (the demo's model)."""
    if state_mb <= 0:
        return []
    return [f"model.kwargs.hidden={hidden_for(state_mb)}", f"model.kwargs.depth={DEPTH}"]


def checkpoint_bytes(log_dir: Path) -> int | None:
    """The size of the newest checkpoint file of a run (``<log_dir>/checkpoints/ckpt-*.pt``)."""
    files = sorted(Path(log_dir, "checkpoints").glob("ckpt-*.pt"))
    for f in reversed(files):
        try:
            return f.stat().st_size
        except OSError:   # removed by keep_last meanwhile
            continue
    return None


def step_s(steps: list[dict]) -> float | None:
    """The median seconds per step between consecutive ``step`` events of one rank's run."""
    pts = sorted((e["time"], e["step"]) for e in steps)
    per = [(b[0] - a[0]) / (b[1] - a[1]) for a, b in zip(pts, pts[1:]) if b[1] > a[1]]
    return statistics.median(per) if per else None
