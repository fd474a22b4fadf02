"""plan_model: the typed plan of a whole model over one topology, assembled from its components' plans."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.arch.component import Component, PlanError
from harness.arch.components import GatedPlan, MoE
from harness.arch.model import Model
from harness.core.errors import ConfigError
from harness.partition.hybrid_layout import HybridPlan, LinearPlan, MoePlan
from harness.partition.layout import LayoutPlan
from harness.partition.mla_layout import MLAPlan
from harness.partition.pd_layout import PDPlan, StateSource, plan_pd, plan_pd_state
from harness.partition.pd_state import PDStatePlan, plan_state_moves
from harness.partition.sparse_layout import SparsePlan
from harness.specs.topology import Topology


@dataclass(frozen=True)
class ModelPlan:
    """What every rank holds of `model` on `topology`: `attention` is the KV-holding attention layers'
    layout (a hybrid model's full-attention layers), the other parts belong to the components that have
    them (None where the model has no such component or the topology no speculator)."""

    model: Model
    topology: Topology
    attention: LayoutPlan
    latent: MLAPlan | None = None
    gated: GatedPlan | None = None
    linear: LinearPlan | None = None
    moe: MoePlan | None = None
    indexer: SparsePlan | None = None  # sparse attention: the indexer's split
    speculator: LayoutPlan | None = None
    pd: PDPlan | None = None                # disaggregated: the decode ranks' KV assembly from the prefill ranks
    pd_state: tuple[StateSource, ...] = ()  # ... and their linear-attention state (hybrid models)
    pd_state_plan: PDStatePlan | None = None  # ... that state's slices and each decode slice's source

    @property
    def hybrid_plan(self) -> HybridPlan | None:
        """The linear attention, gated attention and MoE parts together (the hybrid layout check's and
        the hybrid engine's view), or None for a model without linear attention."""
        if self.linear is None or self.gated is None:
            return None
        return HybridPlan(kinds=self.gated.kinds, attention=self.attention, linear=self.linear, moe=self.moe,
                          output_gate=self.gated.output_gate, q_proj_rows=self.gated.q_proj_rows)


def plan_model(model: Model, topology: Topology) -> ModelPlan:
    """Every component's plan of `model` over `topology`, in component order, then the speculator's when
    the topology has one. Raises PlanError (a ConfigError naming the component) for the first part that
    does not split, and for ep > 1 without a component that takes expert parallel."""
    parts: dict[str, Any] = {}
    for component in model.components:
        parts.update(_planned(component, model, topology))
    if topology.ep > 1 and not model.takes_ep:
        raise PlanError(f"ep={topology.ep} needs a MoE model; {model.spec.name} is dense (no hybrid.experts)",
                        MoE.name)
    if topology.dp > 1:
        _check_dp(model, topology)
    if topology.speculator != "none":
        parts.update(_planned(model.speculator, model, topology))
    if topology.prefill is not None:
        prefill = plan_model(model, topology.prefill)
        parts["pd"] = plan_pd(prefill.attention, parts["attention"])
        if prefill.linear is not None and parts.get("linear") is not None:
            parts["pd_state"] = plan_pd_state(prefill.linear, parts["linear"])
            parts["pd_state_plan"] = plan_state_moves(model.hybrid_shape(), prefill.linear, parts["linear"],
                                                      parts["pd_state"])
    return ModelPlan(model=model, topology=topology, **parts)


def _check_dp(model: Model, topology: Topology) -> None:
    """Attention data parallel needs experts to gather tokens for, and every component to run under it."""
    if not model.takes_ep:
        raise PlanError(f"dp={topology.dp} (attention data parallel) needs a MoE model; {model.spec.name} has no "
                        f"experts (hybrid.experts)", MoE.name)
    for component in model.components:
        if not component.takes_dp:
            raise PlanError(f"dp={topology.dp}: component {component.name} of {model.spec.name} does not run under "
                            f"attention data parallel", component.name)
    if topology.speculator != "none":
        raise PlanError(f"dp={topology.dp}: a {topology.speculator} speculator does not run under attention data "
                        f"parallel; drop -{topology.speculator}", model.speculator.name)


def _planned(component: Component, model: Model, topology: Topology) -> dict[str, Any]:
    try:
        return component.plan(model.spec, topology)
    except ConfigError as exc:
        raise PlanError(str(exc), component.name) from exc
