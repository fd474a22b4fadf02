"""The hybrid-model planner: linear-attention (Gated DeltaNet) layers, gated attention, MoE with expert
parallel, and grouped cache capacity. Head and column math comes from harness/partition/layout.py.

Rules (docs/architecture.md, Layout math; docs/suites-models.md, the hybrid model):
- Layer i is full (gated) attention when (i + 1) % full_attention_interval == 0, else linear attention.
- Linear-attention layers use the KV-parallel split of the full-attention layers: their V heads are
  split over kv_tp_size = tp // dcp ranks with kv_tp_rank = tp_rank // dcp, and V heads not divisible by
  kv_tp_size are duplicated by the GCD rule (g = gcd(v_heads, kv_tp_size); groups of kv_tp_size / g ranks
  hold the same v_heads / g heads). The ranks of one DCP group compute the same linear heads and keep
  their conv and recurrent state whole: the state is never split by token, so it is identical across
  the group.
- V head v reads K head v // (v_heads / k_heads) (global ids); a rank holds the K heads its V heads read.
- The packed in_proj / conv1d rows are [q (k_heads x Dk) | k (k_heads x Dk) | v (v_heads x Dv)]; a rank
  takes its rows per component (its K heads' q and k rows, its V heads' v rows), never one contiguous
  slice of the packed rows.
- A duplicated V head's output projection is added by one rank only (the lowest rank holding it), so
  the TP all-reduce counts it once.
- Gated attention: the Q projection also yields an output gate per head ([heads, 2 * head_dim] rows:
  q then gate), split with Q, so each rank holds q_heads x head_dim x 2 rows.
- MoE: ep divides tp; etp = tp // ep. Rank r is EP rank r // etp and expert-TP rank r % etp; the EP
  group of rank r is the ep ranks with its etp rank (r % etp, r % etp + etp, ...), the expert-TP group
  the etp consecutive ranks of its EP rank. EP rank e holds experts [e * n / ep, (e + 1) * n / ep),
  each expert's FFN columns split over the etp ranks by layout.ffn_shard. ep = 1 is plain TP MoE.
  The shared expert is one dense FFN split by tp over every rank (counted once in the all-reduce).
- Grouped cache capacity: every cache group (attention KV pages, recurrent-state slots, the MTP head's
  pages) is sized from one slot count: slots = budget // (sum over groups of blocks_per_seq x
  block_bytes); each group holds slots x its blocks_per_seq blocks. A budget that cannot hold one slot
  is one error naming each group's share of the shortfall.

All functions are pure; invalid configurations raise one ConfigError naming the numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from harness.core.errors import ConfigError
from harness.partition.cache_groups import CacheGroup
from harness.partition.expert_map import ExpertMap, expert_map
from harness.partition.layout import (
    AttentionShape,
    LayoutPlan,
    dcp_members_of,
    ffn_shard,
    kv_heads_of,
    kv_of_q,
    plan_layout,
    plan_speculator,
)

LINEAR, FULL = "linear", "full"


@dataclass(frozen=True)
class HybridShape:
    """The hybrid part of a model spec (the `hybrid:` mapping of a model YAML)."""

    linear_k_heads: int
    linear_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    full_attention_interval: int = 4
    conv_kernel: int = 4
    attn_output_gate: bool = True
    experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0
    state_dtype_bytes: int = 4  # conv and recurrent state are kept in float32
    redundant_experts: int = 0  # physical replicas beyond the logical experts (expert_map.py)
    qk_norm: bool = False  # per-head RMSNorm of the gated attention's q and k before RoPE (Qwen3-Next's q_norm/k_norm)

    def __post_init__(self) -> None:
        for name in ("linear_k_heads", "linear_v_heads", "linear_k_dim", "linear_v_dim",
                     "full_attention_interval", "conv_kernel", "state_dtype_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"hybrid: {name} must be a positive integer, got {value!r}")
        if not isinstance(self.qk_norm, bool):
            raise ConfigError(f"hybrid: qk_norm must be true or false, got {self.qk_norm!r}")
        for name in ("experts", "top_k", "moe_ffn", "shared_ffn", "redundant_experts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"hybrid: {name} must be a non-negative integer, got {value!r}")
        if self.linear_v_heads % self.linear_k_heads:
            raise ConfigError(f"hybrid: linear_v_heads={self.linear_v_heads} is not divisible by "
                              f"linear_k_heads={self.linear_k_heads}")
        if self.experts and not (1 <= self.top_k <= self.experts and self.moe_ffn):
            raise ConfigError(f"hybrid: experts={self.experts} needs 1 <= top_k <= experts and moe_ffn > 0, "
                              f"got top_k={self.top_k}, moe_ffn={self.moe_ffn}")
        if not self.experts and (self.top_k or self.moe_ffn or self.shared_ffn or self.redundant_experts):
            raise ConfigError(f"hybrid: top_k={self.top_k}, moe_ffn={self.moe_ffn}, shared_ffn={self.shared_ffn}, "
                              f"redundant_experts={self.redundant_experts} need experts > 0")

    @property
    def v_per_k(self) -> int:
        return self.linear_v_heads // self.linear_k_heads

    @property
    def conv_channels(self) -> int:
        """Rows of the packed q|k|v block of in_proj (and channels of the conv1d)."""
        return 2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim

    def to_dict(self) -> dict[str, Any]:
        """The fields; redundant_experts and qk_norm only when set (models without them keep their dict and cache
        keys)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__
                if name not in ("redundant_experts", "qk_norm") or getattr(self, name)}


