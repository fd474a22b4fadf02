"""Sparse attention (DeepSeek-V3.2 DSA style): GQA attention that reads only the tokens a lightning
indexer selects per query, over the paged KV cache plus an indexer key cache (harness/partition/sparse_layout.py).

Per layer the indexer projects one RoPE'd key per token (replicated weights; stored, like K/V, only on the
token's DCP owner), and per query its own indexer heads' queries and weights (rows split over TP; the DCP
group's gathered). Each rank scores the tokens it stores, score(s, t) = sum_h w_h(s) relu(q_h(s) . k(t)) in
float64, places the partial scores at their tokens' positions and sums them over TP: every DCP rank's
tokens compete. The first index_sinks positions always stay; the index_topk best visible tokens are
selected (all while there are no more). Under DCP member m selects for its contiguous shard of query rows
and the selections are all-gathered; every rank then attends its own stored tokens among them, and the DCP
partials merge by LSE as in the dense path (model.py). Faults: harness/engine/faults.py (dsa-*).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from harness.engine.fault import FaultFlags
from harness.engine.layers.dense import (
    Batch,
    Capture,
    Decoder,
    HeadMap,
    Hyper,
    LayerWeights,
    LocalWeights,
    RopeCache,
    apply_rope,
)
from harness.engine.runtime.kvcache import PagedKVCache, zeroed
from harness.engine.runtime.parallel import Collectives
from harness.partition.cache_groups import CacheGroup, GroupedCapacity, check_aligned, grouped_capacity
from harness.partition.layout import Placement
from harness.partition.sparse_layout import (
    INDEX_GROUP,
    IndexerRank,
    SparseShape,
    indexer_query_rows,
    row_source,
)
from harness.records.rankreport import SparseReport
from harness.specs.model import ModelSpec


@dataclass
class IndexerWeights:
    """One layer's indexer on a rank: q [n_own * d, H] and w [n_own, H] rows of its own heads, k [d, H]."""

    q: torch.Tensor
    w: torch.Tensor
    k: torch.Tensor


def shard_indexer(full: dict[str, torch.Tensor], spec: ModelSpec, shape: SparseShape, irank: IndexerRank,
                  dtype: torch.dtype, device: torch.device, flags: FaultFlags | None = None) -> list[IndexerWeights]:
    """Every layer's indexer rows of the heads `irank` holds (the key projection whole); under the fault
    dsa-indexer-weights-offset the head weights of the next len(heads) heads."""
    d, heads = shape.index_head_dim, list(irank.index_heads)
    w_heads = heads
    if flags is not None and flags.dsa_weights_offset:
        w_heads = [(h + len(heads)) % shape.index_heads for h in heads]
    cast = lambda t: t.to(device=device, dtype=dtype).contiguous()  # noqa: E731
    out = []
    for i in range(spec.layers):
        p = f"layers.{i}."
        # [heads * d, H] -> [heads, d, H] -> own heads' rows [n_own * d, H]
        q = full[p + "index_q.weight"].view(shape.index_heads, d, -1)[heads].reshape(len(heads) * d, -1)
        out.append(IndexerWeights(q=cast(q), w=cast(full[p + "index_w.weight"][w_heads]),
                                  k=cast(full[p + "index_k.weight"])))
    return out


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Selection:
    """Per query row: the selected positions [B, S, k] (-1: none) and the relative score margin [B, S]."""

    positions: torch.Tensor
    margins: torch.Tensor


def top_tokens(scores: torch.Tensor, k: int) -> Selection:
    """The k best positions of scores [B, R, T] (-inf: not a candidate), ties to the lower position (a
    stable sort: every topology breaks them alike), -1 where fewer than k are candidates."""
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)  # [B, R, T]
    k_eff = min(k, scores.shape[-1])
    top, pos = vals[..., :k_eff], idx[..., :k_eff]
    positions = pos.masked_fill(torch.isinf(top) & (top < 0), -1)  # [B, R, k_eff]
    if k_eff < k:
        positions = torch.cat((positions, positions.new_full((*positions.shape[:-1], k - k_eff), -1)), dim=-1)
    margins = torch.ones(scores.shape[:-1], dtype=torch.float64, device=scores.device)  # [B, R]
    if scores.shape[-1] > k_eff:
        last, nxt = vals[..., k_eff - 1], vals[..., k_eff]
        finite = torch.isfinite(last) & torch.isfinite(nxt)
        rel = ((last - nxt) / last.abs().clamp_min(1e-300)).clamp(0.0, 1.0)
        # an exact tie (scores of exactly 0: every ReLU closed) is broken by position alike everywhere
        margins = torch.where(finite & (last != nxt), rel, margins)
    return Selection(positions, margins)


