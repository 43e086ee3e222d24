"""What a rank's training ended with, picklable so spawned ranks can send it back through a pipe."""
from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class TrainResult:
    """What a rank's training ended with. `status`: completed | preempted."""
    status: str
    step: int
    epoch: int
    loss: float | None = None
    eval_metrics: dict = field(default_factory=dict)
    reason: str | None = None          # preemption | timelimit (when preempted)
    requeued: bool = False
    checkpoint: str | None = None
    resumed_from: str | None = None
    model: Any = None                  # the plain (unwrapped) module, in-process only
    model_state: bytes | None = None   # set when the result was pickled (see __getstate__)

    def __getstate__(self) -> dict:
        """Pickle the weights as torch.save bytes instead of the module: results travel back
        from spawned ranks through a pipe, and a pickled tensor would point at shared memory of
        a process that is exiting."""
        state = dict(self.__dict__)
        if state.get("model") is not None:
            buf = io.BytesIO()
            torch.save(state["model"].state_dict(), buf)
            state["model_state"], state["model"] = buf.getvalue(), None
        return state

    def state_dict(self) -> dict:
        """The trained weights (no ``module.`` prefix), in-process or after pickling."""
        if self.model is not None:
            return self.model.state_dict()
        if self.model_state is None:
            raise ValueError("this TrainResult carries no model")
        return torch.load(io.BytesIO(self.model_state), weights_only=True)
