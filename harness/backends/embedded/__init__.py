"""The embedded engine as a backend: its launch, rank workers (plain and P/D), workloads, GSM8K."""
