"""The plan sections of `harness plan --format json` (schema in README) from a ModelPlan."""

from __future__ import annotations

from typing import Any

from harness.arch.plan import ModelPlan
from harness.partition.cache_groups import CacheGroup, grouped_capacity
from harness.partition.hybrid_layout import hybrid_cache_groups
from harness.partition.layout import pool_capacity
from harness.partition.sparse_layout import sparse_cache_groups
from harness.specs.pool import PoolSettings


def plan_sections(plan: ModelPlan, budget_bytes: int | None, max_seq_len: int, block_size: int) -> dict[str, Any]:
    """The layout fields of the KV-holding attention layers, then `capacity`, `speculator`, `hybrid`
    and `mla` (None where the model or topology has no such part), and `sparse` for a sparse-attention
    model only. A hybrid or sparse model's capacity is its grouped capacity, in its own section."""
    layout = plan.attention.to_dict()
    hybrid = plan.hybrid_plan
    capacity = None
    section = None
    if hybrid is not None:
        groups: tuple[CacheGroup, ...] = hybrid_cache_groups(hybrid.attention, hybrid.linear, plan.speculator,
                                                             max_seq_len, block_size)
        section = {**hybrid.to_dict(), "max_seq_len": max_seq_len, "block_size": block_size,
                   "cache_groups": [{"name": g.name, "blocks_per_seq": g.blocks_per_seq,
                                     "block_bytes": g.block_bytes} for g in groups],
                   "capacity": None if budget_bytes is None else grouped_capacity(groups, budget_bytes).to_dict()}
    sparse = None
    if plan.indexer is not None:  # one slot count across the KV and indexer-key groups
        groups = sparse_cache_groups(plan.attention, plan.indexer, max_seq_len, block_size)
        budget = PoolSettings().budget_bytes if budget_bytes is None else budget_bytes  # a run's default pool
        sparse = {**plan.indexer.to_dict(), "max_seq_len": max_seq_len, "block_size": block_size,
                  "cache_groups": [{"name": g.name, "blocks_per_seq": g.blocks_per_seq, "block_bytes": g.block_bytes,
                                    "slot_bytes": g.slot_bytes} for g in groups],
                  "capacity": grouped_capacity(groups, budget).to_dict(), "default_budget": budget_bytes is None}
    elif budget_bytes is not None and hybrid is None:
        capacity = {"max_seq_len": max_seq_len,
                    **pool_capacity(plan.attention, budget_bytes, max_seq_len, block_size).to_dict()}
    if plan.moe is not None:  # the FFN is the MoE (section "moe"): no dense FFN columns
        for rank in layout["ranks"]:
            rank["ffn_shard"] = [0, 0]
    speculator = None if plan.speculator is None else {"kind": plan.topology.speculator, **plan.speculator.to_dict()}
    # an MLA model's experts (a hybrid's are in its section); the key only where there are some
    experts = {"moe": plan.moe.to_dict()} if plan.moe is not None and section is None else {}
    return {**layout, "capacity": capacity, "speculator": speculator, "hybrid": section,
            "mla": None if plan.latent is None else plan.latent.to_dict(), **experts,
            **({} if sparse is None else {"sparse": sparse})}
