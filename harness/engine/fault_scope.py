"""Whether an injected fault can act on a cell: a fault that leaves the engine's computation as it
is (e.g. the naive GQA mapping where KV heads are not duplicated) is inert there, and the cell is a
SKIP saying so rather than a PASS that claims the fault was checked."""

from __future__ import annotations

from harness.engine.faults import FAULTS, FaultFlags, fault_flags
from harness.engine.hybrid_scope import hybrid_inert_reason
from harness.engine.parallelize import engine_plan, head_map
from harness.specs.model import ModelSpec
from harness.specs.topology import Topology

# faults whose whole effect is in the layout plan (which KV head each Q head reads, which FFN columns
# and vocab rows each rank holds): decidable from the layout alone
LAYOUT_FAULTS: frozenset[str] = frozenset({"gcd-naive-gqa", "dcp-tp-kv-layout", "vocab-shard-offset",
                                           "ffn-floor-split"})


def kv_reads(spec: ModelSpec, topology: Topology, flags: FaultFlags) -> list[tuple[int, ...]]:
    """Per rank, the global KV head each Q head of its DCP group reads, under `flags`."""
    plan = engine_plan(spec, topology.tp, topology.dcp, flags)
    reads = []
    for rank in plan.ranks:
        heads = head_map(rank, flags)
        reads.append(tuple(rank.kv_heads[j] for j in heads.group_q_to_local_kv))
    return reads


def weight_shards(spec: ModelSpec, topology: Topology, flags: FaultFlags) -> list[tuple[tuple[int, int], ...]]:
    """Per rank, the (FFN columns, vocab rows) it holds under `flags`."""
    plan = engine_plan(spec, topology.tp, topology.dcp, flags)
    return [(rank.ffn_shard, rank.vocab_shard) for rank in plan.ranks]


def inert_reason(name: str | None, spec: ModelSpec, topology: Topology) -> str | None:
    """Why fault `name` cannot change anything on (spec, topology), or None when it can act (or
    when that cannot be decided without running)."""
    if name is None:
        return None
    flags = fault_flags(name, topology)
    hybrid = hybrid_inert_reason(name, spec, topology, flags)
    if hybrid is not None:
        return hybrid
    if name in FAULTS and FAULTS[name].needs_mla and not spec.mla:
        return f"fault {name} is inert on {spec.name}: it acts on MLA attention, and the model has none"
    if flags.reduce_dtype is not None and flags.reduce_dtype == spec.dtype:
        # a collective moved to a lower precision that is the model's own: the engine already reduces in it
        return (f"fault {name} is inert on {spec.name}: it does the TP all-reduce in {flags.reduce_dtype}, "
                f"which is already the model's dtype")
    if name not in LAYOUT_FAULTS:
        return None
    if (kv_reads(spec, topology, flags) == kv_reads(spec, topology, FaultFlags())
            and weight_shards(spec, topology, flags) == weight_shards(spec, topology, FaultFlags())):
        return (f"fault {name} is inert on {spec.name} at {topology.name}: every Q head reads the same KV "
                f"head and every rank holds the same FFN columns and vocab rows as in the correct layout "
                f"(heads={spec.heads}, kv_heads={spec.kv_heads}, ffn={spec.ffn}, vocab={spec.vocab}, "
                f"tp={topology.tp})")
    return None
