"""Apply a layout plan to full weights: one rank's shard, its head map and its rank report.

Head assignment comes only from the layout planner; faults change which plan or mapping is used.
"""

from __future__ import annotations

import hashlib

import torch

from harness.arch.components import faulty_layout
from harness.engine.fault import FaultFlags
from harness.engine.layers.dense import HeadMap, LayerWeights, LocalWeights
from harness.partition.layout import ROUND_ROBIN, LayoutPlan, Placement, RankLayout, group_kv_slots
from harness.records.rankreport import (
    ExpertsReport,
    HybridReport,
    MLAReport,
    ParamShard,
    RankReport,
    SparseReport,
    StoredPositions,
)
from harness.specs.model import ModelSpec


def engine_plan(spec: ModelSpec, tp: int, dcp: int, flags: FaultFlags,
                placement: Placement = ROUND_ROBIN, q_replicated: bool = False) -> LayoutPlan:
    """The plan the engine actually uses (the correct one unless a fault replaces a split)."""
    return faulty_layout(spec, tp, dcp, flags, placement, q_replicated)


def head_map(rank: RankLayout, flags: FaultFlags) -> HeadMap:
    """Which local KV slot each of the DCP group's Q heads reads; global-index mapping unless naive."""
    n_q, n_kv = len(rank.q_heads), len(rank.kv_heads)
    group_map = group_kv_slots(rank, flags.naive_gqa)
    own = rank.group_q_heads.index(rank.q_heads[0])
    return HeadMap(n_q=n_q, n_kv=n_kv, group_q_to_local_kv=tuple(group_map), own_slice=(own, own + n_q))


def _rows(w: torch.Tensor, heads: tuple[int, ...], head_dim: int) -> torch.Tensor:
    """Rows of the given heads from a [n_heads * hd, ...] projection."""
    # [n_heads * hd, ...] -> [n_heads, hd, ...] -> selected heads -> [len(heads) * hd, ...]
    return w.view(-1, head_dim, *w.shape[1:])[list(heads)].reshape(len(heads) * head_dim, *w.shape[1:])


def vocab_rows(w: torch.Tensor, shard: tuple[int, int], rows: int) -> torch.Tensor:
    """Rows [lo, hi) of a [V, H] embedding / lm_head, zero-padded to `rows` rows -> [rows, H]."""
    lo, hi = shard
    out = w.new_zeros(rows, *w.shape[1:])
    out[: hi - lo] = w[lo:hi]
    return out


def o_heads(rank: RankLayout, heads: int, flags: FaultFlags) -> tuple[int, ...]:
    """The heads whose output-projection columns the rank loads: its own (o-proj-shard-offset: h + 1)."""
    if flags.o_proj_offset and len(rank.q_heads) < heads:
        return tuple((h + 1) % heads for h in rank.q_heads)
    return rank.q_heads


def mlp_norm_layer(rank: RankLayout, layer: int, layers: int, flags: FaultFlags) -> int:
    """The layer whose MLP input norm the rank loads for `layer` (mlp-norm-other-layer: the next one on
    ranks > 0)."""
    return (layer + 1) % layers if flags.mlp_norm_other_layer and rank.rank > 0 else layer


