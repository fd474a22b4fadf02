"""Engine backends: what turns a job into a run directory. `registry` finds them by name (built-ins
and the `harness.backends` entry point group); harness/records/contract.py defines the interface."""

from harness.backends.registry import ENTRY_POINT_GROUP, BackendInfo, available, get_backend

__all__ = ["ENTRY_POINT_GROUP", "BackendInfo", "available", "get_backend"]
