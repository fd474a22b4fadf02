"""Run records: the backend/run-directory contract, the typed Job and RankReport, results.json, run directories
read and written and validated, the history database, shards, workload views."""
