"""Sparse attention (DeepSeek-V3.2 DSA style) partition math: the lightning indexer's heads per rank, its
key cache rows per rank under DCP, the query-row shard each rank selects for, and the cache groups.

The indexer scores every past token t for a query s as sum_h w_h(s) * relu(q_h(s) . k(t)) over its
`index_heads` heads (one indexer key per token, shared by the heads) and the attention reads only the
`index_topk` best tokens (the first `index_sinks` positions always among them). Under TP the indexer heads
split like Q heads (contiguous, over all tp ranks) and the DCP group gathers its members' heads; each rank
scores the tokens it stores (its indexer key rows follow the DCP token placement, as its KV rows do); the
partial scores, at their tokens' positions, are summed over TP. Selection is row-sharded over the DCP
group: member m selects for the query rows indexer_query_rows gives it, and every member reads row s's
selection from row_source(s); the selections are global (every DCP rank's tokens compete)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.core.errors import ConfigError
from harness.partition.cache_groups import CacheGroup, GroupedCapacity
from harness.partition.layout import (
    ROUND_ROBIN,
    LayoutPlan,
    Placement,
    PoolCapacity,
    dcp_members_of,
    max_local_tokens,
)

KV_GROUP = "kv"              # the full KV pages of the sparse attention layers
INDEX_GROUP = "index_keys"   # the indexer's key rows (one per stored token per layer)
ROW_RULES: tuple[str, ...] = ("contiguous", "round-robin")


@dataclass(frozen=True)
class SparseShape:
    """The `sparse:` mapping of a model YAML: indexer heads and width, tokens selected per query, sinks."""

    index_heads: int
    index_head_dim: int
    index_topk: int
    index_sinks: int = 0

    def __post_init__(self) -> None:
        for name in ("index_heads", "index_head_dim", "index_topk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"sparse: {name} must be a positive integer, got {value!r}")
        if isinstance(self.index_sinks, bool) or not isinstance(self.index_sinks, int) or not (
                0 <= self.index_sinks < self.index_topk):
            raise ConfigError(f"sparse: index_sinks must be an integer in [0, index_topk={self.index_topk}), "
                              f"got {self.index_sinks!r}")
        if self.index_head_dim % 2:
            raise ConfigError(f"sparse: index_head_dim={self.index_head_dim} must be even (RoPE)")

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(frozen=True)
class IndexerRank:
    """One rank's indexer: the heads whose Q / weight rows it holds and its DCP group's heads (gathered)."""

    rank: int
    index_heads: tuple[int, ...]
    group_index_heads: tuple[int, ...]
    dcp_rank: int

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "index_heads": list(self.index_heads),
                "group_index_heads": list(self.group_index_heads), "dcp_rank": self.dcp_rank}


@dataclass(frozen=True)
class SparsePlan:
    shape: SparseShape
    tp: int
    dcp: int
    layers: int
    dtype_bytes: int
    ranks: tuple[IndexerRank, ...]
    placement: Placement = ROUND_ROBIN

    @property
    def key_bytes_per_token(self) -> int:
        """Indexer key bytes one stored token takes on a rank (every layer)."""
        return self.layers * self.shape.index_head_dim * self.dtype_bytes

    @property
    def selection_rule(self) -> str:
        s = self.shape
        sinks = f"positions 0..{s.index_sinks - 1} always kept, " if s.index_sinks else ""
        dcp = (f"each of the {self.dcp} DCP ranks scores its own stored tokens, partial scores over indexer "
               f"heads summed over TP, query rows selected in contiguous shards over the DCP group and "
               f"all-gathered: the global top-{s.index_topk}" if self.dcp > 1 else
               f"partial scores over indexer heads summed over TP: the top-{s.index_topk}")
        return (f"per query and layer: score(t) = sum over {s.index_heads} indexer heads of w_h * relu(q_h . k_t); "
                f"{sinks}{dcp} of the visible tokens (all of them while there are at most {s.index_topk})")

    def to_dict(self) -> dict[str, Any]:
        return {**self.shape.to_dict(), "tp": self.tp, "dcp": self.dcp,
                "key_bytes_per_token": self.key_bytes_per_token, "selection_rule": self.selection_rule,
                "ranks": [r.to_dict() for r in self.ranks]}


def index_heads_of(index_heads: int, tp: int, rank: int) -> tuple[int, ...]:
    """The indexer heads rank `rank` of `tp` holds: a contiguous 1/tp of them."""
    if index_heads % tp:
        raise ConfigError(f"sparse: index_heads={index_heads} is not divisible by tp={tp}")
    per = index_heads // tp
    return tuple(range(rank * per, (rank + 1) * per))


def plan_sparse(shape: SparseShape, attention: LayoutPlan) -> SparsePlan:
    """The indexer's split over `attention`'s tp / dcp / placement."""
    tp, dcp = attention.tp, attention.dcp
    ranks = tuple(IndexerRank(rank=r, index_heads=index_heads_of(shape.index_heads, tp, r),
                              group_index_heads=tuple(h for m in dcp_members_of(r, dcp)
                                                      for h in index_heads_of(shape.index_heads, tp, m)),
                              dcp_rank=dcp_members_of(r, dcp).index(r))
                  for r in range(tp))
    return SparsePlan(shape=shape, tp=tp, dcp=dcp, layers=attention.shape.layers,
                      dtype_bytes=attention.shape.dtype_bytes, ranks=ranks, placement=attention.placement)


def indexer_query_rows(n_rows: int, dcp: int, dcp_rank: int) -> range:
    """The query rows (of a forward's n_rows new tokens) DCP rank `dcp_rank` selects for: contiguous
    shards of ceil(n_rows / dcp) rows."""
    chunk = -(-n_rows // dcp)
    lo = min(n_rows, dcp_rank * chunk)
    return range(lo, min(n_rows, lo + chunk))


def row_source(row: int, n_rows: int, dcp: int, rule: str = "contiguous") -> tuple[int, int]:
    """(DCP member, index among its rows) whose selection query row `row` reads; `rule` "contiguous" is
    indexer_query_rows' own split, "round-robin" another planner's (the dsa-planner-rows fault)."""
    if rule not in ROW_RULES:
        raise ConfigError(f"row rule {rule!r} is not one of {', '.join(ROW_RULES)}")
    if rule == "round-robin":
        return row % dcp, row // dcp
    chunk = -(-n_rows // dcp)
    return row // chunk, row % chunk


def sparse_cache_groups(attention: LayoutPlan, sparse: SparsePlan, max_seq_len: int,
                        block_size: int) -> tuple[CacheGroup, ...]:
    """A rank's cache groups: the full KV pages and the indexer key rows, both one row per stored token, so
    both take the rank's DCP share of max_seq_len tokens per slot in blocks of block_size tokens."""
    if block_size < 1 or max_seq_len < 1:
        raise ConfigError(f"block_size={block_size} and max_seq_len={max_seq_len} must be positive")
    blocks = -(-max_local_tokens(max_seq_len, attention.dcp, attention.placement) // block_size)
    return (CacheGroup(KV_GROUP, blocks, block_size * attention.kv_bytes_per_token_per_rank),
            CacheGroup(INDEX_GROUP, blocks, block_size * sparse.key_bytes_per_token))


def kv_pool_of(grouped: GroupedCapacity, block_size: int) -> PoolCapacity:
    """The KV group of a sparse model's grouped capacity as the paged KV cache's PoolCapacity."""
    kv = grouped.group(KV_GROUP)
    return PoolCapacity(budget_bytes=grouped.budget_bytes, block_size=block_size, blocks_per_slot=kv.blocks_per_seq,
                        slots=grouped.slots, block_bytes=kv.block_bytes)
