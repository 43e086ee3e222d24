"""Run logs, the writing side: what runs inside a rank (or the batch step) and writes a run's logs.

``schema`` spells the file names, event names and keys (the one format, read by
``ddp_hpc.judge``); ``writer`` writes a rank's text log and events; ``tboard`` its TensorBoard
scalars; ``watchdog`` the stack dumps before a collective timeout; ``restarts`` the supervisor's
restarts.jsonl.
"""
