"""The job status command: scheduler + job records + run logs -> table, detail, verdict."""
