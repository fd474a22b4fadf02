"""Whether an injected fault can act on a cell: the model's components say where a fault is inert
(harness/arch/scope.py); a collective moved to the model's own dtype is inert on any model."""

from __future__ import annotations

from harness.arch.model import model_of
from harness.arch.scope import inert_reason as component_inert_reason
from harness.engine.faults import fault_flags
from harness.specs.model import ModelSpec
from harness.specs.topology import Topology


def inert_reason(name: str | None, spec: ModelSpec, topology: Topology) -> str | None:
    """Why fault `name` cannot change anything on (spec, topology), or None when it can act (or
    when that cannot be decided without running)."""
    if name is None:
        return None
    flags = fault_flags(name, topology)
    if flags.reduce_dtype is not None and flags.reduce_dtype == spec.dtype:
        # a collective moved to a lower precision that is the model's own: the engine already reduces in it
        return (f"fault {name} is inert on {spec.name}: it does the TP all-reduce in {flags.reduce_dtype}, "
                f"which is already the model's dtype")
    return component_inert_reason(name, model_of(spec), topology, flags)