@dataclass(frozen=True)
class MoeShape:
    """The experts of a model whose attention is not hybrid (DeepSeek-V2/V3: MLA + MoE): `experts` routed experts
    of `moe_ffn` columns, top_k per token, a shared expert of `shared_ffn` columns (0: none), the first
    `first_dense` layers dense (the `moe:` mapping of a model spec; read from a DeepSeek config.json).
    `renormalize`: the top-k routing weights rescaled to sum to 1 (DeepSeek's norm_topk_prob; DeepSeek-V2 has it
    off: each routed expert's weight is its softmax probability over all experts)."""

    experts: int
    top_k: int
    moe_ffn: int
    shared_ffn: int = 0
    first_dense: int = 0
    redundant_experts: int = 0  # physical replicas beyond the logical experts (expert_map.py)
    renormalize: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.renormalize, bool):
            raise ConfigError(f"moe: renormalize must be true or false, got {self.renormalize!r}")
        for name in self.__dataclass_fields__:
            if name == "renormalize":
                continue
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"moe: {name} must be a non-negative integer, got {value!r}")
        if not (1 <= self.top_k <= self.experts and self.moe_ffn):
            raise ConfigError(f"moe: experts={self.experts} needs 1 <= top_k <= experts and moe_ffn > 0, "
                              f"got top_k={self.top_k}, moe_ffn={self.moe_ffn}")

    def to_dict(self) -> dict[str, Any]:
        """The fields; redundant_experts only when set, renormalize only when off (models without them keep their
        dict and cache keys)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__
                if (name != "redundant_experts" or self.redundant_experts) and (name != "renormalize"
                                                                                 or not self.renormalize)}


def layer_kinds(layers: int, interval: int) -> tuple[str, ...]:
    """`full` for every interval-th layer (1-based), `linear` for the others."""
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers))


# ---- linear attention ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearRank:
    """One rank's linear-attention shard (global ids), the same in every linear layer."""

    rank: int
    kv_tp_rank: int
    dcp_members: tuple[int, ...]
    v_heads: tuple[int, ...]
    k_heads: tuple[int, ...]
    v_to_local_k: tuple[int, ...]
    out_v_heads: tuple[int, ...]  # V heads whose output projection this rank adds (each head once)
    conv_rows: tuple[tuple[int, int], ...]  # [lo, hi) rows of the packed q|k|v block, per component
    conv_state_bytes: int  # per layer per sequence
    recurrent_state_bytes: int  # per layer per sequence: v_heads x Dk x Dv

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "kv_tp_rank": self.kv_tp_rank, "dcp_members": list(self.dcp_members),
                "v_heads": list(self.v_heads), "k_heads": list(self.k_heads),
                "v_to_local_k": list(self.v_to_local_k), "out_v_heads": list(self.out_v_heads),
                "conv_rows": [list(r) for r in self.conv_rows], "conv_state_bytes": self.conv_state_bytes,
                "recurrent_state_bytes": self.recurrent_state_bytes}


