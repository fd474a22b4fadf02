"""The architecture components: dense/GQA attention, MLA, gated full attention, linear attention (Gated
DeltaNet), MoE with expert parallel, and the speculator (draft / MTP). Each plans its part through the
partition math of harness/partition/layout.py, mla_layout.py and hybrid_layout.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from harness.arch.component import Component, FaultEffects, FaultSite
from harness.core.errors import ConfigError
from harness.partition.hybrid_layout import (
    LINEAR,
    HybridShape,
    MoePlan,
    MoeShape,
    experts_of,
    full_attention_shape,
    layer_kinds,
    loaded_rows,
    plan_linear,
    plan_moe,
    q_proj_rows,
    replicate_linear_dp,
)
from harness.partition.layout import (
    ROUND_ROBIN,
    LayoutPlan,
    Placement,
    group_kv_slots,
    plan_layout,
    plan_speculator,
    replicate_dp,
    validate,
    validate_q_mode,
)
from harness.partition.mla_layout import plan_mla
from harness.partition.sparse_layout import SparseShape, plan_sparse
from harness.specs.model import ModelSpec
from harness.specs.topology import Topology

# what a rank says it holds of its attention (engine/runtime/parallelize.py actual_layout; layout_check.py reads them)
ATTENTION_FIELDS: tuple[str, ...] = ("q_heads", "kv_heads", "dcp_group", "dcp_rank", "dcp_members", "kv_tp_rank",
                                     "q_to_kv", "ffn_shard", "vocab_shard", "group_q_heads", "group_q_to_kv",
                                     "kv_pool_bytes", "kv_pool_blocks", "kv_weight_checksums")


# the attention-data-parallel faults of the MoE (engine/faults.py): inert without DP
DP_FAULTS: frozenset[str] = frozenset({"dp-pad-local-count", "dp-dummy-topk-wrap", "dp-shared-unreduced"})

# faults whose whole effect is in the layout plan (which KV head each Q head reads, which FFN columns and
# vocab rows each rank holds): decidable from the layout alone
LAYOUT_FAULTS: frozenset[str] = frozenset({"gcd-naive-gqa", "dcp-tp-kv-layout", "vocab-shard-offset",
                                           "ffn-floor-split"})
# the layout faults in splits the hybrid planner makes itself (KV layout under DCP, FFN and vocab offsets)
DENSE_PLAN_FAULTS: frozenset[str] = frozenset({"dcp-tp-kv-layout", "ffn-floor-split", "vocab-shard-offset"})


def faulty_layout(spec: ModelSpec, tp: int, dcp: int, flags: FaultEffects, placement: Placement = ROUND_ROBIN,
                  q_replicated: bool = False) -> LayoutPlan:
    """The attention layout an engine with `flags` uses (the correct one unless a fault replaces a split)."""
    return plan_layout(spec.attention_shape, tp, dcp, kv_dcp=flags.kv_layout_dcp, ffn_floor=flags.ffn_floor_split,
                       vocab_floor_offset=flags.vocab_floor_offset, placement=placement, q_replicated=q_replicated)


def _held(plan: LayoutPlan, naive: bool) -> list[tuple[tuple[int, ...], tuple[int, int], tuple[int, int]]]:
    """Per rank: the global KV head each Q head of its DCP group reads, its FFN columns and vocab rows."""
    return [(tuple(r.kv_heads[j] for j in group_kv_slots(r, naive)), r.ffn_shard, r.vocab_shard) for r in plan.ranks]


def layout_inert(site: FaultSite) -> str | None:
    """A layout fault is inert where every rank reads and holds what the correct layout gives it."""
    if site.fault not in LAYOUT_FAULTS:
        return None
    spec, topo = site.spec, site.topology
    if _held(faulty_layout(spec, topo.tp, topo.dcp, site.flags), site.flags.naive_gqa) != _held(
            plan_layout(spec.attention_shape, topo.tp, topo.dcp), False):
        return None
    return site.inert(f"every Q head reads the same KV head and every rank holds the same FFN columns and vocab "
                      f"rows as in the correct layout (heads={spec.heads}, kv_heads={spec.kv_heads}, ffn={spec.ffn}, "
                      f"vocab={spec.vocab}, tp={topo.tp})")


@dataclass(frozen=True)
class GatedPlan:
    """The layer pattern of a hybrid model and its gated attention's Q projection rows per rank."""

    kinds: tuple[str, ...]
    output_gate: bool
    q_proj_rows: tuple[tuple[tuple[int, int], ...], ...]


