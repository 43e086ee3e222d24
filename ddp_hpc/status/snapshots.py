"""Memory snapshots that stepped back, and ended jobs' snapshots a sweep freed (status ``swept``:
``memory snapshots: freed 0.1 MiB in /dev/shm/ddp_hpc-0 left by ended jobs (55943047)``), as
``ddp-hpc status`` shows them: a node's snapshot writer
writes one ``memsnap`` event (status ``off``, why, the step) when the state does not fit its
``/dev/shm`` or the job's memory, or a snapshot write failed (train/memsnap.py); the detail view
says it in one line, since the job goes on with its file checkpoints only and a restart then
loses more steps: ``memory snapshots off: the state (3.2 GB x 2) does not fit /dev/shm (1.1 GB
free); file checkpoints go on``."""
from __future__ import annotations

__all__ = ["snapshot_notes"]


def snapshot_notes(logs) -> list[str]:
    """One line for the current run (restart) whose snapshots stepped back (the lowest rank's
    reason; how many nodes' writers said so when more than one), and one for what its nodes'
    sweeps freed of ended jobs' snapshots (``swept``: files deleted, so status says it); none
    when neither happened."""
    ranks = getattr(logs, "ranks", None)
    if not ranks:
        return []
    restart = logs.current_restart()
    out = []
    memsnap = [(rank, ev) for rank, stream in ranks.items() for ev in stream.of_restart(restart)
               if ev.get("event") == "memsnap"]
    for status in ("off", "swept"):
        said = sorted(((rank, ev) for rank, ev in memsnap if ev.get("status") == status and ev.get("why")),
                      key=lambda x: x[0])
        if said:
            writers = {rank for rank, _ in said}
            more = f" (said by {len(writers)} ranks' snapshot writers)" if len(writers) > 1 else ""
            out.append(f"{said[0][1]['why']}{more}")
    return out
