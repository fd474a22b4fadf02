"""The hybrid decoder: Gated DeltaNet linear-attention layers and gated full-attention layers (pattern
from the model spec), MoE FFN with a shared expert, over a grouped cache.

The full-attention layers run the dense decoder's attention path (paged KV, DCP merge) with an output
gate; the linear layers keep their state whole on every rank (harness/engine/runtime/statecache.py); the MoE
partials and the linear layers' out-projection partials are summed with the TP all-reduce. The shards
come only from the hybrid planner (harness/partition/hybrid_layout.py); faults change which plan or mapping is used.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from harness.engine.fault import FaultFlags
from harness.engine.layers.deltanet import LinearHeads, LinearWeights, linear_attention, state_dtype
from harness.engine.layers.dense import (
    COLLECTIVE_SITES,
    Batch,
    Capture,
    Decoder,
    HeadMap,
    Hyper,
    LayerWeights,
    LocalWeights,
    additive_mask,
    mask_kind,
    rms_norm,
)
from harness.engine.layers.dp_moe import DpSplit, dp_moe, scatter_rows, split_batch, sub_batch
from harness.engine.layers.moe import MoeRows, MoeWeights, moe_activations
from harness.engine.runtime.parallel import Collectives
from harness.engine.runtime.parallelize import head_map, mlp_norm_layer, o_heads, vocab_rows
from harness.engine.runtime.statecache import SNAPSHOT_TOKENS, HybridCache
from harness.partition.cache_groups import GroupedCapacity, grouped_capacity
from harness.partition.hybrid_layout import (
    FULL,
    HybridPlan,
    HybridShape,
    LinearRank,
    MoePlan,
    MoeRank,
    hybrid_cache_groups,
    loaded_rows,
)
from harness.partition.layout import LayoutPlan, PoolCapacity, RankLayout, slot_pool, token_owner
from harness.records.rankreport import CacheGroupsReport, ExpertsReport, HybridReport, LinearReport
from harness.specs.model import ModelSpec


@dataclass(frozen=True)
class DataParallel:
    """Attention data parallel: this rank is DP rank `rank` of `size`; `world` runs the MoE's collectives
    (the decoder's own collectives are this DP rank's attention group: one rank)."""

    size: int
    rank: int
    world: Collectives


@dataclass
class HybridLayer:
    """One layer: its kind, its attention (index into LocalWeights.layers, the full layers) or linear
    weights, the gated attention's gate rows, and its FFN (MoE, or the dense MLP of its LayerWeights)."""

    kind: str
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    full_index: int = -1
    q_gate: torch.Tensor | None = None  # [n_q * hd, H]
    linear: LinearWeights | None = None
    linear_index: int = -1
    moe: MoeWeights | None = None
    dense: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # gate, up, down shards


# ---- sharding ---------------------------------------------------------------------------------------


def _head_rows(w: torch.Tensor, heads: tuple[int, ...], rows_per_head: int) -> torch.Tensor:
    """Rows of the given heads from a [n_heads * rows_per_head, ...] tensor -> [len(heads) * rows_per_head, ...]."""
    # [n * r, ...] -> [n, r, ...] -> selected heads -> [len * r, ...]
    return w.view(-1, rows_per_head, *w.shape[1:])[list(heads)].reshape(len(heads) * rows_per_head, *w.shape[1:])


def _packed_rows(w: torch.Tensor, ranges: tuple[tuple[int, int], ...]) -> torch.Tensor:
    return torch.cat([w[lo:hi] for lo, hi in ranges])


