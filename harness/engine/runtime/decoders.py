"""One rank's decoder, weights and KV cache, built by the engine module its model's attention component
names (harness/arch/components.py engine_module): dense/GQA attention (model.py), MLA (mla.py), the
hybrid layers (hybrid.py) or sparse attention with an indexer (sparse.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from harness.arch.plan import ModelPlan
from harness.engine.fault import FaultFlags
from harness.engine.layers.dense import Decoder, HeadMap, Hyper, LocalWeights
from harness.engine.layers.hybrid import (
    DataParallel,
    HybridLayer,
    HybridParts,
    build_hybrid,
    experts_report,
    hybrid_layout_report,
    shard_hybrid,
)
from harness.engine.layers.mla import MLAParts, build_mla, mla_report, shard_mla_weights
from harness.engine.layers.sparse import SparseDecoder, shard_indexer, sparse_capacity, sparse_report
from harness.engine.runtime.kvcache import PagedKVCache
from harness.engine.runtime.parallel import ParallelState
from harness.engine.runtime.parallelize import engine_plan, head_map, shard_weights
from harness.engine.runtime.param_report import ShardFn, held_params
from harness.partition.layout import LayoutPlan, PoolCapacity, RankLayout, pool_capacity
from harness.partition.sparse_layout import INDEX_GROUP, kv_pool_of, sparse_cache_groups
from harness.records.rankreport import ExpertsReport, HybridReport, MLAReport, ParamShard, SparseReport
from harness.specs.model import ModelSpec
from harness.specs.topology import Topology


@dataclass(frozen=True)
class RankBuild:
    """What the engine is asked to build from: the model's spec and plan, this rank, its faults, its pool."""

    spec: ModelSpec
    plan: ModelPlan
    full_weights: dict[str, torch.Tensor]
    state: ParallelState
    flags: FaultFlags
    budget_bytes: int
    max_seq_len: int
    block_size: int
    dtype: torch.dtype

    @property
    def topology(self) -> Topology:
        return self.plan.topology

    @property
    def hyper(self) -> Hyper:
        return Hyper(self.spec.head_dim, self.spec.rope_theta, self.spec.norm_eps)


@dataclass(frozen=True)
class ModuleReport:
    """What an attention component's engine module adds to the rank report (parallelize.rank_report): a
    replacement of the K/V weight checksums and of the bytes per stored token, its MLA or hybrid record."""

    checksums: dict[str, str] | None = None
    kv_bytes_per_token: int | None = None
    mla_record: MLAReport | None = None
    hybrid_record: HybridReport | None = None
    sparse_record: SparseReport | None = None
    experts_record: ExpertsReport | None = None  # experts beside MLA (DeepSeek's MoE)


def _latent_report(parts: MLAParts, spec: ModelSpec) -> ModuleReport:
    record, sums, per_token = mla_report(parts, spec)
    moe = next((layer.moe for layer in parts.weights.layers if layer.moe is not None), None)
    experts = experts_report(moe, parts.moe_rank) if moe is not None and parts.moe_rank is not None else None
    return ModuleReport(sums, per_token, mla_record=record, experts_record=experts)


@dataclass(frozen=True)
class RankParts:
    """One rank's built model; `report` gives what its engine module adds to the rank report, `own` the
    engine module's parts."""

    plan: LayoutPlan
    rank_layout: RankLayout
    heads: HeadMap
    capacity: PoolCapacity
    cache: PagedKVCache
    decoder: Decoder
    weights: LocalWeights
    report: Callable[[], ModuleReport]
    own: MLAParts | HybridParts | None = None  # what the component's engine module built beyond these
    params: dict[str, ParamShard] | None = None  # what it holds of every checkpoint tensor (param_report.py)


CPU = torch.device("cpu")


def _params(b: RankBuild, shard: ShardFn, held: object) -> dict[str, ParamShard] | None:
    """What the rank holds of every checkpoint tensor: its own shard function traced (param_report.py)."""
    return held_params(shard, held, b.full_weights, b.dtype)


def _attention_plan(b: RankBuild) -> tuple[LayoutPlan, RankLayout, HeadMap, PoolCapacity]:
    t = b.topology
    plan = engine_plan(b.spec, t.tp, t.dcp, b.flags, t.placement, t.q_replicated)
    rank_layout = plan.ranks[b.state.rank]
    capacity = pool_capacity(plan, b.budget_bytes, b.max_seq_len, b.block_size)
    return plan, rank_layout, head_map(rank_layout, b.flags), capacity


def build_dense(b: RankBuild) -> RankParts:
    plan, rank_layout, heads, capacity = _attention_plan(b)
    weights = shard_weights(b.full_weights, b.spec, rank_layout, b.dtype, b.state.device, b.flags)
    cache = PagedKVCache(capacity, b.spec.layers, heads.n_kv, b.spec.head_dim, b.dtype, b.state.device)
    decoder = Decoder(weights, heads, b.hyper, b.state.collectives(), cache, b.flags, b.topology.placement)
    params = _params(b, lambda full, dtype: shard_weights(full, b.spec, rank_layout, dtype, CPU, b.flags), weights)
    return RankParts(plan, rank_layout, heads, capacity, cache, decoder, weights, ModuleReport, params=params)


