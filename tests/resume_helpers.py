"""A test-only dataset for resumed runs: the demo's synthetic data whose rank 0 fails once.

Used through the config's import-path form, e.g.
``data.dataset=tests.resume_helpers:fail_once data.kwargs.marker=/tmp/x/failed``: the first run
(no marker file yet) writes the marker and raises after ``after`` fetches on rank 0; every later
run of the same config (the marker is there) trains to the end.
"""
from __future__ import annotations

import os
from pathlib import Path

from torch.utils.data import Dataset

from ddp_hpc.examples.synthetic import SyntheticClassification


class FailedOnce(RuntimeError):
    """The exception of the first run."""


class FailOnce(Dataset):
    def __init__(self, marker: str, after: int = 320, **kwargs):
        self.data = SyntheticClassification(**kwargs)
        self.marker, self.after, self.fetched = Path(marker), int(after), 0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        self.fetched += 1
        if os.environ.get("RANK", "0") == "0" and self.fetched > self.after and not self.marker.exists():
            self.marker.write_text("failed once\n")
            raise FailedOnce(f"injected failure after {self.after} samples (first run only)")
        return self.data[i]


def fail_once(**kwargs) -> FailOnce:
    """Factory for ``data.dataset``."""
    return FailOnce(**kwargs)