class Attention(Component):
    """Dense multi-head / grouped-query attention with decode context parallel (layout.py)."""

    name: ClassVar[str] = "attention"
    engine_module: ClassVar[str] = "harness.engine.layers.dense"
    report_fields: ClassVar[tuple[str, ...]] = ATTENTION_FIELDS

    def plan(self, spec: ModelSpec, topo: Topology) -> dict[str, Any]:
        return {"attention": plan_layout(spec.attention_shape, topo.tp, topo.dcp, placement=topo.placement,
                                         q_replicated=topo.q_replicated)}

    def inert_reason(self, site: FaultSite) -> str | None:
        return layout_inert(site)


class LatentAttention(Component):
    """Multi-head latent attention (DeepSeek-V2 style): one latent row per token shared by every head
    (mla_layout.py), Q split or replicated over the DCP group."""

    name: ClassVar[str] = "mla"
    engine_module: ClassVar[str] = "harness.engine.layers.mla"
    report_fields: ClassVar[tuple[str, ...]] = ATTENTION_FIELDS + ("q_mode", "q_weight_heads", "q_weight_checksums",
                                                                   "latent_dim", "kv_bytes_per_token")
    faults: ClassVar[frozenset[str]] = frozenset({"mla-rope-local-slot", "q-replicated-own-slice"})

    def plan(self, spec: ModelSpec, topo: Topology) -> dict[str, Any]:
        mla = plan_mla(spec.attention_shape, spec.mla_shape, topo.tp, topo.dcp, topo.placement, topo.q_replicated)
        return {"attention": mla.base, "latent": mla}

    def inert_reason(self, site: FaultSite) -> str | None:
        return layout_inert(site)

    # exported as DeepSeek-V2 (harness/formats/hf/deepseek.py): no refusal


class SparseAttention(Component):
    """Sparse attention with a lightning indexer (DeepSeek-V3.2 DSA style): dense/GQA attention that reads
    only the indexer's top-k tokens per query; the indexer heads split over TP, its key rows follow the
    DCP token placement, its query rows are selected in shards over the DCP group (sparse_layout.py)."""

    name: ClassVar[str] = "sparse_attention"
    engine_module: ClassVar[str] = "harness.engine.layers.sparse"
    report_fields: ClassVar[tuple[str, ...]] = ATTENTION_FIELDS + ("sparse",)
    layout_check: ClassVar[str] = "sparse"  # attention, indexer, cache groups and the selection trace
    faults: ClassVar[frozenset[str]] = frozenset({"dsa-local-topk", "dsa-indexer-offset", "dsa-sinks-evicted",
                                                  "dsa-planner-rows", "dsa-groups-unaligned",
                                                  "dsa-indexer-weights-offset"})

    def __init__(self, shape: SparseShape) -> None:
        self.shape = shape

    def plan(self, spec: ModelSpec, topo: Topology) -> dict[str, Any]:
        attention = plan_layout(spec.attention_shape, topo.tp, topo.dcp, placement=topo.placement,
                                q_replicated=topo.q_replicated)  # refuses Q replicated without a latent
        return {"attention": attention, "indexer": plan_sparse(self.shape, attention)}

    def inert_reason(self, site: FaultSite) -> str | None:
        if site.fault == "dsa-sinks-evicted" and not self.shape.index_sinks:
            return site.inert("the model keeps no sink tokens (index_sinks=0)", at_topology=False)
        return layout_inert(site)

    def export_refusal(self, spec: ModelSpec) -> str | None:
        return (f"model {spec.name!r} has sparse attention (an indexer): harness export writes Llama/Qwen2 "
                f"folders only")

    def served_refusal(self, spec: ModelSpec, engine: str) -> str | None:
        return "a synthetic sparse-attention model cannot be exported for it"


def check_hybrid_dcp(spec: ModelSpec, placement: Placement, q_replicated: bool) -> None:
    """A hybrid model's attention layers run round-robin DCP with Q split by TP; raise for anything else."""
    if placement != ROUND_ROBIN or q_replicated:
        raise ConfigError(f"model {spec.name} is a hybrid model: its attention layers run round-robin DCP with "
                          f"Q split by TP only (got placement {placement.label}"
                          f"{', Q replicated' if q_replicated else ''})")