def shard_linear(full: dict[str, torch.Tensor], p: str, h: HybridShape, lin: LinearRank, flags: FaultFlags,
                 cast: Any) -> LinearWeights:
    rows = loaded_rows(h, lin, flags.linear_packed_contiguous)
    vd = h.linear_v_dim
    own = torch.tensor([v in lin.out_v_heads for v in lin.v_heads], dtype=torch.bool).repeat_interleave(vd)
    out = _head_rows(full[p + "lin_out.weight"].T, lin.v_heads, vd).T  # [H, Hv_local * Dv]
    return LinearWeights(
        attn_norm=cast(full[p + "attn_norm.weight"]), qkv=cast(_packed_rows(full[p + "lin_qkv.weight"], rows)),
        z=cast(_head_rows(full[p + "lin_z.weight"], lin.v_heads, vd)),
        b=cast(full[p + "lin_b.weight"][list(lin.v_heads)]), a=cast(full[p + "lin_a.weight"][list(lin.v_heads)]),
        conv=cast(_packed_rows(full[p + "lin_conv.weight"], rows)),
        a_log=cast(full[p + "lin_A_log"][list(lin.v_heads)]), dt_bias=cast(full[p + "lin_dt_bias"][list(lin.v_heads)]),
        norm=cast(full[p + "lin_norm.weight"]), out=cast(out * own[None, :].to(out.dtype)))


def shard_moe(full: dict[str, torch.Tensor], p: str, moe: MoeRank, flags: FaultFlags, plan: MoePlan,
              cast: Any) -> MoeWeights:
    """One rank's MoE layer: its physical expert slots (each the weights of its logical expert, columns of
    its expert-TP rank) and its columns of the shared expert."""
    lo, hi = moe.expert_ffn_shard
    ids = list(moe.logical) if moe.logical else list(moe.experts)  # the weights each physical slot holds
    labels = moe.experts
    if flags.expert_offset_tp_rank:  # expert ids offset by the tp rank instead of the EP rank
        per = plan.physical // plan.ep
        labels = tuple((moe.rank * per + j) % plan.physical for j in range(per))
    gate = full[p + "experts.gate.weight"][ids, lo:hi]  # [E_local, F_local, H]
    up = full[p + "experts.up.weight"][ids, lo:hi]
    # [E, H, F] -> local experts' columns [E_local, H, F_local] -> side by side [H, E_local * F_local]
    downs = [full[p + "experts.down.weight"][e][:, lo:hi] for e in ids]
    shared_gate = shared_up = None
    if p + "shared.gate.weight" in full:
        s_lo, s_hi = moe.shared_ffn_shard
        if flags.shared_expert_every_rank:  # the whole shared expert on every rank, added tp times
            s_lo, s_hi = 0, full[p + "shared.gate.weight"].shape[0]
        shared_gate = cast(full[p + "shared.gate.weight"][s_lo:s_hi])
        shared_up = cast(full[p + "shared.up.weight"][s_lo:s_hi])
        downs.append(full[p + "shared.down.weight"][:, s_lo:s_hi])
    return MoeWeights(router=cast(full[p + "router.weight"]), gate=cast(gate), up=cast(up), shared_gate=shared_gate,
                      shared_up=shared_up, down=cast(torch.cat(downs, dim=1)), expert_ids=labels,
                      expert_map=plan.expert_map, loaded=tuple(ids))


