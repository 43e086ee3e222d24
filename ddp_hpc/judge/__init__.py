"""What status and the supervisor read from a run's logs, and what they conclude from them.

The run logs' format is ``ddp_hpc.runlogs.schema``; the ranks write them (``ddp_hpc.runlogs``).
Here: ``reader`` (re-exported) turns a log directory into facts, from ``tails`` (event streams, log
tails), ``newest``, ``srun`` (plain-text output), ``restarts`` (restarts.jsonl), ``stacks`` and
``flightrec``; ``evidence`` (how one rank ended), ``attribution`` (who broke the run),
``consequences`` (its wording) and ``timing`` (progress, stalls, slow ranks) judge them; ``kept``
is what the job table keeps of an ended job's logs.
"""
from ddp_hpc.judge.reader import (
                                    Failure,
                                    RankStream,
                                    RunEnding,
                                    RunLogs,
                                    RunProgress,
                                    RunSummary,
                                    exception_of,
                                    read_events,
                                    run_ending,
                                    tail_file,
                                    tail_lines,
                                    traceback_in,
)

__all__ = ["RunLogs", "RankStream", "Failure", "RunProgress", "RunSummary", "RunEnding", "read_events",
           "run_ending", "traceback_in", "exception_of", "tail_file", "tail_lines"]