class GatedAttention(Component):
    """The full-attention layers of a hybrid model (every full_attention_interval-th layer), with an
    output gate split with Q (hybrid_layout.py); they alone hold KV pages."""

    name: ClassVar[str] = "gated_attention"
    engine_module: ClassVar[str] = "harness.engine.layers.hybrid"
    report_fields: ClassVar[tuple[str, ...]] = ATTENTION_FIELDS
    layout_check: ClassVar[str] = "hybrid"  # attention, linear attention, MoE and cache groups together
    takes_dp: ClassVar[bool] = True  # each DP rank holds the whole attention (replicate_dp)

    def __init__(self, shape: HybridShape) -> None:
        self.shape = shape

    def plan(self, spec: ModelSpec, topo: Topology) -> dict[str, Any]:
        tp = topo.tp // topo.dp  # the attention's TP inside one DP rank
        validate(spec.attention_shape, tp, topo.dcp)
        validate_q_mode(spec.attention_shape, topo.dcp, topo.q_replicated)
        check_hybrid_dcp(spec, topo.placement, topo.q_replicated)
        h = self.shape
        attn_shape = full_attention_shape(spec.attention_shape, h)
        if not attn_shape.layers:
            raise ConfigError(f"hybrid: layers={spec.layers} with full_attention_interval="
                              f"{h.full_attention_interval} has no full-attention layer")
        attention = replicate_dp(plan_layout(attn_shape, tp, topo.dcp), topo.dp)
        rows = tuple(q_proj_rows(spec.head_dim, r.q_heads, h.attn_output_gate) for r in attention.ranks)
        gated = GatedPlan(kinds=layer_kinds(spec.layers, h.full_attention_interval),
                          output_gate=h.attn_output_gate, q_proj_rows=rows)
        return {"attention": attention, "gated": gated}

    def inert_reason(self, site: FaultSite) -> str | None:
        if site.fault in DENSE_PLAN_FAULTS:
            return site.inert("the hybrid planner makes this split without the fault's rule", at_topology=False)
        return layout_inert(site)

    def export_refusal(self, spec: ModelSpec) -> str | None:
        """Exported as Qwen3-Next (harness/formats/hf/qwen3_next.py) where the model computes Qwen3-Next's function."""
        h = self.shape
        missing = [what for what, ok in (("q_norm/k_norm (qk_norm: true)", h.qk_norm),
                                         ("an output gate (attn_output_gate: true)", h.attn_output_gate),
                                         ("routed experts (experts > 0)", h.experts > 0),
                                         ("a shared expert (shared_ffn > 0)", h.shared_ffn > 0),
                                         ("no redundant experts (redundant_experts: 0)", not h.redundant_experts))
                   if not ok]
        if not missing:
            return None
        return (f"model {spec.name!r} is hybrid but not Qwen3-Next's function, which harness export writes: "
                f"Qwen3-Next has {', '.join(missing)}; export a hybrid model that has them (e.g. tiny-qwen3next)")

    def served_refusal(self, spec: ModelSpec, engine: str) -> str | None:
        if spec.source != "synthetic":
            return None
        return self.export_refusal(spec)


class MoE(Component):
    """Mixture of experts with expert parallel: experts over ep ranks, their columns over tp // ep."""

    name: ClassVar[str] = "moe"
    engine_module: ClassVar[str] = "harness.engine.layers.moe"
    report_fields: ClassVar[tuple[str, ...]] = ("hybrid.moe",)
    takes_ep: ClassVar[bool] = True
    takes_dp: ClassVar[bool] = True  # tokens of every DP rank gathered (padded) for the experts
    faults: ClassVar[frozenset[str]] = frozenset({"moe-shared-every-rank", "moe-expert-offset",
                                                  "moe-router-local-renorm", *DP_FAULTS, "redundant-expert-twice"})

    def __init__(self, shape: HybridShape | MoeShape) -> None:
        self.shape = shape

    def plan(self, spec: ModelSpec, topo: Topology) -> dict[str, Any]:
        return {"moe": plan_moe(self.shape, topo.tp, topo.ep, topo.dp)}

    def inert_reason(self, site: FaultSite) -> str | None:
        h, topo, moe = self.shape, site.topology, site.parts["moe"]
        if site.fault == "moe-shared-every-rank" and (not h.shared_ffn or topo.tp == 1):
            return site.inert("one rank or no shared expert")
        if site.fault in DP_FAULTS and topo.dp == 1:
            return site.inert("no attention data parallel (dp=1): every rank holds every token")
        if site.fault == "dp-shared-unreduced" and not h.shared_ffn:
            return site.inert("no shared expert")
        if site.fault == "redundant-expert-twice":
            return _redundant_inert(site, moe)
        if site.fault == "moe-expert-offset":  # the fault offsets expert ids by the tp rank, not the EP rank
            per = moe.physical // moe.ep
            wrong = [tuple((r.rank * per + j) % moe.physical for j in range(per)) for r in moe.ranks]
            if all(w == experts_of(moe.physical, r.ep_rank, moe.ep) for w, r in zip(wrong, moe.ranks)):
                return site.inert(f"the tp rank offsets the expert ids as the EP rank does (ep={moe.ep}, "
                                  f"tp={topo.tp})")
        if site.fault == "moe-router-local-renorm" and topo.ep == 1:
            return site.inert("every rank holds every expert (ep=1)")
        return None


