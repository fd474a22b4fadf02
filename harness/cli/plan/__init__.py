"""`harness plan`: the command and its per-architecture sections."""
