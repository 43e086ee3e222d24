"""The job status command: job records and the scheduler -> one status per job -> table, detail, logs.

``targets`` (which jobs: job records) -> ``collect`` (the scheduler once per source for all) ->
``resolve`` (each job's state from its sources in one order: scheduler, record, logs, kept facts,
row cache; readers in ``sources``) -> a ``JobStatus`` row or detail -> ``view`` (text and JSON);
``cli`` is the command.
"""
