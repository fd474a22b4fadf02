"""Whether an injected fault can act on a cell: the model's components say where a fault is inert
(harness/arch/scope.py); a collective moved to the model's own dtype is inert on any model."""

from __future__ import annotations

from harness.arch.model import model_of
from harness.arch.plan import plan_model
from harness.arch.scope import inert_reason as component_inert_reason
from harness.engine.faults import fault_flags
from harness.partition.pd_layout import naive_head_sources
from harness.partition.pd_state import same_rank_moves
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
    if flags.pd_head_offset or flags.pd_naive_gqa:
        why = _pd_inert(name, spec, topology, flags.pd_head_offset)
        if why:
            return why
    if flags.pd_state_same_rank:
        state = plan_model(model_of(spec), topology).pd_state_plan
        if state is not None and all(same_rank_moves(state, r) == m for r, m in enumerate(state.moves)):
            return (f"fault {name} is inert on {spec.name} at {topology.name}: every decode rank's prefill rank of the "
                    f"same number holds its linear-attention heads in the same order")
    return component_inert_reason(name, model_of(spec), topology, flags)


def _pd_inert(name: str, spec: ModelSpec, topology: Topology, head_offset: bool) -> str | None:
    """A transfer-placement fault that reads or writes the same slices as the plan on this pair."""
    pd = plan_model(model_of(spec), topology).pd
    assert pd is not None  # the fault needs a disaggregated topology (fault_flags)
    if head_offset and all(h.dest_slot == h.src_slots[0] for r in pd.ranks for h in r.heads):
        return (f"fault {name} is inert on {spec.name} at {topology.name}: every KV head keeps its slice index "
                f"from the prefill rank to the decode rank")
    if not head_offset and all(naive_head_sources(pd, r.rank) == r.heads for r in pd.ranks):
        return (f"fault {name} is inert on {spec.name} at {topology.name}: the prefill side does not duplicate "
                f"KV heads (prefill kv_tp_size={pd.prefill.kv_tp_size}, kv_heads={pd.prefill.shape.kv_heads})")
    return None