def _redundant_inert(site: FaultSite, moe: MoePlan) -> str | None:
    """A local-first replica pick counts an expert twice only where two EP ranks hold replicas of it."""
    emap = moe.expert_map
    if emap is None:
        return site.inert("no redundant experts (redundant_experts=0): each expert has one physical slot")
    ep_of = {p: r.ep_rank for r in moe.ranks for p in r.experts}
    if all(len({ep_of[p] for p in emap.replicas(lg)}) == 1 for lg in range(emap.experts)):
        return site.inert(f"the replicas of each expert are on one EP rank (ep={moe.ep})")
    return None


class GatedDeltaNet(Component):
    """Linear attention (Gated DeltaNet): V heads over the KV-parallel ranks, conv and recurrent state
    kept whole under DCP (hybrid_layout.py)."""

    name: ClassVar[str] = "linear_attention"
    engine_module: ClassVar[str] = "harness.engine.layers.deltanet"
    report_fields: ClassVar[tuple[str, ...]] = ("hybrid.linear", "hybrid.cache_groups")
    prefix_cacheable: ClassVar[bool] = False  # the recurrent state of a position is not kept: no prefix hits
    takes_dp: ClassVar[bool] = True  # each DP rank holds every linear head for its own requests
    faults: ClassVar[frozenset[str]] = frozenset({"deltanet-packed-split", "deltanet-state-dcp-split",
                                                  "cache-groups-own-budget", "state-slot-stale", "pd-state-conv-shift",
                                                  "pd-state-same-rank"})

    def __init__(self, shape: HybridShape) -> None:
        self.shape = shape

    def plan(self, spec: ModelSpec, topo: Topology) -> dict[str, Any]:
        kinds = layer_kinds(spec.layers, self.shape.full_attention_interval)
        linear = plan_linear(self.shape, kinds.count(LINEAR), topo.tp // topo.dp, topo.dcp)
        return {"linear": replicate_linear_dp(linear, topo.dp) if topo.dp > 1 else linear}

    def inert_reason(self, site: FaultSite) -> str | None:
        contiguous = site.flags.linear_packed_contiguous
        if site.fault == "deltanet-packed-split" and all(
                loaded_rows(self.shape, r, contiguous) == r.conv_rows for r in site.parts["linear"].ranks):
            return site.inert("every rank's contiguous slice of the packed rows is its per-component rows (one "
                              "group of linear heads)")
        return None


class Speculator(Component):
    """The draft / MTP module: the target's head layout with speculator_layers layers, on the plain TP
    layout (it is not part of the DCP group). `copies_target`: its layers start as copies of the
    target's first layers (else seeded dense layers: a hybrid target's layers are not attention)."""

    name: ClassVar[str] = "speculator"
    engine_module: ClassVar[str] = "harness.engine.speculative.speculator"
    report_fields: ClassVar[tuple[str, ...]] = ATTENTION_FIELDS

    def __init__(self, copies_target: bool = True, deepseek_mtp: bool = False) -> None:
        self.copies_target = copies_target
        # DeepSeek-V3's MTP (an MLA target's, as vLLM and SGLang run it): it reads the target's final-normed hidden
        # state (its own shared-head-normed output in a proposal chain) and its first entry (the target's hidden
        # state at position 0) has its token embedding zeroed; else the harness's: the residual states as they are
        self.deepseek_mtp = deepseek_mtp

    def plan(self, spec: ModelSpec, topo: Topology) -> dict[str, Any]:
        return {"speculator": plan_speculator(spec.speculator_shape, topo.tp)}
