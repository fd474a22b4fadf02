"""Whether an injected fault can act on a cell, asked of the model's components: a fault owned by a
component the model lacks is inert (e.g. an MLA fault on a GQA model), and each component says where a
fault leaves its computation as it is (e.g. the naive GQA mapping where KV heads are not duplicated). Such
a cell is a SKIP saying so rather than a PASS that claims the fault was checked."""

from __future__ import annotations

from dataclasses import fields

from harness.arch.component import Component, FaultEffects, FaultSite
from harness.arch.components import GatedDeltaNet, LatentAttention, MoE, SparseAttention
from harness.arch.model import Model
from harness.arch.plan import plan_model
from harness.specs.topology import Topology

# (faults, the components that can run them, why they are inert on a model with none of those)
ABSENT: tuple[tuple[frozenset[str], tuple[type[Component], ...], str], ...] = (
    (GatedDeltaNet.faults | MoE.faults, (GatedDeltaNet, MoE), "it is a dense model (no linear attention or MoE)"),
    (MoE.faults, (MoE,), "no experts"),
    (frozenset({"pd-state-conv-shift", "pd-state-same-rank"}), (GatedDeltaNet,),
     "it acts on linear-attention state, and the model has none"),
    (LatentAttention.faults, (LatentAttention,), "it acts on MLA attention, and the model has none"),
    (SparseAttention.faults, (SparseAttention,), "it acts on sparse attention (an indexer), and the model has none"),
)

OWNED_FAULTS: frozenset[str] = frozenset().union(*(faults for faults, _, _ in ABSENT))


def inert_reason(fault: str, model: Model, topology: Topology, flags: FaultEffects) -> str | None:
    """Why `fault` cannot change anything on `model` at `topology` (a component it needs is missing, or
    a component says so), or None when it can act or that cannot be decided without running."""
    for faults, owners, why in ABSENT:
        if fault in faults and not any(isinstance(c, owners) for c in model.components):
            return f"fault {fault} is inert on {model.spec.name}: {why}"
    plan = plan_model(model, topology)
    site = FaultSite(fault, model.spec, topology, flags,
                     {f.name: getattr(plan, f.name) for f in fields(plan) if f.name not in ("model", "topology")})
    return next((r for c in model.components if (r := c.inert_reason(site)) is not None), None)
