"""The hybrid plan of a model spec over a topology (harness/hybrid_layout.py with the spec's numbers)."""

from __future__ import annotations

from harness.errors import ConfigError
from harness.hybrid_layout import HybridPlan, plan_hybrid
from harness.layout import ROUND_ROBIN, Placement
from harness.specs.model import ModelSpec
from harness.specs.topology import Topology


def check_hybrid_dcp(model: ModelSpec, placement: Placement, q_replicated: bool) -> None:
    """A hybrid model's attention layers run round-robin DCP with Q split by TP; raise for anything else."""
    if model.hybrid is not None and (placement != ROUND_ROBIN or q_replicated):
        raise ConfigError(f"model {model.name} is a hybrid model: its attention layers run round-robin DCP with "
                          f"Q split by TP only (got placement {placement.label}"
                          f"{', Q replicated' if q_replicated else ''})")


def plan_model(model: ModelSpec, topo: Topology) -> HybridPlan:
    """Linear attention, gated attention and MoE shards of `model` over `topo`; raises for a dense
    model at ep > 1 (expert parallel needs experts) and for a hybrid model under another DCP placement
    or Q replication."""
    if model.hybrid is None:
        raise ConfigError(f"ep={topo.ep} needs a MoE model; {model.name} is dense (no hybrid.experts)")
    check_hybrid_dcp(model, topo.placement, topo.q_replicated)
    return plan_hybrid(model.attention_shape, model.hybrid, topo.tp, topo.dcp, topo.ep)