def shard_hybrid(full: dict[str, torch.Tensor], spec: ModelSpec, h: HybridShape, plan: HybridPlan, rank: int,
                 flags: FaultFlags, dtype: torch.dtype, device: torch.device) -> tuple[LocalWeights, list[HybridLayer]]:
    """One rank's weights: the full layers as LocalWeights.layers (their gated Q split into q and gate
    rows), the linear layers, MoE and norms per layer in HybridLayer."""
    hd = spec.head_dim
    attn: RankLayout = plan.attention.ranks[rank]
    cast = lambda t: t.to(device=device, dtype=dtype).contiguous()  # noqa: E731
    empty = torch.zeros(0, spec.hidden, device=device, dtype=dtype)
    full_layers: list[LayerWeights] = []
    layers: list[HybridLayer] = []
    lo, hi = attn.ffn_shard
    for i, kind in enumerate(plan.kinds):
        p = f"layers.{i}."
        norm_layer = mlp_norm_layer(attn, i, len(plan.kinds), flags)
        layer = HybridLayer(kind=kind, attn_norm=cast(full[p + "attn_norm.weight"]),
                            mlp_norm=cast(full[f"layers.{norm_layer}.mlp_norm.weight"]))
        if kind == FULL:
            q_all = full[p + "q.weight"]
            gate = None
            if h.attn_output_gate:
                # [heads * 2 hd, H] -> [heads, 2, hd, H]: per head its q rows, then its gate rows
                per_head = q_all.view(spec.heads, 2, hd, spec.hidden)
                q_all, gate = per_head[:, 0].reshape(-1, spec.hidden), per_head[:, 1].reshape(-1, spec.hidden)
                layer.q_gate = cast(_head_rows(gate, attn.q_heads, hd))
            layer.full_index = len(full_layers)
            full_layers.append(LayerWeights(
                attn_norm=layer.attn_norm, q=cast(_head_rows(q_all, attn.q_heads, hd)),
                k=cast(_head_rows(full[p + "k.weight"], attn.kv_heads, hd)),
                v=cast(_head_rows(full[p + "v.weight"], attn.kv_heads, hd)),
                # [H, heads hd] -> own columns
                o=cast(_head_rows(full[p + "o.weight"].T, o_heads(attn, spec.heads, flags), hd).T),
                mlp_norm=layer.mlp_norm, gate=empty, up=empty, down=empty.T,
                q_norm=cast(full[p + "q_norm.weight"]) if h.qk_norm else None,
                k_norm=cast(full[p + "k_norm.weight"]) if h.qk_norm else None))
        else:
            layer.linear_index = sum(1 for x in layers if x.kind != FULL)
            layer.linear = shard_linear(full, p, h, plan.linear.ranks[rank], flags, cast)
        if plan.moe is not None:
            layer.moe = shard_moe(full, p, plan.moe.ranks[rank], flags, plan.moe, cast)
        else:
            layer.dense = (cast(full[p + "gate.weight"][lo:hi]), cast(full[p + "up.weight"][lo:hi]),
                           cast(full[p + "down.weight"][:, lo:hi]))
        layers.append(layer)
    embed = cast(vocab_rows(full["embed.weight"], attn.vocab_shard, attn.vocab_rows))
    lm_head = (embed if "lm_head.weight" not in full
               else cast(vocab_rows(full["lm_head.weight"], attn.vocab_shard, attn.vocab_rows)))
    return LocalWeights(embed=embed, layers=full_layers, norm=cast(full["norm.weight"]), lm_head=lm_head,
                        vocab_start=attn.vocab_shard[0], vocab_held=attn.vocab_shard[1] - attn.vocab_shard[0],
                        vocab=spec.vocab), layers


# ---- the decoder --------------------------------------------------------------------------------------


