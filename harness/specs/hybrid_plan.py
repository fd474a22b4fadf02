"""The hybrid plan of a model spec over a topology (harness/hybrid_layout.py with the spec's numbers)."""

from __future__ import annotations

from harness.errors import ConfigError
from harness.hybrid_layout import HybridPlan, plan_hybrid
from harness.specs.model import ModelSpec
from harness.specs.topology import Topology


def plan_model(model: ModelSpec, topo: Topology) -> HybridPlan:
    """Linear attention, gated attention and MoE shards of `model` over `topo`; raises for a dense
    model at ep > 1 (expert parallel needs experts)."""
    if model.hybrid is None:
        raise ConfigError(f"ep={topo.ep} needs a MoE model; {model.name} is dense (no hybrid.experts)")
    return plan_hybrid(model.attention_shape, model.hybrid, topo.tp, topo.dcp, topo.ep)
