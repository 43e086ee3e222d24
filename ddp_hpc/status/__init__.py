"""The job status command: job records and the scheduler -> one status per job -> table, detail, logs.

``targets`` (which jobs: job records) -> ``sources`` (squeue, sacct, sacct -c, processes, logs)
-> ``collect`` (one JobStatus per job) -> ``view`` (text and JSON); ``cli`` is the command.
"""