def build_latent(b: RankBuild) -> RankParts:
    plan, rank_layout, heads, capacity = _attention_plan(b)
    assert b.plan.latent is not None
    parts = build_mla(b.spec, b.full_weights, rank_layout, heads, b.state.collectives(), b.flags, capacity, b.dtype,
                      b.state.device, b.plan.latent, b.topology.placement, b.plan.moe)
    params = _params(b, lambda full, dtype: shard_mla_weights(full, b.spec, rank_layout, parts.rank, b.flags, dtype,
                                                              CPU, b.plan.moe), parts.weights)
    return RankParts(plan, rank_layout, heads, capacity, parts.cache, parts.decoder, parts.weights,
                     lambda: _latent_report(parts, b.spec), parts, params)


def _by_layer(weights: LocalWeights, layers: list[HybridLayer]) -> dict[str, object]:
    """A hybrid rank's weights with every layer's tensors under its global index (the full-attention
    layers' LayerWeights sit in LocalWeights.layers by their own count)."""
    return {"model": replace(weights, layers=[]),
            "layers": [(layer, weights.layers[layer.full_index] if layer.full_index >= 0 else None)
                       for layer in layers]}


def build_hybrid_rank(b: RankBuild) -> RankParts:
    assert b.plan.hybrid_plan is not None
    state = b.state
    dp = b.topology.dp
    # attention data parallel: the decoder's collectives are this DP rank's (one rank), the MoE's the world's
    data_parallel = DataParallel(dp, state.rank, state.collectives()) if dp > 1 else None
    comm = state.alone().collectives() if data_parallel is not None else state.collectives()
    parts = build_hybrid(b.spec, b.plan.model.hybrid_shape(), b.plan.hybrid_plan, b.full_weights, state.rank, b.flags,
                         b.budget_bytes, b.max_seq_len, b.block_size, b.hyper, comm, b.dtype,
                         state.device, b.plan.speculator, data_parallel)
    hybrid_plan, shape = b.plan.hybrid_plan, b.plan.model.hybrid_shape()
    params = _params(b, lambda full, dtype: _by_layer(*shard_hybrid(full, b.spec, shape, hybrid_plan, state.rank,
                                                                     b.flags, dtype, CPU)),
                     _by_layer(parts.weights, parts.layers))
    return RankParts(parts.plan.attention, parts.rank_layout, parts.heads, parts.capacity, parts.cache,
                     parts.decoder, parts.weights,
                     lambda: ModuleReport(hybrid_record=hybrid_layout_report(parts, state.rank)), parts, params)


def build_sparse(b: RankBuild) -> RankParts:
    """GQA attention over the indexer's selection: the KV and indexer-key cache groups sized as one slot
    count (sparse_capacity), the rank's indexer heads, the sparse decoder."""
    t, rank = b.topology, b.state.rank
    indexer = b.plan.indexer
    assert indexer is not None
    plan = engine_plan(b.spec, t.tp, t.dcp, b.flags, t.placement)
    rank_layout, irank = plan.ranks[rank], indexer.ranks[rank]
    grouped, blocks = sparse_capacity(sparse_cache_groups(plan, indexer, b.max_seq_len, b.block_size),
                                      b.budget_bytes, b.flags, rank)
    capacity = kv_pool_of(grouped, b.block_size)
    heads = head_map(rank_layout, b.flags)
    weights = shard_weights(b.full_weights, b.spec, rank_layout, b.dtype, b.state.device)
    cache = PagedKVCache(capacity, b.spec.layers, heads.n_kv, b.spec.head_dim, b.dtype, b.state.device)
    index_weights = shard_indexer(b.full_weights, b.spec, indexer.shape, irank, b.dtype, b.state.device, b.flags)
    decoder = SparseDecoder(weights, heads, b.hyper, b.state.collectives(), cache, b.flags, t.placement,
                            index_weights, indexer.shape, blocks[INDEX_GROUP])

    def shard(full: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, object]:
        """The attention weights and every layer's indexer (under "layers": the layer each reads from)."""
        return {"indexer": {"layers": shard_indexer(full, b.spec, indexer.shape, irank, dtype, CPU, b.flags)},
                "model": shard_weights(full, b.spec, rank_layout, dtype, CPU)}

    params = _params(b, shard, {"indexer": {"layers": index_weights}, "model": weights})
    return RankParts(plan, rank_layout, heads, capacity, cache, decoder, weights,
                     lambda: ModuleReport(sparse_record=sparse_report(decoder, irank, blocks)), params=params)


# the builder of each engine module an attention component names
BUILDERS: dict[str, Callable[[RankBuild], RankParts]] = {
    "harness.engine.layers.dense": build_dense, "harness.engine.layers.mla": build_latent,
    "harness.engine.layers.hybrid": build_hybrid_rank,
    "harness.engine.layers.sparse": build_sparse,
}


def build_rank(b: RankBuild) -> RankParts:
    return BUILDERS[b.plan.model.attention.engine_module](b)
