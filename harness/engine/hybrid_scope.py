"""Where the hybrid-model faults act (see fault_scope.py): each is inert on a dense model, and the
dense layout faults whose split the hybrid planner does not take are inert on a hybrid model."""

from __future__ import annotations

from harness.engine.faults import FaultFlags
from harness.engine.hybrid import engine_hybrid_plan, linear_rows
from harness.hybrid_layout import experts_of
from harness.specs.model import ModelSpec
from harness.specs.topology import Topology

HYBRID_FAULTS: frozenset[str] = frozenset({"deltanet-packed-split", "deltanet-state-dcp-split",
                                           "moe-shared-every-rank", "moe-expert-offset",
                                           "moe-router-local-renorm", "cache-groups-own-budget",
                                           "state-slot-stale"})
MOE_FAULTS: frozenset[str] = frozenset({"moe-shared-every-rank", "moe-expert-offset", "moe-router-local-renorm"})
# dense layout faults in splits the hybrid planner makes itself (KV layout under DCP, FFN and vocab offsets)
DENSE_PLAN_FAULTS: frozenset[str] = frozenset({"dcp-tp-kv-layout", "ffn-floor-split", "vocab-shard-offset"})


def hybrid_inert_reason(name: str, spec: ModelSpec, topology: Topology, flags: FaultFlags) -> str | None:
    """Why fault `name` cannot act on (spec, topology) for a hybrid reason, or None."""
    h = spec.hybrid
    if name in HYBRID_FAULTS and h is None:
        return f"fault {name} is inert on {spec.name}: it is a dense model (no linear attention or MoE)"
    if h is None:
        return None
    if name in DENSE_PLAN_FAULTS:
        return f"fault {name} is inert on {spec.name}: the hybrid planner makes this split without the fault's rule"
    if name in MOE_FAULTS and not h.experts:
        return f"fault {name} is inert on {spec.name}: no experts"
    plan = engine_hybrid_plan(spec, topology.tp, topology.dcp, topology.ep)
    if name == "deltanet-packed-split" and all(linear_rows(h, r, flags) == r.conv_rows for r in plan.linear.ranks):
        return (f"fault {name} is inert on {spec.name} at {topology.name}: every rank's contiguous slice of the "
                f"packed rows is its per-component rows (one group of linear heads)")
    if name == "moe-shared-every-rank" and (not h.shared_ffn or topology.tp == 1):
        return f"fault {name} is inert on {spec.name} at {topology.name}: one rank or no shared expert"
    if name == "moe-expert-offset" and plan.moe is not None:
        per = h.experts // plan.moe.ep
        wrong = [tuple((r.rank * per + j) % h.experts for j in range(per)) for r in plan.moe.ranks]
        if all(w == experts_of(h.experts, r.ep_rank, plan.moe.ep) for w, r in zip(wrong, plan.moe.ranks)):
            return (f"fault {name} is inert on {spec.name} at {topology.name}: the tp rank offsets the expert ids "
                    f"as the EP rank does (ep={plan.moe.ep}, tp={topology.tp})")
    if name == "moe-router-local-renorm" and topology.ep == 1:
        return f"fault {name} is inert on {spec.name} at {topology.name}: every rank holds every expert (ep=1)"
    return None