class SparseDecoder(Decoder):
    """Decoder whose attention reads only the indexer's selected tokens; the rest is Decoder's."""

    def __init__(self, weights: LocalWeights, heads: HeadMap, hyper: Hyper, comm: Collectives,
                 cache: PagedKVCache, flags: FaultFlags, placement: Placement, indexer: list[IndexerWeights],
                 shape: SparseShape, index_blocks: int) -> None:
        super().__init__(weights, heads, hyper, comm, cache, flags, placement)
        self.indexer = indexer
        self.shape = shape
        d = shape.index_head_dim
        dev, dtype = weights.norm.device, weights.norm.dtype
        self.index_keys = [zeroed((index_blocks * cache.block_size, d), dtype, dev)
                           for _ in indexer]  # [rows, d] per layer, addressed by the KV pool's rows
        self._index_rope = RopeCache(d, hyper.rope_theta)
        self._keys: tuple[torch.Tensor, torch.Tensor] | None = None  # (positions, valid) [B, L] of this forward
        self.traced = False  # the first forward's first sequence's selections are recorded
        self._tracing = False
        self.trace: list[tuple[tuple[int, ...], ...]] = []  # per layer, per query position
        self.trace_margins: list[tuple[float, ...]] = []

    def hidden(self, batch: Batch, capture: Capture | None = None, embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Decoder.hidden; the decoder's first forward records its first sequence's selections."""
        self._tracing = not self.traced
        out = super().hidden(batch, capture, embeds)
        self.traced, self._tracing = True, False
        return out

    def _key_index(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, pos, valid = super()._key_index(batch)
        self._keys = (pos, valid)
        return rows, pos, valid

    def _attention(self, i: int, layer: LayerWeights, h: torch.Tensor, batch: Batch, write_rows: torch.Tensor,
                   stored: torch.Tensor, flat: torch.Tensor, mask: tuple[torch.Tensor, str, torch.Tensor | None],
                   tables: tuple[torch.Tensor, torch.Tensor],
                   k_tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The dense attention of this rank's own Q heads over the selected tokens it stores."""
        assert self._keys is not None
        key_pos, key_valid = self._keys
        sel = self._select(i, h, batch, write_rows, stored, flat)  # [B, S, k]
        # [B, 1, L, 1] == [B, S, 1, k] -> [B, S, L]: local key l is among query s's selected tokens
        chosen = (key_pos[:, None, :, None] == sel[:, :, None, :]).any(dim=-1) & key_valid[:, None, :]
        return super()._attention(i, layer, h, batch, write_rows, stored, flat, (mask[0] & chosen, "mask", None),
                                  tables, k_tables)

    def _select(self, i: int, h: torch.Tensor, batch: Batch, write_rows: torch.Tensor, stored: torch.Tensor,
                flat: torch.Tensor) -> torch.Tensor:
        """Store the new tokens' indexer keys, score this rank's stored tokens, select: [B, S, k] positions."""
        assert self._keys is not None
        key_pos, key_valid = self._keys
        ix, d, comm = self.indexer[i], self.shape.index_head_dim, self.comm
        B, S, _ = h.shape
        itab = self._index_rope.tables(batch.positions, h.dtype)
        key = apply_rope((h @ ix.k.T).view(B, S, 1, d), itab)[:, :, 0]  # [B, S, d]
        self.index_keys[i].index_copy_(0, write_rows, key[stored])
        keys = self.index_keys[i].index_select(0, flat).view(B, -1, d)  # [B, L, d]
        q = apply_rope((h @ ix.q.T).view(B, S, -1, d), itab)  # [B, S, n_own, d]
        w = h @ ix.w.T  # [B, S, n_own]
        q, w = comm.gather_dcp(q, dim=2), comm.gather_dcp(w, dim=2)  # the DCP group's heads: [B, S, n_group(, d)]
        dots = torch.einsum("bshd,bld->bshl", q.double(), keys.double()).relu()  # [B, S, n_group, L]
        partial = torch.einsum("bsh,bshl->bsl", w.double() / d ** 0.5, dots) * key_valid[:, None, :]  # [B, S, L]
        T = int(batch.positions.max()) + 2  # global positions, one past the last for a shifted key range
        scores = torch.zeros(B, S, T, dtype=torch.float64, device=h.device)
        scores.scatter_add_(2, key_pos[:, None, :].expand(B, S, -1), partial)  # [B, S, T] at the tokens' positions
        scores = comm.reduce_tp(scores)  # sum over TP: every DCP rank's tokens, every indexer head
        return self._choose(i, scores, batch, key_pos, key_valid)

    def _choose(self, i: int, scores: torch.Tensor, batch: Batch, key_pos: torch.Tensor,
                key_valid: torch.Tensor) -> torch.Tensor:
        """The selection of every query row from its scores [B, S, T] over global positions."""
        shape, comm, flags = self.shape, self.comm, self.flags
        B, S, T = scores.shape
        t = torch.arange(T, device=scores.device)
        pos = batch.positions[:, :, None]  # [B, S, 1]
        lo = flags.dsa_index_shift
        cand = (t >= lo) & (t <= pos + lo) & batch.valid[:, :, None]  # [B, S, T]: the indexer's key range
        scores = scores.masked_fill(~cand, float("-inf"))
        if shape.index_sinks:
            sinks = cand & (t < shape.index_sinks)
            if flags.dsa_sinks_evicted:  # kept only while the query sees no more than index_topk tokens
                sinks &= cand.sum(dim=-1, keepdim=True) <= shape.index_topk
            scores = scores.masked_fill(sinks, float("inf"))
        k = shape.index_topk
        if flags.dsa_local_topk and comm.dcp > 1:  # the fault: candidates among this rank's own tokens only
            own = torch.zeros(B, T, dtype=torch.long, device=scores.device)
            own.scatter_add_(1, key_pos, key_valid.long())  # [B, T]: 1 where this rank stores the position
            picked = top_tokens(scores.masked_fill(own[:, None, :] == 0, float("-inf")), k)
        elif comm.dcp == 1:
            picked = top_tokens(scores, k)
        else:
            picked = self._row_sharded(scores, k)
        if self._tracing:
            self._record(i, picked, batch)
        return picked.positions

    def _row_sharded(self, scores: torch.Tensor, k: int) -> Selection:
        """Member m selects for its rows (indexer_query_rows); the selections are all-gathered and row s
        reads its own from row_source (the attention's planner)."""
        comm = self.comm
        B, S, _ = scores.shape
        mine = indexer_query_rows(S, comm.dcp, comm.dcp_rank)
        chunk = -(-S // comm.dcp)
        part = top_tokens(scores[:, mine.start:mine.stop], k)
        # [B, rows, k] positions + [B, rows] margins -> [B, rows, k + 1] float64, padded to chunk rows
        packed = torch.full((B, chunk, k + 1), -1.0, dtype=torch.float64, device=scores.device)
        packed[:, :len(mine), :k] = part.positions.double()
        packed[:, :len(mine), k] = part.margins
        every = comm.stack_dcp(packed)  # [dcp, B, chunk, k + 1]
        src = [row_source(s, S, comm.dcp, self.flags.dsa_row_rule) for s in range(S)]
        rows = torch.stack([every[m, :, j] for m, j in src], dim=1)  # [B, S, k + 1]
        return Selection(rows[..., :k].long(), rows[..., k])

    def _record(self, i: int, picked: Selection, batch: Batch) -> None:
        """Layer i's selections of the first sequence's valid query rows (the trace of the rank report)."""
        valid = batch.valid[0].tolist()
        rows = [tuple(sorted(p for p in picked.positions[0, s].tolist() if p >= 0))
                for s in range(len(valid)) if valid[s]]
        margins = [float(m) for m, v in zip(picked.margins[0].tolist(), valid) if v]
        while len(self.trace) <= i:
            self.trace.append(())
            self.trace_margins.append(())
        self.trace[i], self.trace_margins[i] = tuple(rows), tuple(margins)


def sparse_capacity(groups: tuple[CacheGroup, ...], budget_bytes: int, flags: FaultFlags,
                    rank: int) -> tuple[GroupedCapacity, dict[str, int]]:
    """The one slot count of the KV and indexer-key groups, and the blocks each group is given; under the
    dsa-groups-unaligned fault the indexer keys get an equal share of the budget in blocks (seed 004's
    per-group fallback: no whole number of the other groups' slots), which only the layout check sees (its
    rows are more than the KV group's as long as its blocks are smaller). A correct capacity is validated
    slot-aligned here."""
    grouped = grouped_capacity(groups, budget_bytes, where=f"on rank {rank}")
    blocks = {g.name: grouped.blocks(g.name) for g in groups}
    if flags.dsa_groups_unaligned:
        g = grouped.group(INDEX_GROUP)
        blocks[INDEX_GROUP] = budget_bytes // len(groups) // g.block_bytes
    else:
        check_aligned(grouped, blocks, where=f"on rank {rank}")
    return grouped, blocks


def sparse_report(decoder: SparseDecoder, irank: IndexerRank, blocks: dict[str, int]) -> SparseReport:
    """The sparse record of a rank's report: indexer heads and checksums, cache group blocks, the trace."""
    d = decoder.shape.index_head_dim
    sums = {str(head): _digest([t for ix in decoder.indexer for t in (ix.q.view(-1, d, ix.q.shape[-1])[j], ix.w[j])])
            for j, head in enumerate(irank.index_heads)}
    return SparseReport(index_heads=irank.index_heads, index_weight_checksums=sums,
                        index_key_checksum=_digest([ix.k for ix in decoder.indexer]),
                        cache_group_blocks=dict(blocks), block_size=decoder.cache.block_size,
                        selected=tuple(decoder.trace), margins=tuple(decoder.trace_margins))