class HybridDecoder(Decoder):
    """The dense decoder's embedding, attention path, all-reduce and logits, with a hybrid layer loop."""

    def __init__(self, weights: LocalWeights, layers: list[HybridLayer], heads: HeadMap, linear: LinearHeads,
                 top_k: int, hyper: Hyper, comm: Collectives, cache: HybridCache, flags: FaultFlags,
                 tp: int, tp_rank: int, dp: DataParallel | None = None) -> None:
        super().__init__(weights, heads, hyper, comm, cache, flags)
        self.tp, self.tp_rank = tp, tp_rank
        self.layers = layers
        self.linear_heads = linear
        self.top_k = top_k
        self.state_cache = cache
        self.dp = dp
        self._split: DpSplit | None = None  # the DP split of the forward being run
        self._valid: torch.Tensor | None = None  # [B_own, S]: the real tokens of this DP rank's rows

    def hidden(self, batch: Batch, capture: Capture | None = None,
               embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream after the last layer [B, S, H]; stores the new tokens' K/V (full layers) and
        folds them into each sequence's recurrent state (linear layers). Under attention data parallel
        this rank runs its own requests' rows (dp_moe.py) and the rows are summed over the world."""
        if self.dp is None:
            return self._hidden(batch, capture, embeds)
        split = split_batch(batch, self.dp.size, self.dp.rank)
        self._split = split
        B = batch.ids.shape[0]
        local = Capture() if capture is not None else None
        try:
            if split.idle:
                self._idle(split)
                x_own = None
            else:
                sub = sub_batch(batch, split.own)
                self._valid = sub.valid
                own_embeds = None if embeds is None else embeds[list(split.own)]
                x_own = self._hidden(sub, local, own_embeds)
        finally:
            self._split, self._valid = None, None
        H = self.hyper_hidden
        x = (scatter_rows(x_own, split.own, B) if x_own is not None
             else torch.zeros(B, batch.ids.shape[1], H, dtype=self.w.norm.dtype, device=batch.ids.device))
        x = self.dp.world.reduce_tp(x)
        if capture is not None and local is not None:
            self._dp_capture(capture, local, split, batch)
        return x

    @property
    def hyper_hidden(self) -> int:
        return int(self.w.norm.shape[0])

    def _idle(self, split: DpSplit) -> None:
        """An idle DP rank's dummy batch: every MoE layer's collectives with one dummy token (token 0's
        embedding through the layer's norm) and no request of its own."""
        dummy = self.embed(torch.zeros(1, 1, dtype=torch.long, device=self.w.embed.device))[0, 0]  # [H]
        for layer in self.layers:
            if layer.moe is not None:
                assert self.dp is not None
                dp_moe(dummy.new_zeros(0, dummy.shape[0]), rms_norm(dummy, layer.mlp_norm, self.hyper.norm_eps),
                       layer.moe, self.top_k, split, self.dp.world, self.flags)

    def _dp_capture(self, capture: Capture, local: Capture, split: DpSplit, batch: Batch) -> None:
        """The whole batch's captured hidden states and attention outputs: each DP rank's rows, summed over
        the world (zeros elsewhere); no collective runs inside a DP rank's layers (zero errors)."""
        assert self.dp is not None
        B, S = batch.ids.shape
        L, H = len(self.layers), self.hyper_hidden
        n_q, hd = self.heads.n_q, self.hyper.head_dim
        dtype, dev = self.w.norm.dtype, batch.ids.device
        if split.idle:
            hidden = torch.zeros(L + 1, B, S, H, dtype=dtype, device=dev)
            attn = torch.zeros(L, B, S, n_q, hd, dtype=dtype, device=dev)
        else:  # [L(+1), B_own, S, ...] -> rows of the batch
            hidden = scatter_rows(torch.stack(local.hidden).transpose(0, 1), split.own, B).transpose(0, 1)
            attn = scatter_rows(torch.stack(local.attn).transpose(0, 1).to(dtype), split.own, B).transpose(0, 1)
        hidden = self.dp.world.reduce_tp(hidden.contiguous())
        attn = self.dp.world.reduce_tp(attn.contiguous())
        capture.hidden.extend(hidden.unbind(0))
        capture.attn.extend(attn.unbind(0))
        zero = torch.zeros(B, S, len(COLLECTIVE_SITES), dtype=torch.float64, device=dev)
        capture.collectives.extend(zero for _ in range(L))

    def _hidden(self, batch: Batch, capture: Capture | None = None,
                embeds: torch.Tensor | None = None) -> torch.Tensor:
        slots, stored_mask = self._reserve(batch)
        write_rows = self.cache.rows(slots)
        rows, key_pos, key_valid = self._key_index(batch)
        flat = rows.flatten()  # [B, L] -> [B * L]
        visible = key_valid[:, None, :] & (key_pos[:, None, :] <= batch.positions[:, :, None])  # [B, S, L]
        x = self.embed(batch.ids) if embeds is None else embeds  # [B, S, H]
        tables = self._rope.tables(batch.positions, x.dtype)
        kind = mask_kind(visible, batch.valid if self.comm.dcp == 1 else None)  # the DCP path merges every row
        bias = (additive_mask(visible, x.dtype) if self.comm.dcp > 1 and kind == "mask" and x.device.type == "cpu"
                else None)
        updates = self._state_mask(batch)
        if capture is not None:
            capture.hidden.append(x)
        B, S, _ = x.shape
        hd, n_q = self.hyper.head_dim, self.heads.n_q
        for layer in self.layers:
            self._sites = {} if capture is not None else None
            hn = rms_norm(x, layer.attn_norm, self.hyper.norm_eps)
            if layer.kind == FULL:
                w = self.w.layers[layer.full_index]
                attn = self._attention(layer.full_index, w, hn, batch, write_rows, stored_mask, flat,
                                       (visible, kind, bias), tables, tables)
                if layer.q_gate is not None:  # [B, S, n_q * hd] -> [B, S, n_q, hd]
                    attn = attn * torch.sigmoid(hn @ layer.q_gate.T).view(B, S, n_q, hd)
                x = x + self._row_parallel(attn.flatten(2), w.o, attn_out=True)
            else:
                assert layer.linear is not None
                mixed = self._row_parallel(self._linear(layer, hn, batch, updates), layer.linear.out, attn_out=True)
                attn = self._mixer_capture(mixed)
                x = x + mixed
            if capture is not None:
                capture.attn.append(attn)
            x = x + self._ffn(layer, rms_norm(x, layer.mlp_norm, self.hyper.norm_eps))
            self._capture_layer(capture, x)
        self._sites = None
        self.state_cache.advance(batch.seq_ids, batch.valid.sum(dim=1).tolist())
        return x

    def _mixer_capture(self, mixed: torch.Tensor) -> torch.Tensor:
        """What a linear layer records in the per-head capture [B, S, n_q, hd]: when heads x head_dim is
        the hidden size, this rank's slice of the layer's (all-reduced) output, so the gathered capture is
        the whole output, compared like attention heads; zeros otherwise."""
        B, S, H = mixed.shape
        n_q, hd = self.heads.n_q, self.hyper.head_dim
        if n_q * hd * self.tp != H:
            return mixed.new_zeros(B, S, n_q, hd)
        me = self.tp_rank
        return mixed[..., me * n_q * hd:(me + 1) * n_q * hd].reshape(B, S, n_q, hd)  # [B, S, n_q * hd] -> heads

    def _state_mask(self, batch: Batch) -> torch.Tensor:
        """[B, S]: the tokens folded into the recurrent state: every valid token on every rank (the state
        is kept whole), or under the fault deltanet-state-dcp-split only the DCP rank's own tokens."""
        if self.flags.linear_state_dcp_split and self.comm.dcp > 1:
            return batch.valid & (token_owner(batch.positions, self.comm.dcp) == self.comm.dcp_rank)
        return batch.valid

    def _linear(self, layer: HybridLayer, hn: torch.Tensor, batch: Batch, updates: torch.Tensor) -> torch.Tensor:
        """This rank's linear-attention output before the out projection [B, S, Hv_local * Dv], one
        sequence at a time (each has its own state)."""
        assert layer.linear is not None
        outs = []
        lengths = batch.valid.sum(dim=1).tolist()
        keep = hn.shape[1] <= SNAPSHOT_TOKENS
        for b, seq_id in enumerate(batch.seq_ids):
            state = self.state_cache.state(seq_id, layer.linear_index)
            y, new, steps = linear_attention(hn[b], layer.linear, self.linear_heads, state, self.hyper.norm_eps,
                                             int(lengths[b]), updates[b], keep_steps=keep)
            self.state_cache.store_state(seq_id, layer.linear_index, new)
            if steps is not None:
                self.state_cache.keep_snapshots(seq_id, layer.linear_index, steps)
            outs.append(y)
        return torch.stack(outs)  # [B, S, Hv_local * Dv]

    def _ffn(self, layer: HybridLayer, h: torch.Tensor) -> torch.Tensor:
        """The FFN of h [B, S, H] summed over the TP world -> [B, S, H]."""
        if layer.moe is None:
            assert layer.dense is not None
            gate, up, down = layer.dense
            return self._row_parallel(F.silu(h @ gate.T) * (h @ up.T), down)
        B, S, H = h.shape
        if self._split is not None and self.dp is not None and self._valid is not None:  # attention DP
            out = h.new_zeros(B, S, H)
            # this DP rank's real tokens [n, H] through the gathered MoE, back at their places
            out[self._valid] = dp_moe(h[self._valid], h.new_zeros(H), layer.moe, self.top_k, self._split,
                                      self.dp.world, self.flags)
            return out
        # [B, S, H] -> [B * S, H] tokens -> activations [B * S, A] -> [B, S, A]
        rows = MoeRows.all_real(B * S, h.device, self.flags.replica_local_first)
        acts = moe_activations(h.reshape(B * S, H), layer.moe, self.top_k, self.flags.router_local_renorm, rows)
        return self._row_parallel(acts.view(B, S, -1), layer.moe.down)


# ---- building one rank's hybrid model -----------------------------------------------------------------


@dataclass
class HybridParts:
    plan: HybridPlan
    rank_layout: RankLayout
    heads: HeadMap
    capacity: PoolCapacity
    grouped: GroupedCapacity
    weights: LocalWeights
    layers: list[HybridLayer]
    cache: HybridCache
    decoder: HybridDecoder
    loaded_rows: tuple[tuple[int, int], ...]  # the packed q|k|v rows of the linear layers as loaded


def cache_capacity(plan: HybridPlan, budget_bytes: int, max_seq_len: int, block_size: int, flags: FaultFlags,
                   speculator: LayoutPlan | None = None) -> tuple[GroupedCapacity, PoolCapacity, int]:
    """(the grouped capacity, the attention pool, the recurrent-state slots): one slot count for every
    group (with a speculator, its KV pages are a group of the same budget: it gets as many slots), or
    under the fault cache-groups-own-budget each group sized from its own share of the budget."""
    groups = hybrid_cache_groups(plan.attention, plan.linear, speculator, max_seq_len, block_size)
    grouped = grouped_capacity(groups, budget_bytes)
    if not flags.cache_groups_own_budget:
        return grouped, slot_pool(plan.attention, grouped.slots, max_seq_len, block_size), grouped.slots
    share = budget_bytes // len(groups)
    attn = grouped_capacity(groups[:1], share)
    state_slots = max(1, share // groups[1].slot_bytes) if len(groups) > 1 else attn.slots
    return grouped, slot_pool(plan.attention, attn.slots, max_seq_len, block_size), state_slots


def build_hybrid(spec: ModelSpec, h: HybridShape, plan: HybridPlan, full: dict[str, torch.Tensor], rank: int,
                 flags: FaultFlags, budget_bytes: int, max_seq_len: int, block_size: int, hyper: Hyper,
                 comm: Collectives, dtype: torch.dtype, device: torch.device,
                 spec_plan: LayoutPlan | None = None, dp: DataParallel | None = None) -> HybridParts:
    """Everything one rank of a hybrid model needs, from the planner's plan (faults: the flags);
    `spec_plan`: a draft/MTP head's plan, sharing the cache budget (its pages are one more cache group);
    `dp`: attention data parallel (then `comm` is this DP rank's attention group of one rank)."""
    tp, tp_rank = (plan.attention.tp, rank) if dp is None else (1, 0)
    rank_layout = plan.attention.ranks[rank]
    heads = head_map(rank_layout, flags)
    grouped, capacity, state_slots = cache_capacity(plan, budget_bytes, max_seq_len, block_size, flags, spec_plan)
    weights, layers = shard_hybrid(full, spec, h, plan, rank, flags, dtype, device)
    lin = plan.linear.ranks[rank]
    channels = sum(hi - lo for lo, hi in lin.conv_rows)
    linear_heads = LinearHeads(n_k=len(lin.k_heads), n_v=len(lin.v_heads), k_dim=h.linear_k_dim,
                               v_dim=h.linear_v_dim, v_to_local_k=lin.v_to_local_k)
    cache = HybridCache(capacity, plan.attention.shape.layers, heads.n_kv, spec.head_dim, dtype, device,
                        state_slots, plan.linear.layers, (channels, h.conv_kernel - 1),
                        (len(lin.v_heads), h.linear_k_dim, h.linear_v_dim), state_dtype(dtype),
                        reset_slots=not flags.stale_state_slots)
    decoder = HybridDecoder(weights, layers, heads, linear_heads, h.top_k, hyper, comm, cache, flags, tp, tp_rank,
                            dp)
    return HybridParts(plan, rank_layout, heads, capacity, grouped, weights, layers, cache, decoder,
                       loaded_rows(h, lin, flags.linear_packed_contiguous))


def _checksum(tensors: list[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def _slot_checksum(moe: MoeWeights, j: int) -> str:
    """Physical slot j's weights as this rank holds them: its gate and up rows and its down columns."""
    f = moe.gate.shape[1]
    return _checksum([moe.gate[j], moe.up[j], moe.down[:, j * f:(j + 1) * f]])


def experts_report(moe: MoeWeights, planned: MoeRank) -> ExpertsReport:
    """What a rank holds of an MoE layer `moe` (its first): its experts (ids as it routes them) and columns, its
    shared-expert columns, its router's checksum, the logical expert each slot loaded and each slot's checksum."""
    return ExpertsReport(
        experts=tuple(moe.expert_ids), expert_ffn_shard=planned.expert_ffn_shard, expert_columns=int(moe.gate.shape[1]),
        shared_columns=int(moe.shared_gate.shape[0]) if moe.shared_gate is not None else 0,
        router_checksum=_checksum([moe.router]), logical=tuple(moe.loaded),
        slot_checksums=tuple(_slot_checksum(moe, j) for j in range(len(moe.expert_ids))))


def hybrid_layout_report(parts: HybridParts, rank: int) -> HybridReport:
    """What this rank holds of the hybrid layers, for the layout check: the packed q|k|v rows it
    loaded, its V / K heads, the heads whose output it adds, a checksum of its linear weights (equal
    across a DCP group), its experts (ids as it routes them) and columns, its shared-expert columns,
    and its cache groups (attention blocks, state slots, bytes)."""
    lin = parts.plan.linear.ranks[rank]
    linears = [layer.linear for layer in parts.layers if layer.linear is not None]
    moe_layer = next((layer.moe for layer in parts.layers if layer.moe is not None), None)
    moe: ExpertsReport | None = None
    if moe_layer is not None and parts.plan.moe is not None:
        moe = experts_report(moe_layer, parts.plan.moe.ranks[rank])
    cache = parts.cache
    linear = LinearReport(
        v_heads=tuple(lin.v_heads), k_heads=tuple(lin.k_heads), out_v_heads=tuple(lin.out_v_heads),
        conv_rows=tuple((int(lo), int(hi)) for lo, hi in parts.loaded_rows),
        state_digests=tuple(parts.cache.final_digests),
        weight_checksum=_checksum([t for w in linears for t in (w.qkv, w.conv, w.z, w.b, w.a)]))
    groups = CacheGroupsReport(slots=parts.grouped.slots, attention_blocks=parts.capacity.blocks,
                               attention_blocks_per_seq=parts.capacity.blocks_per_slot,
                               state_slots=cache.state_slots, state_bytes=cache.state_bytes,
                               attention_bytes=cache.pool_bytes)
    return HybridReport(linear=linear, moe=moe, cache_groups=groups)