@dataclass(frozen=True)
class LinearPlan:
    tp: int
    dcp: int
    kv_tp_size: int
    v_gcd: int
    layers: int
    ranks: tuple[LinearRank, ...]
    v_replicas: tuple[int, ...]
    dp: int = 1  # attention data parallel: each DP rank holds (and adds) every V head of its own requests

    @property
    def state_bytes_per_seq_per_rank(self) -> int:
        """Conv + recurrent state of every linear layer for one sequence on one rank."""
        r = self.ranks[0]
        return self.layers * (r.conv_state_bytes + r.recurrent_state_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {"tp": self.tp, "dcp": self.dcp, "kv_tp_size": self.kv_tp_size, "v_gcd": self.v_gcd,
                "layers": self.layers, "ranks": [r.to_dict() for r in self.ranks],
                "v_replicas": list(self.v_replicas), **({"dp": self.dp} if self.dp > 1 else {}),
                "state_bytes_per_seq_per_rank": self.state_bytes_per_seq_per_rank}


def _v_shape(h: HybridShape) -> AttentionShape:
    """V heads seen as the 'Q heads' and K heads as the 'KV heads' of layout.py's rules."""
    return AttentionShape(heads=h.linear_v_heads, kv_heads=h.linear_k_heads, head_dim=h.linear_v_dim,
                          layers=1, dtype_bytes=h.state_dtype_bytes)


def linear_v_heads_of(h: HybridShape, kv_tp_rank: int, kv_tp_size: int) -> tuple[int, ...]:
    """V heads of KV-parallel rank `kv_tp_rank`: contiguous shares, GCD-duplicated when uneven."""
    as_kv = AttentionShape(heads=h.linear_v_heads, kv_heads=h.linear_v_heads, head_dim=h.linear_v_dim,
                           layers=1, dtype_bytes=h.state_dtype_bytes)
    return kv_heads_of(as_kv, kv_tp_rank, kv_tp_size)


def component_rows(h: HybridShape, k_heads: tuple[int, ...], v_heads: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """[lo, hi) rows of the packed q|k|v block held for these heads: q rows, k rows, v rows (heads are
    contiguous, so one range per component)."""
    kd, vd, nk = h.linear_k_dim, h.linear_v_dim, h.linear_k_heads
    k_lo, k_hi = k_heads[0], k_heads[-1] + 1
    v_lo, v_hi = v_heads[0], v_heads[-1] + 1
    return ((k_lo * kd, k_hi * kd), (nk * kd + k_lo * kd, nk * kd + k_hi * kd),
            (2 * nk * kd + v_lo * vd, 2 * nk * kd + v_hi * vd))


def contiguous_rows(h: HybridShape, rank_rows: int, index: int) -> tuple[int, int]:
    """The buggy split (fault deltanet-packed-split): rank `index` takes the `index`-th contiguous slice
    of `rank_rows` rows of the packed q|k|v block, as a plain column-parallel linear would."""
    return (index * rank_rows, min((index + 1) * rank_rows, h.conv_channels))


def loaded_rows(h: HybridShape, lin: LinearRank, contiguous: bool) -> tuple[tuple[int, int], ...]:
    """The packed q|k|v rows a rank loads: per component as planned, or (`contiguous`, fault
    deltanet-packed-split) one contiguous slice of the same size, at the index of its group of V heads."""
    if not contiguous:
        return lin.conv_rows
    size = sum(hi - lo for lo, hi in lin.conv_rows)
    return (contiguous_rows(h, size, lin.v_heads[0] // len(lin.v_heads)),)


def plan_linear(h: HybridShape, layers: int, tp: int, dcp: int = 1) -> LinearPlan:
    """The linear-attention shard of every rank (tp ranks, decode context parallel dcp)."""
    if tp < 1 or dcp < 1 or tp % dcp:
        raise ConfigError(f"linear attention: dcp={dcp} does not divide tp={tp}")
    kv_tp_size = tp // dcp
    vshape = _v_shape(h)
    ranks = []
    first_holder: dict[int, int] = {}
    for rank in range(tp):
        kv_tp_rank = rank // dcp
        v_heads = linear_v_heads_of(h, kv_tp_rank, kv_tp_size)
        k_heads = tuple(dict.fromkeys(kv_of_q(vshape, v) for v in v_heads))
        for v in v_heads:
            first_holder.setdefault(v, rank)
        rows = component_rows(h, k_heads, v_heads)
        channels = sum(hi - lo for lo, hi in rows)
        ranks.append(LinearRank(
            rank=rank, kv_tp_rank=kv_tp_rank, dcp_members=dcp_members_of(rank, dcp), v_heads=v_heads,
            k_heads=k_heads, v_to_local_k=tuple(k_heads.index(kv_of_q(vshape, v)) for v in v_heads),
            out_v_heads=(), conv_rows=rows,
            conv_state_bytes=channels * (h.conv_kernel - 1) * h.state_dtype_bytes,
            recurrent_state_bytes=len(v_heads) * h.linear_k_dim * h.linear_v_dim * h.state_dtype_bytes))
    ranks = [replace(r, out_v_heads=tuple(v for v in r.v_heads if first_holder[v] == r.rank)) for r in ranks]
    replicas = tuple(sum(v in r.v_heads for r in ranks) for v in range(h.linear_v_heads))
    return LinearPlan(tp=tp, dcp=dcp, kv_tp_size=kv_tp_size, v_gcd=math.gcd(h.linear_v_heads, kv_tp_size),
                      layers=layers, ranks=tuple(ranks), v_replicas=replicas)


def replicate_linear_dp(plan: LinearPlan, dp: int) -> LinearPlan:
    """Attention data parallel: one DP rank's linear-attention plan held by each of dp DP ranks (rank
    d * n + j holds what rank j holds); each DP rank adds its V heads' output for its own requests."""
    n = len(plan.ranks)
    ranks = tuple(replace(r, rank=d * n + r.rank, dcp_members=tuple(d * n + m for m in r.dcp_members))
                  for d in range(dp) for r in plan.ranks)
    return replace(plan, tp=n * dp, ranks=ranks, v_replicas=tuple(v * dp for v in plan.v_replicas), dp=dp)


# ---- gated attention ----------------------------------------------------------------------------


def q_proj_rows(head_dim: int, q_heads: tuple[int, ...], output_gate: bool) -> tuple[tuple[int, int], ...]:
    """[lo, hi) rows of the Q projection held for these global Q heads; with an output gate every head
    has 2 x head_dim rows (q then gate), so the gate is split with Q."""
    per_head = head_dim * (2 if output_gate else 1)
    return tuple((q * per_head, (q + 1) * per_head) for q in q_heads)


# ---- MoE ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeRank:
    rank: int
    ep_rank: int
    etp_rank: int
    ep_members: tuple[int, ...]
    etp_members: tuple[int, ...]
    experts: tuple[int, ...]  # physical expert slots (the logical experts when there are no replicas)
    expert_ffn_shard: tuple[int, int]
    shared_ffn_shard: tuple[int, int]
    logical: tuple[int, ...] = ()  # the logical expert of each of its physical slots

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "ep_rank": self.ep_rank, "etp_rank": self.etp_rank,
                "ep_members": list(self.ep_members), "etp_members": list(self.etp_members),
                "experts": list(self.experts), "expert_ffn_shard": list(self.expert_ffn_shard),
                "shared_ffn_shard": list(self.shared_ffn_shard),
                **({"logical": list(self.logical)} if self.logical != self.experts else {})}


@dataclass(frozen=True)
class MoePlan:
    tp: int
    ep: int
    etp: int
    experts: int
    top_k: int
    ranks: tuple[MoeRank, ...]
    shared_ffn: int = 0
    expert_map: ExpertMap | None = None  # None: no replicas (physical slot = logical expert)
    dp: int = 1  # attention data parallel ranks: tokens gathered from them for the MoE, padded (padding_rule)

    @property
    def physical(self) -> int:
        return self.expert_map.physical if self.expert_map is not None else self.experts

    @property
    def expert_replicas(self) -> tuple[int, ...]:
        """How many ranks hold (a column shard of) each physical expert slot: etp."""
        return tuple(sum(e in r.experts for r in self.ranks) for e in range(self.physical))

    @property
    def padding_rule(self) -> str:
        if self.dp == 1:
            return "every rank holds every token (no DP): no padding"
        return (f"each of the {self.dp} DP ranks pads its tokens to the largest DP rank's count m (the global "
                f"padded count) and the world gathers [dp x m] rows; row j of DP rank d is a real token iff "
                f"j < count[d]; an idle DP rank (no request) sends one dummy token routed to no expert "
                f"(top-k id -1), the rest padding; padding and dummy rows are dropped before the combine")

    def to_dict(self) -> dict[str, Any]:
        # the DP and expert-map keys only where they are used (other plans keep their documents)
        extra = {"dp": self.dp, "padding_rule": self.padding_rule} if self.dp > 1 else {}
        if self.expert_map is not None:
            extra.update(physical=self.physical, expert_map=self.expert_map.to_dict())
        return {"tp": self.tp, "ep": self.ep, "etp": self.etp, "experts": self.experts, "top_k": self.top_k,
                "shared_ffn": self.shared_ffn, **extra,
                "ranks": [r.to_dict() for r in self.ranks], "expert_replicas": list(self.expert_replicas)}


def experts_of(experts: int, ep_rank: int, ep: int) -> tuple[int, ...]:
    per = experts // ep
    return tuple(range(ep_rank * per, (ep_rank + 1) * per))


def plan_moe(h: HybridShape | MoeShape, tp: int, ep: int = 1, dp: int = 1) -> MoePlan:
    """Expert placement over ep ranks inside the tp world, expert columns over etp = tp // ep; with
    redundant experts the physical slots (expert_map.py) are placed; dp: the attention DP ranks whose
    tokens the MoE gathers (its padding rule)."""
    if not h.experts:
        raise ConfigError(f"ep={ep}: the model has no experts (hybrid.experts=0)")
    if tp < 1 or ep < 1 or tp % ep:
        raise ConfigError(f"ep={ep} does not divide the world tp={tp}")
    emap = expert_map(h.experts, h.redundant_experts) if h.redundant_experts else None
    physical = h.experts + h.redundant_experts
    if physical % ep:
        what = (f"experts={h.experts} + redundant_experts={h.redundant_experts} = {physical} physical slots"
                if h.redundant_experts else f"experts={h.experts}")
        raise ConfigError(f"{what} is not divisible by ep={ep}; valid ep: "
                          f"{[e for e in range(1, tp + 1) if tp % e == 0 and physical % e == 0]}")
    etp = tp // ep
    if h.moe_ffn < etp:
        raise ConfigError(f"moe_ffn={h.moe_ffn} is smaller than etp={etp}: some rank would hold no expert columns")
    if h.shared_ffn and h.shared_ffn < tp:
        raise ConfigError(f"shared_ffn={h.shared_ffn} is smaller than tp={tp}")
    ranks = []
    for rank in range(tp):
        ep_rank, etp_rank = rank // etp, rank % etp
        ranks.append(MoeRank(
            rank=rank, ep_rank=ep_rank, etp_rank=etp_rank,
            ep_members=tuple(range(etp_rank, tp, etp)),
            etp_members=tuple(range(ep_rank * etp, (ep_rank + 1) * etp)),
            experts=experts_of(physical, ep_rank, ep),
            expert_ffn_shard=ffn_shard(h.moe_ffn, etp_rank, etp),
            shared_ffn_shard=ffn_shard(h.shared_ffn, rank, tp) if h.shared_ffn else (0, 0),
            logical=tuple(emap.slot_logical[p] if emap else p for p in experts_of(physical, ep_rank, ep))))
    return MoePlan(tp=tp, ep=ep, etp=etp, experts=h.experts, top_k=h.top_k, ranks=tuple(ranks),
                   shared_ffn=h.shared_ffn, expert_map=emap, dp=dp)


# ---- grouped cache capacity ---------------------------------------------------------------------


def hybrid_cache_groups(attn: LayoutPlan, linear: LinearPlan, speculator: LayoutPlan | None, max_seq_len: int,
                        block_size: int) -> tuple[CacheGroup, ...]:
    """The cache groups of one rank: attention KV pages (full-attention layers, the rank's
    ceil(max_seq_len / dcp) tokens), one recurrent-state block per sequence (all linear layers, kept
    whole under DCP) and, with an MTP head, its KV pages (plain TP layout, every token)."""
    if block_size < 1 or max_seq_len < 1:
        raise ConfigError(f"block_size={block_size} and max_seq_len={max_seq_len} must be positive")
    groups = []
    if attn.shape.layers:
        tokens = -(-max_seq_len // attn.dcp)
        groups.append(CacheGroup("attention", -(-tokens // block_size),
                                 block_size * attn.kv_bytes_per_token_per_rank))
    if linear.layers:
        groups.append(CacheGroup("recurrent", 1, linear.state_bytes_per_seq_per_rank))
    if speculator is not None:
        groups.append(CacheGroup("mtp", -(-max_seq_len // block_size),
                                 block_size * speculator.kv_bytes_per_token_per_rank))
    return tuple(groups)


# ---- the whole plan -------------------------------------------------------------------------------


@dataclass(frozen=True)
class HybridPlan:
    kinds: tuple[str, ...]
    attention: LayoutPlan  # the full-attention layers (shape.layers = their count)
    linear: LinearPlan
    moe: MoePlan | None
    output_gate: bool
    q_proj_rows: tuple[tuple[tuple[int, int], ...], ...]  # per rank

    def to_dict(self) -> dict[str, Any]:
        return {"layer_kinds": list(self.kinds), "full_layers": self.attention.shape.layers,
                "output_gate": self.output_gate,
                "q_proj_rows": [[list(r) for r in rows] for rows in self.q_proj_rows],
                "linear": self.linear.to_dict(), "moe": self.moe.to_dict() if self.moe else None}


def full_attention_shape(shape: AttentionShape, h: HybridShape) -> AttentionShape:
    """The model's attention shape restricted to its full-attention layers (they alone hold KV pages)."""
    return replace(shape, layers=layer_kinds(shape.layers, h.full_attention_interval).count(FULL))


def plan_hybrid(shape: AttentionShape, h: HybridShape, tp: int, dcp: int = 1, ep: int = 1) -> HybridPlan:
    """Every per-rank shard of a hybrid model over (tp, dcp, ep)."""
    kinds = layer_kinds(shape.layers, h.full_attention_interval)
    attn_shape = full_attention_shape(shape, h)
    if not attn_shape.layers:
        raise ConfigError(f"hybrid: layers={shape.layers} with full_attention_interval={h.full_attention_interval} "
                          f"has no full-attention layer")
    attention = plan_layout(attn_shape, tp, dcp)
    if ep > 1 and not h.experts:
        raise ConfigError(f"ep={ep} needs a MoE model; hybrid.experts=0")
    moe = plan_moe(h, tp, ep) if h.experts else None
    return HybridPlan(kinds=kinds, attention=attention, linear=plan_linear(h, kinds.count(LINEAR), tp, dcp),
                      moe=moe, output_gate=h.attn_output_gate,
                      q_proj_rows=tuple(q_proj_rows(shape.head_dim, r.q_heads, h.attn_output_gate)
                                        for r in attention.ranks))


def plan_hybrid_speculator(shape: AttentionShape, speculator_layers: int, tp: int) -> LayoutPlan:
    """The MTP head: full (gated) attention layers on the plain TP layout (dcp = 1)."""
    return plan_speculator(replace(shape, layers=speculator_layers), tp)
