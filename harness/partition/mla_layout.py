"""The MLA (multi-head latent attention) part of the layout plan: pure functions over layout.py's plan.

MLA keeps one latent row per token (kv_lora_rank values plus the decoupled RoPE key of qk_rope_dim
values), shared by every head; layout.py plans it as a single KV head, so:
- under TP every rank holds the whole latent cache (duplication x tp), under DCP each DCP group stores
  each token's row once, on its owner (duplication x tp // dcp, one copy per group);
- Q heads are split by tp. With the weights absorbed (w_kc into the query, w_vc after the merge) a
  rank's queries live in latent space; in the default Q mode each rank projects its own heads'
  queries (its rows of q_b_proj and its heads' w_kc) and the DCP group all-gathers them; with Q
  replicated (Helix, SGLang's --dcp-replicate-q-proj) each rank holds q_b_proj and w_kc of every head
  of its DCP group, gathered once at load, and computes the group's queries itself: no gather.
All functions are pure; invalid configurations raise one ConfigError naming the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.core.errors import ConfigError
from harness.partition.layout import ROUND_ROBIN, AttentionShape, LayoutPlan, Placement, RankLayout, plan_layout

Q_MODES: tuple[str, ...] = ("split", "replicated")


@dataclass(frozen=True)
class MLAShape:
    """The MLA numbers beyond AttentionShape's (heads, layers, dtype, kv_lora_rank, qk_rope_dim, and
    head_dim as v_head_dim): where the query comes from and the no-RoPE query/key width."""

    q_lora_rank: int  # 0: q_proj straight from the hidden state
    qk_nope_dim: int
    hidden: int

    @property
    def q_in(self) -> int:
        """The width q_b_proj (or q_proj) reads: q_lora_rank, or the hidden size without a Q LoRA."""
        return self.q_lora_rank or self.hidden


@dataclass(frozen=True)
class MLARank:
    """What one rank holds of the attention: its Q heads, whose Q weights (q_b_proj rows and w_kc) it
    holds, and its latent cache per stored token."""

    rank: int
    q_heads: tuple[int, ...]
    q_weight_heads: tuple[int, ...]
    latent_bytes_per_token: int
    q_weight_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "q_heads": list(self.q_heads), "q_weight_heads": list(self.q_weight_heads),
                "latent_bytes_per_token": self.latent_bytes_per_token, "q_weight_bytes": self.q_weight_bytes}


@dataclass(frozen=True)
class MLAPlan:
    """The MLA view of a layout plan."""

    base: LayoutPlan
    mla: MLAShape
    q_replicated: bool
    ranks: tuple[MLARank, ...]

    @property
    def latent_dim(self) -> int:
        return self.base.shape.kv_lora_rank + self.base.shape.qk_rope_dim

    @property
    def latent_duplication(self) -> int:
        """Ranks holding each token's latent row: every rank under TP, one per DCP group under DCP."""
        return self.base.kv_duplication

    def to_dict(self) -> dict[str, Any]:
        s = self.base.shape
        return {"q_mode": "replicated" if self.q_replicated else "split", "kv_lora_rank": s.kv_lora_rank,
                "qk_rope_dim": s.qk_rope_dim, "qk_nope_dim": self.mla.qk_nope_dim, "q_lora_rank": self.mla.q_lora_rank,
                "q_in": self.mla.q_in, "v_head_dim": s.head_dim, "latent_dim": self.latent_dim,
                "latent_bytes_per_token_per_rank": self.base.kv_bytes_per_token_per_rank,
                "latent_duplication": self.latent_duplication, "ranks": [r.to_dict() for r in self.ranks]}


def q_weight_heads(rank: RankLayout, q_replicated: bool) -> tuple[int, ...]:
    """The heads whose Q weights (q_b_proj rows, w_kc) `rank` holds: its DCP group's when Q is
    replicated, else its own."""
    return rank.group_q_heads if q_replicated else rank.q_heads


def q_weight_bytes(shape: AttentionShape, mla: MLAShape, n_heads: int) -> int:
    """q_b_proj rows (qk_nope + qk_rope per head, q_in wide) and w_kc (qk_nope x kv_lora per head), every layer."""
    per_head = (mla.qk_nope_dim + shape.qk_rope_dim) * mla.q_in + mla.qk_nope_dim * shape.kv_lora_rank
    return shape.layers * n_heads * per_head * shape.dtype_bytes


def plan_mla(shape: AttentionShape, mla: MLAShape, tp: int, dcp: int = 1, placement: Placement = ROUND_ROBIN,
             q_replicated: bool = False) -> MLAPlan:
    """The MLA plan of `shape` over (tp, dcp): layout.py's plan with the latent as its one KV head, plus
    each rank's Q weights (its own heads, or its DCP group's under Q replication)."""
    if not shape.mla:
        raise ConfigError(f"plan_mla needs an MLA shape (kv_lora_rank > 0), got kv_lora_rank={shape.kv_lora_rank}")
    base = plan_layout(shape, tp, dcp, placement=placement, q_replicated=q_replicated)
    ranks = []
    for r in base.ranks:
        held = q_weight_heads(r, q_replicated)
        ranks.append(MLARank(rank=r.rank, q_heads=r.q_heads, q_weight_heads=held,
                             latent_bytes_per_token=base.kv_bytes_per_token_per_rank,
                             q_weight_bytes=q_weight_bytes(shape, mla, len(held))))
    return MLAPlan(base=base, mla=mla, q_replicated=q_replicated, ranks=tuple(ranks))
