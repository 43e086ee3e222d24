"""Run logs: per-rank text logs and JSONL events, written on the nodes and read by status.

``schema`` spells the file names, event names and keys; ``writer`` writes them during training;
``reader`` (re-exported here) turns a log directory into facts; ``srun`` reads plain-text output.
"""
from ddp_hpc.runlogs.reader import (
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
