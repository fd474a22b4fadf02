"""What a run directory says about the engine that wrote it."""

from __future__ import annotations

from harness.artifacts import RunArtifacts
from harness.backends.base import recorded_capabilities
from harness.contract import Capabilities


def run_capabilities(run: RunArtifacts, default: Capabilities | None = None) -> Capabilities:
    """The capabilities the run's manifest records, else `default` (else the embedded engine's)."""
    recorded = recorded_capabilities(run.manifest)
    if recorded is not None:
        return recorded
    if default is not None:
        return default
    from harness.backends.embedded import FULL
    return Capabilities(provides=FULL)
