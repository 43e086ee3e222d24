"""How much longer a test's real processes may take on this machine now than on an idle one: the
1-minute load average per core, at least 1 and at most 6. Timing bounds that real ranks must meet
(a subprocess's timeout) are multiplied by it, so a machine shared with other work (a CI machine's
neighbours, `DDP_HPC_TEST_LOAD`) slows them without failing them; an idle machine keeps the bound
as written."""
from __future__ import annotations

import os


def load_scale() -> float:
    try:
        per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 1.0
    return min(6.0, max(1.0, per_core))


def scaled(seconds: float) -> float:
    """``seconds`` times `load_scale` (the load measured now)."""
    return seconds * load_scale()
