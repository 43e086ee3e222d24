"""The errors of ``ddp_hpc.data``: each says what was seen and, on a ``HINT:`` line, what to do.

All derive from :class:`ddp_hpc.errors.HintError` (raise them as ``Error(problem, hint)``) and
keep the builtin base they always had, so ``except RuntimeError`` / ``except ValueError`` code
that caught them before still does.
"""
from __future__ import annotations

from ddp_hpc.errors import HintError

__all__ = ["StageError", "PackError", "VerifyError", "IOConfigError", "SampleError", "RecordIndexError"]


class StageError(HintError, RuntimeError):
    """Staging failed or was refused (no space, a changed source, a copy that fails its hash)."""


class PackError(HintError, RuntimeError):
    """Packing refused (bad source, existing output, unreadable or corrupt input file)."""


class VerifyError(HintError, RuntimeError):
    """An LMDB file failed verification (missing records, checksum mismatch, unreadable)."""


class IOConfigError(HintError, ValueError):
    """A ``data.*`` IO setting cannot work; the message names the key and the fix."""


class SampleError(HintError, TypeError):
    """A sample the broadcast loader cannot ship (not an (input, target) pair of plain tensors)."""


class RecordIndexError(HintError, IndexError):
    """An LMDB dataset was asked for a record it does not hold."""
