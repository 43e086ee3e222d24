"""Run logs: per-rank text logs and JSONL events, written on the nodes and read by status."""
