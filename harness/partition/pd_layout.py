"""Disaggregated prefill/decode: how each decode rank's KV cache is assembled from the prefill ranks'.

Both sides are layout.py plans of the same model (prefill over its (tp, dcp, placement), decode over its
own); nothing here re-derives heads or token owners:
- A decode rank holds the KV heads of its decode plan (GCD duplication included). KV head h comes from
  one prefill DCP group holding h: the group of the lowest prefill rank holding it. Its slice in each
  source rank is the index of h among that rank's held KV heads (global ids), its slice at the
  destination the index of h among the decode rank's held KV heads.
- Token t of the prompt is read from the prefill DCP rank that stored it (the prefill placement's
  token_owner) at that rank's storage row (its index in the prefill rank's local_positions), and
  written only on the decode DCP rank that owns it under the decode placement.
- MLA: the latent row is planned as the one KV head (layout.py), so it moves like a KV head: every
  decode rank of a TP group receives the rows its DCP rank owns.
- Hybrid models: a linear-attention layer keeps one conv and one recurrent state per sequence, whole on
  every rank of a DCP group; a decode rank receives the state of its V heads at the end of the prompt
  from the lowest prefill rank holding them (hybrid_layout.py's linear split on both sides).
Bytes moved per request: every decode rank's owned token rows times its KV bytes per stored token
(layout.kv_bytes_per_stored_token), plus the linear state of its V heads on a hybrid model.
All functions are pure; an impossible pair raises one ConfigError naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.core.errors import ConfigError
from harness.partition.hybrid_layout import LinearPlan
from harness.partition.layout import LayoutPlan, local_positions, local_token_count, token_owner


@dataclass(frozen=True)
class HeadSource:
    """Where one KV head of a decode rank comes from: the prefill ranks of one DCP group (by prefill DCP
    rank) and the head's slice in each of them (its index among that rank's held KV heads)."""

    kv_head: int
    dest_slot: int
    sources: tuple[int, ...]
    src_slots: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"kv_head": self.kv_head, "dest_slot": self.dest_slot, "sources": list(self.sources),
                "src_slots": list(self.src_slots)}


@dataclass(frozen=True)
class PDRank:
    """One decode rank's assembly: its heads' sources and its DCP rank (which token rows it keeps)."""

    rank: int
    dcp_rank: int
    kv_heads: tuple[int, ...]
    heads: tuple[HeadSource, ...]

    @property
    def prefill_ranks(self) -> tuple[int, ...]:
        return tuple(sorted({r for h in self.heads for r in h.sources}))

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "dcp_rank": self.dcp_rank, "kv_heads": list(self.kv_heads),
                "prefill_ranks": list(self.prefill_ranks), "heads": [h.to_dict() for h in self.heads]}


@dataclass(frozen=True)
class PDPlan:
    """The transfer plan of one model from a prefill layout to a decode layout."""

    prefill: LayoutPlan
    decode: LayoutPlan
    ranks: tuple[PDRank, ...]

    def owned_positions(self, rank: int, tokens: int) -> list[int]:
        """Prompt positions 0..tokens-1 decode rank `rank` stores, in storage order."""
        r = self.decode.ranks[rank]
        return local_positions(tokens, r.dcp_rank, self.decode.dcp, self.decode.placement, tokens)

    def source_rows(self, head: HeadSource, positions: list[int], tokens: int) -> list[tuple[int, int]]:
        """For each of `positions` of a prompt of `tokens` tokens: (prefill rank, row in its storage order)
        holding it for `head`."""
        p = self.prefill
        rows = [{t: i for i, t in enumerate(local_positions(tokens, d, p.dcp, p.placement, tokens))}
                for d in range(p.dcp)]
        out = []
        for t in positions:
            owner = token_owner(t, p.dcp, p.placement, tokens)
            out.append((head.sources[owner], rows[owner][t]))
        return out

    def bytes_per_rank(self, tokens: int) -> list[int]:
        """KV bytes each decode rank receives for a prompt of `tokens` tokens."""
        d = self.decode
        return [local_token_count(tokens, r.dcp_rank, d.dcp, d.placement, tokens) * d.kv_bytes_per_token_per_rank
                for r in d.ranks]

    def to_dict(self, tokens: int) -> dict[str, Any]:
        per_rank = self.bytes_per_rank(tokens)
        return {"prefill": {"tp": self.prefill.tp, "dcp": self.prefill.dcp, "kv_gcd": self.prefill.kv_gcd,
                            "kv_duplication": self.prefill.kv_duplication,
                            "placement": self.prefill.placement.to_dict(),
                            "kv_heads": [list(r.kv_heads) for r in self.prefill.ranks]},
                "decode": {"tp": self.decode.tp, "dcp": self.decode.dcp, "kv_gcd": self.decode.kv_gcd,
                           "kv_duplication": self.decode.kv_duplication,
                           "placement": self.decode.placement.to_dict()},
                "ranks": [{**r.to_dict(), "token_rows": local_token_count(
                    tokens, r.dcp_rank, self.decode.dcp, self.decode.placement, tokens), "bytes": b}
                          for r, b in zip(self.ranks, per_rank)],
                "tokens": tokens, "kv_bytes_per_request": sum(per_rank)}


def head_sources(prefill: LayoutPlan, kv_head: int) -> tuple[int, ...]:
    """The prefill ranks (one DCP group, by DCP rank) the KV head is read from: the group of the lowest
    prefill rank holding it."""
    holders = [r for r in prefill.ranks if kv_head in r.kv_heads]
    if not holders:
        raise ConfigError(f"no prefill rank holds KV head {kv_head} (prefill tp={prefill.tp}, dcp={prefill.dcp})")
    return holders[0].dcp_members


def plan_pd(prefill: LayoutPlan, decode: LayoutPlan) -> PDPlan:
    """The assembly of every decode rank's KV heads from `prefill`'s ranks (both plans of one model)."""
    if prefill.shape != decode.shape:
        raise ConfigError("prefill and decode plans are of different models")
    if decode.placement.kind == "contiguous" and decode.dcp > 1 or prefill.placement.kind == "contiguous" \
            and prefill.dcp > 1:
        raise ConfigError("a disaggregated topology takes interleaved or round-robin DCP placements, not "
                          "contiguous (c): a contiguous owner depends on the sequence's first forward, which the "
                          "decode side does not run")
    ranks = []
    for r in decode.ranks:
        heads = []
        for slot, h in enumerate(r.kv_heads):
            sources = head_sources(prefill, h)
            heads.append(HeadSource(kv_head=h, dest_slot=slot, sources=sources,
                                    src_slots=tuple(prefill.ranks[s].kv_heads.index(h) for s in sources)))
        ranks.append(PDRank(rank=r.rank, dcp_rank=r.dcp_rank, kv_heads=r.kv_heads, heads=tuple(heads)))
    return PDPlan(prefill=prefill, decode=decode, ranks=tuple(ranks))


@dataclass(frozen=True)
class StateSource:
    """A decode rank's linear-attention state at the end of the prompt (hybrid models): its V heads, and
    for each the prefill rank it is read from (the lowest holding it; the state is whole on every rank of
    a DCP group), with the bytes of its conv and recurrent state over all linear layers."""

    rank: int
    v_heads: tuple[int, ...]
    sources: tuple[int, ...]
    state_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "v_heads": list(self.v_heads), "sources": list(self.sources),
                "prefill_ranks": sorted(set(self.sources)), "state_bytes": self.state_bytes}


def plan_pd_state(prefill: LinearPlan, decode: LinearPlan) -> tuple[StateSource, ...]:
    """Where each decode rank's linear-attention state comes from (hybrid_layout.py's V-head split on both sides)."""
    out = []
    for r in decode.ranks:
        sources = []
        for v in r.v_heads:
            holders = [p.rank for p in prefill.ranks if v in p.v_heads]
            if not holders:
                raise ConfigError(f"no prefill rank holds linear V head {v} (prefill tp={prefill.tp})")
            sources.append(holders[0])
        out.append(StateSource(rank=r.rank, v_heads=r.v_heads, sources=tuple(sources),
                               state_bytes=decode.layers * (r.conv_state_bytes + r.recurrent_state_bytes)))
    return tuple(out)


def naive_head_sources(plan: PDPlan, rank: int) -> tuple[HeadSource, ...]:
    """The buggy sources (fault pd-gqa-replication, vllm-ascend #3366): KV head h read from prefill
    KV-parallel rank h, its first slice, as if each prefill rank held one distinct head. Equal to the
    plan's sources unless the prefill side duplicates KV heads (prefill tp // dcp above the KV heads)."""
    pre = plan.prefill
    if pre.kv_tp_size <= pre.shape.kv_heads:
        return plan.ranks[rank].heads
    out = []
    for h in plan.ranks[rank].heads:
        members = pre.ranks[min(h.kv_head, pre.kv_tp_size - 1) * pre.dcp].dcp_members
        out.append(HeadSource(kv_head=h.kv_head, dest_slot=h.dest_slot, sources=members, src_slots=(0,) * len(members)))
    return tuple(out)
