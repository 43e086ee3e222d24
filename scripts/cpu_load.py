"""Take a share of every core with busy loops, for a check run of the tests under load.

    python3 scripts/cpu_load.py 0.33      # a third of each core, until killed (SIGTERM)

One process per core; each spins for ``share`` of every 100 ms and sleeps the rest, so the tests
see a machine where something else holds that share of the CPU (another user's job, a data
loader gone wild). As root the loops run at the lowest real-time priority (SCHED_RR 1): with
dozens of test processes runnable, a loop at normal priority would get a fair slice, far less than
its share; real-time, it gets its share exactly, and it sleeps the rest of each period, so nothing
starves. `scripts/test.sh` starts it when ``DDP_HPC_TEST_LOAD`` is set and stops it at
the end; the load is reported so a run's figures say what they were measured under."""

from __future__ import annotations

import os
import signal
import sys
import time

PERIOD_S = 0.1


def spin(share: float, parent: int) -> None:
    """Busy ``share`` of each period until the parent is gone (killed without a chance to stop us,
    the loops must not spin on for ever)."""
    busy = PERIOD_S * share
    while os.getppid() == parent:
        start = time.monotonic()
        while time.monotonic() - start < busy:
            pass
        time.sleep(max(0.0, PERIOD_S - (time.monotonic() - start)))


def main() -> int:
    try:
        share = float(sys.argv[1])
    except (IndexError, ValueError):
        print(f"usage: {sys.argv[0]} SHARE   (0 < SHARE <= 1, e.g. 0.33: a third of each core)",
              file=sys.stderr)
        return 2
    if not 0 < share <= 1:
        print(f"cpu_load: share {share} is not in (0, 1]", file=sys.stderr)
        return 2
    try:
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))   # the children inherit it
        how = "real-time priority"
    except (OSError, AttributeError):
        how = "normal priority (no permission for real-time: the loops may get less than their share)"
    children, parent = [], os.getpid()
    for _ in range(os.cpu_count() or 1):
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            spin(share, parent)
            os._exit(0)
        children.append(pid)

    def stop(*_):
        for pid in children:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"cpu_load: {len(children)} busy loop(s), {share:.0%} of each core, {how}", flush=True)
    while True:
        signal.pause()


if __name__ == "__main__":
    raise SystemExit(main())
