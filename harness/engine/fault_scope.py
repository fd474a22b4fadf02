"""Whether an injected fault can act on a cell: the fault's own scope rule (declared with it, beside the code it
breaks) and the model's components (harness/arch/scope.py: a fault owned by a component the model lacks, or one a
component leaves as it is)."""

from __future__ import annotations

from harness.arch.model import model_of
from harness.arch.scope import inert_reason as component_inert_reason
from harness.engine.faults import FAULTS, fault_flags
from harness.specs.model import ModelSpec
from harness.specs.topology import Topology


def inert_reason(name: str | None, spec: ModelSpec, topology: Topology) -> str | None:
    """Why fault `name` cannot change anything on (spec, topology), or None when it can act (or
    when that cannot be decided without running)."""
    if name is None:
        return None
    flags = fault_flags(name, topology)
    rule = FAULTS[name].inert if name in FAULTS else None
    if rule is not None and (why := rule(name, spec, topology, flags)) is not None:
        return why
    return component_inert_reason(name, model_of(spec), topology, flags)
