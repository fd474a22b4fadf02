"""Multi-head latent attention (DeepSeek-V2 style) with absorbed weights, over a paged latent cache.

Per token the cache holds one latent row [kv_lora_rank + qk_rope_dim]: the normed compressed KV c_kv
and the decoupled RoPE key k_pe, shared by every head. The weights are absorbed: kv_b splits per head
into w_kc [qk_nope, kv_lora] and w_vc [v, kv_lora]; a head's query becomes [q_nope @ w_kc ; q_pe], its
scores are that against the latent rows, its output is softmax @ c_kv in latent space, and w_vc maps it
to the head's value width after the DCP merge. So a DCP group attends in latent space: each rank's
partial is (latent output, LSE) over the latent rows it owns.

With experts (spec.moe, DeepSeek-V2's MoE) the layers from moe.first_dense on run the MoE of
harness/engine/layers/moe.py instead of the dense FFN: the rank's experts and shared-expert columns from the MoE plan
(harness/engine/layers/hybrid.py's shard_moe), their partial outputs summed over TP like the dense FFN's.

Q modes (harness/partition/mla_layout.py): "split" projects the rank's own heads' queries and all-gathers them in
the DCP group (as GQA's DCP path does); "replicated" holds q_b / w_kc of every head of the DCP group
and computes the group's queries locally. Faults: harness/engine/faults.py.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import torch

from harness.engine.fault import FaultFlags
from harness.engine.layers.dense import (
    Batch,
    Decoder,
    FusedProjections,
    HeadMap,
    Hyper,
    LayerLinears,
    LocalWeights,
    apply_rope,
    local_attention,
    merge_partials,
    partial_lse,
    rms_norm,
    split_key_attention,
)
from harness.engine.layers.hybrid import shard_moe
from harness.engine.layers.moe import MoeRows, MoeWeights, moe_activations
from harness.engine.runtime.kvcache import PagedKVCache
from harness.engine.runtime.parallel import Collectives
from harness.engine.runtime.parallelize import mlp_norm_layer, o_heads, vocab_rows
from harness.partition.hybrid_layout import MoePlan, MoeRank
from harness.partition.layout import ROUND_ROBIN, Placement, PoolCapacity, RankLayout, local_token_count, token_owner
from harness.partition.mla_layout import MLAPlan, MLARank
from harness.records.rankreport import MLAReport
from harness.specs.model import ModelSpec


@dataclass
class MLALayerWeights:
    """One layer's local shard. q_b: [n_qw * (nope + rope), q_in] and w_kc: [n_qw, nope, kv_lora] for the
    heads whose Q weights the rank holds (own heads, or the DCP group's when Q is replicated); w_vc:
    [n_q, v, kv_lora] and o: [H, n_q * v] for its own heads; kv_a / kv_a_norm replicated. An MoE layer holds
    `moe` and empty gate / up [0, H] and down [H, 0]."""

    attn_norm: torch.Tensor
    q_a: torch.Tensor | None
    q_a_norm: torch.Tensor | None
    q_b: torch.Tensor
    w_kc: torch.Tensor
    kv_a: torch.Tensor
    kv_a_norm: torch.Tensor
    w_vc: torch.Tensor
    o: torch.Tensor
    mlp_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    moe: MoeWeights | None = None


@dataclass(frozen=True)
class MLADims:
    kv_lora: int
    rope: int
    nope: int
    v: int

    @property
    def latent(self) -> int:
        return self.kv_lora + self.rope

    @property
    def scale_fix(self) -> float:
        """local_attention divides scores by sqrt(q width) = sqrt(latent); MLA's scale is 1/sqrt(nope + rope)."""
        return math.sqrt(self.latent) / math.sqrt(self.nope + self.rope)


def mla_dims(spec: ModelSpec) -> MLADims:
    return MLADims(kv_lora=spec.kv_lora_rank, rope=spec.qk_rope_dim, nope=spec.qk_nope_dim, v=spec.head_dim)


def q_weight_source(mla_rank: MLARank, flags: FaultFlags) -> tuple[int, ...]:
    """The global head whose Q weights fill each of the rank's Q-weight slots: the slot's own head, or
    under the q-replicated-own-slice fault the rank's own heads repeated over the group's slots."""
    held, own = mla_rank.q_weight_heads, mla_rank.q_heads
    if not flags.q_own_slice or held == own:
        return held
    return tuple(own[i % len(own)] for i in range(len(held)))


def _ffn_weights(full: dict[str, torch.Tensor], spec: ModelSpec, rank: RankLayout, i: int, flags: FaultFlags,
                 moe_plan: MoePlan | None, cast: Any) -> dict[str, Any]:
    """Layer i's FFN fields of MLALayerWeights: the dense FFN's columns, or the rank's MoE shard (empty dense)."""
    p = f"layers.{i}."
    if moe_plan is None or p + "router.weight" not in full:
        lo, hi = rank.ffn_shard
        return {"gate": cast(full[p + "gate.weight"][lo:hi]), "up": cast(full[p + "up.weight"][lo:hi]),
                "down": cast(full[p + "down.weight"][:, lo:hi])}
    assert spec.moe is not None
    moe = shard_moe(full, p, moe_plan.ranks[rank.rank], flags, moe_plan, cast)
    moe.renormalize = spec.moe.renormalize
    empty = cast(full[p + "router.weight"][:0])  # [0, H]
    return {"gate": empty, "up": empty, "down": empty.T, "moe": moe}


def shard_mla_weights(full: dict[str, torch.Tensor], spec: ModelSpec, rank: RankLayout, mla_rank: MLARank,
                      flags: FaultFlags, dtype: torch.dtype, device: torch.device,
                      moe_plan: MoePlan | None = None) -> LocalWeights:
    """One rank's MLA weights: Q weights of mla_rank.q_weight_heads, w_vc / o of its own heads, the
    latent projection replicated, FFN columns and vocab rows as the GQA shard takes them (an MoE layer's
    experts as `moe_plan` places them)."""
    d = mla_dims(spec)
    qk = d.nope + d.rope
    src = list(q_weight_source(mla_rank, flags))
    own = list(rank.q_heads)
    cast = lambda t: t.to(device=device, dtype=dtype).contiguous()  # noqa: E731
    layers: list[Any] = []
    for i in range(spec.layers):
        p = f"layers.{i}."
        q_b = full[p + ("q_b.weight" if spec.q_lora_rank else "q.weight")]
        q_b = q_b.view(spec.heads, qk, -1)[src].reshape(len(src) * qk, -1)  # [heads*qk, in] -> held heads' rows
        kv_b = full[p + "kv_b.weight"].view(spec.heads, d.nope + d.v, d.kv_lora)  # [heads, nope + v, kv_lora]
        o_own = list(o_heads(rank, spec.heads, flags))
        o = full[p + "o.weight"].view(spec.hidden, spec.heads, d.v)[:, o_own].reshape(spec.hidden, len(own) * d.v)
        layers.append(MLALayerWeights(
            attn_norm=cast(full[p + "attn_norm.weight"]),
            q_a=cast(full[p + "q_a.weight"]) if spec.q_lora_rank else None,
            q_a_norm=cast(full[p + "q_a_norm.weight"]) if spec.q_lora_rank else None,
            q_b=cast(q_b), w_kc=cast(kv_b[src, : d.nope]), kv_a=cast(full[p + "kv_a.weight"]),
            kv_a_norm=cast(full[p + "kv_a_norm.weight"]), w_vc=cast(kv_b[own, d.nope:]), o=cast(o),
            mlp_norm=cast(full[f"layers.{mlp_norm_layer(rank, i, spec.layers, flags)}.mlp_norm.weight"]),
            **_ffn_weights(full, spec, rank, i, flags, moe_plan, cast)))
    embed = cast(vocab_rows(full["embed.weight"], rank.vocab_shard, rank.vocab_rows))
    lm_head = (embed if "lm_head.weight" not in full
               else cast(vocab_rows(full["lm_head.weight"], rank.vocab_shard, rank.vocab_rows)))
    return LocalWeights(embed=embed, layers=layers, norm=cast(full["norm.weight"]), lm_head=lm_head,
                        vocab_start=rank.vocab_shard[0], vocab_held=rank.vocab_shard[1] - rank.vocab_shard[0],
                        vocab=spec.vocab)


def latent_cache(capacity: PoolCapacity, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> PagedKVCache:
    """The paged latent cache: k pools [blocks, block, 1, kv_lora + rope] per layer, no value pools."""
    return PagedKVCache(capacity, spec.layers, 1, mla_dims(spec).latent, dtype, device, values=False)


class MLADecoder(Decoder):
    """Decoder whose attention is MLA over the latent cache; the rest of the layer is Decoder's."""

    def __init__(self, weights: LocalWeights, heads: HeadMap, hyper: Hyper, comm: Collectives,
                 cache: PagedKVCache, flags: FaultFlags, dims: MLADims, q_replicated: bool,
                 placement: Placement = ROUND_ROBIN, top_k: int = 0) -> None:
        super().__init__(weights, heads, hyper, comm, cache, flags, placement, fuse=False)
        self.dims = dims
        self.q_replicated = q_replicated and comm.dcp > 1
        self._fused = [FusedProjections(qkv=layer.attn_norm.new_zeros(0), qkv_bias=None,
                                        gate_up=torch.cat((layer.gate, layer.up))) for layer in weights.layers]
        for layer, fused in zip(weights.layers, self._fused):  # gate/up as views of the fused matrix
            layer.gate, layer.up = fused.gate_up.split([layer.gate.shape[0], layer.up.shape[0]])
        self._mats = [LayerLinears.of(f, layer) for f, layer in zip(self._fused, weights.layers)]
        self.top_k = top_k  # experts per token of the MoE layers

    def _mlp(self, i: int, layer: Any, h: torch.Tensor) -> torch.Tensor:
        """Layer i's FFN of h [B, S, H] summed over TP: the dense FFN, or the MoE (routed experts and shared
        expert) of an MoE layer."""
        if layer.moe is None:
            return super()._mlp(i, layer, h)
        B, S, H = h.shape
        # [B, S, H] -> [B * S, H] tokens -> activations [B * S, A] -> [B, S, A]
        rows = MoeRows.all_real(B * S, h.device, self.flags.replica_local_first)
        acts = moe_activations(h.reshape(B * S, H), layer.moe, self.top_k, self.flags.router_local_renorm, rows)
        return self._row_parallel(acts.view(B, S, -1), layer.moe.down)

    def _slot_tables(self, batch: Batch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The mla-rope-local-slot fault's RoPE tables: each token rotated by its index in its owner's
        local store (tokens its owner holds before it) instead of its position."""
        lens = [self.cache.seqs[s].prompt_len for s in batch.seq_ids]
        dcp = self.comm.dcp
        local = [[local_token_count(p, int(token_owner(p, dcp, self.placement, n)), dcp, self.placement, n)
                  for p in row] for row, n in zip(batch.positions.tolist(), lens)]  # [B, S]
        return self._rope.tables(torch.tensor(local, device=batch.positions.device), dtype)

    def _attention(self, i: int, layer: Any, h: torch.Tensor, batch: Batch,
                   write_rows: torch.Tensor, stored: torch.Tensor, flat: torch.Tensor,
                   mask: tuple[torch.Tensor, str, torch.Tensor | None], tables: tuple[torch.Tensor, torch.Tensor],
                   k_tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Attention output of this rank's own Q heads: [B, S, n_q, v]."""
        B, S, _ = h.shape
        d, hm, eps = self.dims, self.heads, self.hyper.norm_eps
        visible = mask[0]
        cq = rms_norm(h @ layer.q_a.T, layer.q_a_norm, eps) if layer.q_a is not None else h  # [B, S, q_in]
        q = (cq @ layer.q_b.T).view(B, S, -1, d.nope + d.rope)  # [B, S, n_qw, nope + rope]
        q_nope, q_pe = q.split([d.nope, d.rope], dim=-1)
        q_lat = torch.einsum("bshn,hnc->bshc", q_nope, layer.w_kc)  # absorbed: [B, S, n_qw, kv_lora]
        q_full = torch.cat((q_lat, apply_rope(q_pe, tables)), dim=-1) * d.scale_fix  # [B, S, n_qw, latent]
        kv = h @ layer.kv_a.T  # [B, S, kv_lora + rope]
        c_kv, k_pe = kv.split([d.kv_lora, d.rope], dim=-1)
        if self.flags.latent_rope_local_slot and self.comm.dcp > 1:
            k_tables = self._slot_tables(batch, h.dtype)
        k_pe = apply_rope(k_pe[:, :, None, :], k_tables)  # [B, S, 1, rope]
        latent = torch.cat((rms_norm(c_kv, layer.kv_a_norm, eps)[:, :, None, :], k_pe), dim=-1)  # [B, S, 1, latent]
        self.cache.write_rows(i, write_rows, latent[stored], None)
        # pool [blocks, block, 1, latent] -> [blocks * block, 1, latent] -> rows `flat` -> [B, L, 1, latent]
        lat_all = self.cache.k[i].flatten(0, 1).index_select(0, flat).view(B, -1, 1, d.latent)
        values = lat_all[..., : d.kv_lora]  # [B, L, 1, kv_lora]: the latent serves as every head's value
        if self.comm.dcp == 1:
            reads = (0,) * hm.n_q
            if self.flags.split_reduction > 1:
                out = split_key_attention(q_full, lat_all, values, visible, reads, self.flags.split_reduction)
            else:
                out, _ = local_attention(q_full, lat_all, values, visible, reads)
            return torch.einsum("bshc,hvc->bshv", out, layer.w_vc)  # [B, S, n_q, v]
        lo, hi = hm.own_slice
        group_q = q_full if self.q_replicated else self.comm.gather_dcp(q_full, dim=2)  # [B, S, Hg, latent]
        out, lse = local_attention(group_q, lat_all, values, visible, (0,) * group_q.shape[2])
        lse = partial_lse(lse, self.flags)
        # [B, S, Hg, kv_lora] + [B, S, Hg, 1] -> [dcp, B, S, Hg, kv_lora + 1] -> own heads [dcp, B, S, n_q, kv_lora + 1]
        packed = self.comm.stack_dcp(torch.cat((out.float(), lse[..., None].float()), dim=-1))[:, :, :, lo:hi]
        outs, lses = packed[..., :-1].to(out.dtype), packed[..., -1].to(lse.dtype)
        merged = merge_partials(outs, lses, self.flags.lse_merge_mean)  # [B, S, n_q, kv_lora]
        if self._sites is not None:
            if not self.q_replicated:
                self._probe_site("dcp-q-gather", group_q[:, :, lo:hi], q_full)
            self._probe_site("dcp-lse-merge", merged, merge_partials(outs.to(torch.float64), lses.to(torch.float64)))
        return torch.einsum("bshc,hvc->bshv", merged, layer.w_vc)  # [B, S, n_q, v]


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def mla_checksums(weights: LocalWeights, mla_rank: MLARank, spec: ModelSpec) -> dict[str, Any]:
    """sha256 (first 16 hex) of the latent projection (kv_a, kv_a_norm, every layer: the one "KV head"
    every rank holds) and of each held Q-weight head's q_b rows and w_kc, every layer."""
    d = mla_dims(spec)
    latent = _digest([t for layer in weights.layers for t in (layer.kv_a, layer.kv_a_norm)])
    q_sums = {}
    for j, head in enumerate(mla_rank.q_weight_heads):
        parts = []
        for layer in weights.layers:
            parts += [layer.q_b.view(-1, d.nope + d.rope, layer.q_b.shape[-1])[j], layer.w_kc[j]]
        q_sums[str(head)] = _digest(parts)
    return {"kv_weight_checksums": {"0": latent}, "q_weight_checksums": q_sums}


@dataclass
class MLAParts:
    """What Engine builds for an MLA model instead of the GQA shard, cache and decoder."""

    weights: LocalWeights
    cache: PagedKVCache
    decoder: MLADecoder
    rank: MLARank
    q_mode: str
    moe_rank: MoeRank | None = None  # the rank's part of the experts (a model with MoE layers)


def build_mla(spec: ModelSpec, full: dict[str, torch.Tensor], rank: RankLayout, heads: HeadMap, comm: Collectives,
              flags: FaultFlags, capacity: PoolCapacity, dtype: torch.dtype, device: torch.device, mla_plan: MLAPlan,
              placement: Placement, moe_plan: MoePlan | None = None) -> MLAParts:
    """One rank's MLA weights, latent cache and decoder, from the planner's MLA plan (and MoE plan)."""
    mla_rank = mla_plan.ranks[rank.rank]
    weights = shard_mla_weights(full, spec, rank, mla_rank, flags, dtype, device, moe_plan)
    cache = latent_cache(capacity, spec, dtype, device)
    decoder = MLADecoder(weights, heads, Hyper(spec.qk_rope_dim, spec.rope_theta, spec.norm_eps), comm, cache, flags,
                         mla_dims(spec), mla_plan.q_replicated, placement, spec.moe.top_k if spec.moe else 0)
    return MLAParts(weights, cache, decoder, mla_rank, "replicated" if mla_plan.q_replicated else "split",
                    moe_plan.ranks[rank.rank] if moe_plan is not None else None)


def mla_report(parts: MLAParts, spec: ModelSpec) -> tuple[MLAReport, dict[str, str], int]:
    """The MLA parts of a rank's report: its MLA record (Q mode, the heads whose Q weights it holds with
    their checksums, the latent row width as allocated), the latent projection's checksum (its "K/V
    weight checksums") and the cache's bytes per stored token."""
    sums = mla_checksums(parts.weights, parts.rank, spec)
    pool = parts.cache.k[0]
    record = MLAReport(q_mode=parts.q_mode, q_weight_heads=tuple(parts.rank.q_weight_heads),
                       q_weight_checksums=sums["q_weight_checksums"], latent_dim=int(pool.shape[-1]))
    return record, sums["kv_weight_checksums"], len(parts.cache.k) * int(pool.shape[-1]) * pool.element_size()