def shard_weights(full: dict[str, torch.Tensor], spec: ModelSpec, rank: RankLayout,
                  dtype: torch.dtype, device: torch.device, flags: FaultFlags = FaultFlags()) -> LocalWeights:
    """Column-parallel Q/K/V/gate/up, row-parallel o/down, vocab-parallel embedding and lm_head
    (rank.vocab_shard, padded to ceil(vocab / tp) rows); norms replicated."""
    hd = spec.head_dim
    lo, hi = rank.ffn_shard
    cast = lambda t: t.to(device=device, dtype=dtype).contiguous()  # noqa: E731
    layers = []
    for i in range(spec.layers):
        p = f"layers.{i}."
        bias = lambda name, heads: (cast(_rows(full[p + name], heads, hd))  # noqa: E731
                                    if p + name in full else None)
        layers.append(LayerWeights(
            attn_norm=cast(full[p + "attn_norm.weight"]),
            q=cast(_rows(full[p + "q.weight"], rank.q_heads, hd)),
            k=cast(_rows(full[p + "k.weight"], rank.kv_heads, hd)),
            v=cast(_rows(full[p + "v.weight"], rank.kv_heads, hd)),
            # o: [H, heads * hd] -> columns of own heads
            o=cast(_rows(full[p + "o.weight"].T, o_heads(rank, spec.heads, flags), hd).T),
            mlp_norm=cast(full[f"layers.{mlp_norm_layer(rank, i, spec.layers, flags)}.mlp_norm.weight"]),
            gate=cast(full[p + "gate.weight"][lo:hi]),
            up=cast(full[p + "up.weight"][lo:hi]),
            down=cast(full[p + "down.weight"][:, lo:hi]),
            q_bias=bias("q.bias", rank.q_heads), k_bias=bias("k.bias", rank.kv_heads),
            v_bias=bias("v.bias", rank.kv_heads)))
    embed = cast(vocab_rows(full["embed.weight"], rank.vocab_shard, rank.vocab_rows))
    lm_head = (embed if "lm_head.weight" not in full  # tied: the same shard serves both
               else cast(vocab_rows(full["lm_head.weight"], rank.vocab_shard, rank.vocab_rows)))
    return LocalWeights(embed=embed, layers=layers, norm=cast(full["norm.weight"]), lm_head=lm_head,
                        vocab_start=rank.vocab_shard[0], vocab_held=rank.vocab_shard[1] - rank.vocab_shard[0],
                        vocab=spec.vocab)


def kv_checksums(weights: LocalWeights, rank: RankLayout, head_dim: int) -> dict[str, str]:
    """sha256 (first 16 hex) of each held KV head's K/V rows over all layers, as this rank holds them."""
    out = {}
    for j, kv in enumerate(rank.kv_heads):
        h = hashlib.sha256()
        for layer in weights.layers:
            for t in (layer.k, layer.v, layer.k_bias, layer.v_bias):
                if t is not None:
                    # [n_kv * hd, ...] -> head j's rows
                    h.update(t.view(-1, head_dim, *t.shape[1:])[j].detach().float().cpu().numpy().tobytes())
        out[str(kv)] = h.hexdigest()[:16]
    return out


def rank_report(rank: RankLayout, heads: HeadMap, weights: LocalWeights, spec: ModelSpec, pool_bytes: int,
                pool_blocks: int, checksums: dict[str, str] | None = None, kv_bytes_per_token: int | None = None,
                stored: StoredPositions | None = None, mla: MLAReport | None = None,
                hybrid: HybridReport | None = None, sparse: SparseReport | None = None,
                params: dict[str, ParamShard] | None = None, experts: ExpertsReport | None = None) -> RankReport:
    """What this rank really holds and reads, for the layout check (global ids throughout): the one place
    the embedded engine builds its rank reports (target and speculator). `checksums` replaces the K/V
    weight checksums (an MLA rank's latent projection); `params` what it holds of every checkpoint tensor
    (param_report.held_params); the rest are the architecture's records."""
    group_reads = tuple(rank.kv_heads[j] for j in heads.group_q_to_local_kv)
    lo, hi = heads.own_slice
    return RankReport(
        rank=rank.rank, q_heads=rank.q_heads, kv_heads=rank.kv_heads, dcp_group=rank.dcp_group,
        dcp_rank=rank.dcp_rank, dcp_members=rank.dcp_members, kv_tp_rank=rank.kv_tp_rank,
        q_to_kv=group_reads[lo:hi], group_q_heads=rank.group_q_heads, group_q_to_kv=group_reads,
        kv_pool_bytes=pool_bytes, kv_pool_blocks=pool_blocks,
        kv_weight_checksums=kv_checksums(weights, rank, spec.head_dim) if checksums is None else checksums,
        ffn_shard=rank.ffn_shard, vocab_shard=(weights.vocab_start, weights.vocab_start + weights.vocab_held),
        kv_bytes_per_token=kv_bytes_per_token, stored_positions=stored, mla=mla, hybrid=hybrid,
        sparse=sparse, params=params, experts=experts)
