"""The layout planner: the only place in the project with head and token partition math.

Rules (docs/architecture.md, Layout math; the bug classes: README.md):
- Q heads are split by tp: rank r holds heads [r * heads/tp, (r + 1) * heads/tp).
- KV heads are split over kv_tp_size = tp // dcp ranks, with kv_tp_rank = tp_rank // dcp, so
  the ranks of one DCP group (consecutive tp ranks sharing kv_tp_rank) hold identical KV heads.
- When kv_heads does not divide evenly over kv_tp_size, g = gcd(kv_heads, kv_tp_size) and groups
  of kv_tp_size / g KV-parallel ranks share the same kv_heads / g heads (GCD duplication).
- The Q -> KV mapping is always taken from global indices: kv(q) = q // (heads / kv_heads).
- Token t of a sequence is stored on one DCP rank of its group, by the group's placement:
  interleave K (token t on rank (t // K) % dcp; K = 1 is round-robin, t % dcp) or contiguous
  (the sequence's prompt of P tokens in dcp blocks of ceil(P / dcp), every later token on the last
  rank). A rank that owns no token of a sequence contributes nothing to the LSE merge.
- MLA (kv_lora_rank > 0): one latent row per token (kv_lora_rank + qk_rope_dim values, every layer)
  shared by all heads, planned as one KV head: every rank of a TP group holds the whole latent
  cache (duplication x tp // dcp), a DCP group stores each token's row once, on its owner.
- A speculator (draft or MTP) is not part of the DCP group: it uses the plain TP layout (dcp = 1).
- The vocabulary (embedding rows, lm_head rows) is split by tp into contiguous shards of
  ceil(vocab / tp) rows: rank r holds token ids [r * c, min((r + 1) * c, vocab)); the last shard(s)
  are zero-padded to c rows, the embedding is a masked lookup summed over TP and the logits are
  all-gathered with the padding cut.
- FFN columns are split contiguously, shard sizes differing by at most one.

All functions are pure; invalid configurations raise one ConfigError naming the numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, TypeVar

from harness.core.errors import ConfigError

LAYOUT_SCHEMA_VERSION = 3  # 2: the `hybrid` section of harness plan; 3: `mla`, `token_owners`, placements
T = TypeVar("T")
PLACEMENTS: tuple[str, ...] = ("interleave", "contiguous")


@dataclass(frozen=True)
class Placement:
    """How a DCP group deals a sequence's tokens to its ranks: `interleave` in chunks of `size`
    tokens (size 1: round-robin) or `contiguous` blocks per sequence (size unused, 1)."""

    kind: str = "interleave"
    size: int = 1

    def __post_init__(self) -> None:
        if self.kind not in PLACEMENTS:
            raise ConfigError(f"DCP placement {self.kind!r} is not one of {', '.join(PLACEMENTS)}")
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise ConfigError(f"DCP interleave size {self.size!r} must be a positive integer")
        if self.kind == "contiguous" and self.size != 1:
            raise ConfigError(f"contiguous DCP placement takes no interleave size (got {self.size})")

    @property
    def label(self) -> str:
        if self.kind == "contiguous":
            return "contiguous"
        return "round-robin" if self.size == 1 else f"interleave {self.size}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "size": self.size, "label": self.label}


ROUND_ROBIN = Placement()


@dataclass(frozen=True)
class AttentionShape:
    """The numbers of a model that its partition depends on."""

    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    dtype_bytes: int
    ffn: int = 0
    vocab: int = 0
    kv_lora_rank: int = 0  # MLA: the latent width (0: not MLA); kv_heads is then 1 (the shared latent)
    qk_rope_dim: int = 0   # MLA: the decoupled RoPE key dims stored with the latent

    @property
    def q_per_kv(self) -> int:
        return self.heads // self.kv_heads

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0


@dataclass(frozen=True)
class RankLayout:
    """What one rank holds and how its Q heads read KV heads (all ids global)."""

    rank: int
    q_heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    kv_tp_rank: int
    dcp_rank: int
    dcp_group: int
    dcp_members: tuple[int, ...]
    group_q_heads: tuple[int, ...]
    q_to_kv: tuple[int, ...]
    q_to_local_kv: tuple[int, ...]
    group_q_to_local_kv: tuple[int, ...]
    ffn_shard: tuple[int, int]
    vocab_shard: tuple[int, int] = (0, 0)
    vocab_rows: int = 0  # rows of the embedding / lm_head shard: ceil(vocab / tp), padding included

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "q_heads": list(self.q_heads), "kv_heads": list(self.kv_heads),
            "dcp_group": self.dcp_group, "dcp_rank": self.dcp_rank, "dcp_members": list(self.dcp_members),
            "kv_tp_rank": self.kv_tp_rank, "q_to_kv": list(self.q_to_kv),
            "group_q_heads": list(self.group_q_heads), "ffn_shard": list(self.ffn_shard),
            "vocab_shard": list(self.vocab_shard), "vocab_rows": self.vocab_rows,
        }


@dataclass(frozen=True)
class LayoutPlan:
    """The full partition of one model over one (tp, dcp)."""

    shape: AttentionShape
    tp: int
    dcp: int
    kv_tp_size: int
    kv_gcd: int
    ranks: tuple[RankLayout, ...]
    kv_replicas: tuple[int, ...]
    kv_duplication: int
    kv_bytes_per_token_per_rank: int
    placement: Placement = ROUND_ROBIN
    q_replicated: bool = False  # MLA: every rank holds the Q weights of its whole DCP group (mla_layout.py)

    @property
    def dcp_groups(self) -> tuple[tuple[int, ...], ...]:
        return tuple(dict.fromkeys(r.dcp_members for r in self.ranks))

    @property
    def storage_note(self) -> str:
        """How a token's KV is stored, where it is not K and V per head: MLA's shared latent row."""
        if not self.shape.mla:
            return ""
        return (f"MLA latent row ({self.shape.kv_lora_rank} + {self.shape.qk_rope_dim} values) stored on "
                f"{self.kv_duplication} rank(s) per token")

    @property
    def kv_bytes_per_token_per_dcp_group(self) -> int:
        """Each token is stored once per DCP group (on its owner rank)."""
        return self.kv_bytes_per_token_per_rank

    @property
    def kv_bytes_per_token_total(self) -> int:
        """All ranks together, per sequence token: groups x one stored copy each."""
        return self.kv_bytes_per_token_per_rank * (self.tp // self.dcp)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tp": self.tp, "dcp": self.dcp, "kv_tp_size": self.kv_tp_size, "kv_gcd": self.kv_gcd,
            "ranks": [r.to_dict() for r in self.ranks],
            "kv_replicas": list(self.kv_replicas), "kv_duplication": self.kv_duplication,
            "kv_bytes_per_token_per_rank": self.kv_bytes_per_token_per_rank,
            "kv_bytes_per_token_per_dcp_group": self.kv_bytes_per_token_per_dcp_group,
            "kv_bytes_per_token_total": self.kv_bytes_per_token_total,
            "vocab_rows_per_rank": vocab_rows_per_rank(self.shape.vocab, self.tp),
            "placement": self.placement.to_dict(), "q_replicated": self.q_replicated,
        }


@dataclass(frozen=True)
class PoolCapacity:
    """A rank's paged KV pool sized from a memory budget, in whole per-sequence slots."""

    budget_bytes: int
    block_size: int
    blocks_per_slot: int
    slots: int
    block_bytes: int

    @property
    def blocks(self) -> int:
        return self.slots * self.blocks_per_slot

    @property
    def pool_bytes(self) -> int:
        return self.blocks * self.block_bytes

    @property
    def tokens_per_rank(self) -> int:
        return self.blocks * self.block_size

    def to_dict(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget_bytes, "block_size": self.block_size,
                "blocks_per_slot": self.blocks_per_slot, "slots": self.slots, "blocks": self.blocks,
                "block_bytes": self.block_bytes, "pool_bytes": self.pool_bytes,
                "tokens_per_rank": self.tokens_per_rank}


def validate(shape: AttentionShape, tp: int, dcp: int) -> None:
    """Raise one ConfigError naming the numbers of the first rule the configuration breaks."""
    for name, value in (("heads", shape.heads), ("kv_heads", shape.kv_heads), ("head_dim", shape.head_dim),
                        ("layers", shape.layers), ("tp", tp), ("dcp", dcp)):
        if value <= 0:
            raise ConfigError(f"{name}={value} must be positive")
    if shape.mla and shape.kv_heads != 1:
        raise ConfigError(f"an MLA shape (kv_lora_rank={shape.kv_lora_rank}) has one shared latent per token: "
                          f"kv_heads={shape.kv_heads} must be 1")
    if shape.heads % shape.kv_heads:
        raise ConfigError(f"heads={shape.heads} is not divisible by kv_heads={shape.kv_heads}")
    if tp % dcp:
        raise ConfigError(f"dcp={dcp} does not divide tp={tp}")
    if shape.heads % tp:
        raise ConfigError(f"heads={shape.heads} is not divisible by tp={tp}")
    if shape.ffn and shape.ffn < tp:
        raise ConfigError(f"ffn={shape.ffn} is smaller than tp={tp}: some rank would hold no MLP columns")


def validate_q_mode(shape: AttentionShape, dcp: int, q_replicated: bool) -> None:
    """Q replication needs an MLA model (its q_b_proj / w_kc) and a DCP group to replicate over."""
    if not q_replicated:
        return
    if not shape.mla:
        raise ConfigError("Q-replicated DCP (topology suffix q) needs an MLA model (kv_lora_rank > 0); "
                          f"this model has kv_heads={shape.kv_heads} and no latent")
    if dcp < 2:
        raise ConfigError(f"Q-replicated DCP (topology suffix q) needs dcp > 1, got dcp={dcp}")


def kv_of_q(shape: AttentionShape, q_head: int) -> int:
    """The global KV head that global Q head `q_head` reads."""
    return q_head // shape.q_per_kv


def kv_heads_of(shape: AttentionShape, kv_tp_rank: int, kv_tp_size: int) -> tuple[int, ...]:
    """KV heads held by KV-parallel rank `kv_tp_rank` of `kv_tp_size`, with GCD duplication."""
    g = math.gcd(shape.kv_heads, kv_tp_size)
    ranks_per_group = kv_tp_size // g
    per_group = shape.kv_heads // g
    group = kv_tp_rank // ranks_per_group
    return tuple(range(group * per_group, (group + 1) * per_group))


def q_heads_of(shape: AttentionShape, tp_rank: int, tp: int) -> tuple[int, ...]:
    per_rank = shape.heads // tp
    return tuple(range(tp_rank * per_rank, (tp_rank + 1) * per_rank))


def dcp_members_of(rank: int, dcp: int) -> tuple[int, ...]:
    """The ranks of `rank`'s DCP group: consecutive tp ranks sharing kv_tp_rank = rank // dcp."""
    first = (rank // dcp) * dcp
    return tuple(range(first, first + dcp))


def local_kv_index(q_heads: tuple[int, ...], kv_heads: tuple[int, ...], shape: AttentionShape) -> tuple[int, ...]:
    """For each global Q head, the index of its KV head among `kv_heads`; raises if not held."""
    out = []
    for q in q_heads:
        kv = kv_of_q(shape, q)
        if kv not in kv_heads:
            raise ConfigError(f"layout error: Q head {q} reads KV head {kv}, not among held KV heads {list(kv_heads)}")
        out.append(kv_heads.index(kv))
    return tuple(out)


def naive_local_kv_index(n_q: int, n_kv: int) -> tuple[int, ...]:
    """The buggy mapping (fault gcd-naive-gqa): repeat_interleave over local counts, ignoring global ids."""
    per = max(1, n_q // n_kv)
    return tuple(min(i // per, n_kv - 1) for i in range(n_q))


def group_kv_slots(rank: RankLayout, naive: bool = False) -> tuple[int, ...]:
    """Which of `rank`'s held KV heads each Q head of its DCP group reads: the global-index mapping, or
    (`naive`, fault gcd-naive-gqa) the local-count mapping."""
    return naive_local_kv_index(len(rank.group_q_heads), len(rank.kv_heads)) if naive else rank.group_q_to_local_kv


def kv_bytes_per_stored_token(shape: AttentionShape, n_kv_heads: int) -> int:
    """K and V, every layer, for the KV heads one rank holds, for one token stored on that rank; under
    MLA the latent row (kv_lora_rank + qk_rope_dim values) every layer."""
    if shape.mla:
        return shape.layers * (shape.kv_lora_rank + shape.qk_rope_dim) * shape.dtype_bytes
    return 2 * shape.layers * n_kv_heads * shape.head_dim * shape.dtype_bytes


def plan_layout(shape: AttentionShape, tp: int, dcp: int = 1, kv_dcp: int | None = None,
                ffn_floor: bool = False, vocab_floor_offset: bool = False,
                placement: Placement = ROUND_ROBIN, q_replicated: bool = False) -> LayoutPlan:
    """The partition of `shape` over tp ranks with decode context parallel size dcp.

    `kv_dcp` overrides the dcp used for the KV split (faults only: kv_dcp=1 under dcp>1 is the
    TP-only layout that breaks DCP groups). `ffn_floor` and `vocab_floor_offset` (faults only)
    compute the FFN shards / the vocab shard offsets with floor division (see ffn_shard, vocab_shard).
    """
    validate(shape, tp, dcp)
    validate_q_mode(shape, dcp, q_replicated)
    kv_split_dcp = dcp if kv_dcp is None else kv_dcp
    kv_tp_size = tp // kv_split_dcp
    g = math.gcd(shape.kv_heads, kv_tp_size)
    ranks = []
    for rank in range(tp):
        kv_tp_rank = rank // kv_split_dcp
        q_heads = q_heads_of(shape, rank, tp)
        kv_heads = kv_heads_of(shape, kv_tp_rank, kv_tp_size)
        members = dcp_members_of(rank, dcp)
        group_q = tuple(q for m in members for q in q_heads_of(shape, m, tp))
        ranks.append(RankLayout(
            rank=rank, q_heads=q_heads, kv_heads=kv_heads, kv_tp_rank=kv_tp_rank,
            dcp_rank=rank % dcp, dcp_group=rank // dcp, dcp_members=members, group_q_heads=group_q,
            q_to_kv=tuple(kv_of_q(shape, q) for q in q_heads),
            q_to_local_kv=_local_mapping(q_heads, kv_heads, shape, faulty=kv_dcp is not None),
            group_q_to_local_kv=_local_mapping(group_q, kv_heads, shape, faulty=kv_dcp is not None),
            ffn_shard=ffn_shard(shape.ffn, rank, tp, floor=ffn_floor),
            vocab_shard=vocab_shard(shape.vocab, rank, tp, floor_offset=vocab_floor_offset),
            vocab_rows=vocab_rows_per_rank(shape.vocab, tp)))
    replicas = tuple(sum(kv in r.kv_heads for r in ranks) for kv in range(shape.kv_heads))
    return LayoutPlan(
        shape=shape, tp=tp, dcp=dcp, kv_tp_size=kv_tp_size, kv_gcd=g, ranks=tuple(ranks),
        kv_replicas=replicas, kv_duplication=kv_tp_size // g,
        kv_bytes_per_token_per_rank=kv_bytes_per_stored_token(shape, len(ranks[0].kv_heads)), placement=placement,
        q_replicated=q_replicated)


def replicate_dp(plan: LayoutPlan, dp: int) -> LayoutPlan:
    """Attention data parallel: `plan` (one DP rank's layout over its n ranks) held by each of dp DP ranks;
    rank d * n + j of the world holds what rank j of `plan` holds, inside DP rank d's own DCP groups."""
    if dp < 1:
        raise ConfigError(f"dp={dp} must be positive")
    n, groups = len(plan.ranks), len(plan.dcp_groups)
    ranks = tuple(replace(r, rank=d * n + r.rank, dcp_group=d * groups + r.dcp_group,
                          dcp_members=tuple(d * n + m for m in r.dcp_members))
                  for d in range(dp) for r in plan.ranks)
    return replace(plan, tp=n * dp, ranks=ranks, kv_replicas=tuple(k * dp for k in plan.kv_replicas))


def ffn_shard(ffn: int, rank: int, tp: int, floor: bool = False) -> tuple[int, int]:
    """MLP columns [lo, hi) of `rank`: contiguous, sizes differing by at most one (1536 over tp9).

    `floor` is the buggy split (fault ffn-floor-split): every rank takes ffn // tp columns, so the
    last ffn % tp columns are held by no rank."""
    if floor:
        per = ffn // tp
        return (rank * per, (rank + 1) * per)
    return (rank * ffn // tp, (rank + 1) * ffn // tp)


def vocab_rows_per_rank(vocab: int, tp: int) -> int:
    """Rows of every rank's embedding / lm_head shard: ceil(vocab / tp), the last shard(s) zero-padded."""
    return -(-vocab // tp)


def vocab_shard(vocab: int, rank: int, tp: int, floor_offset: bool = False) -> tuple[int, int]:
    """Token ids [lo, hi) whose embedding and lm_head rows `rank` holds (389 over tp4: 98, 98, 98, 95
    rows, the last padded to 98); hi - lo real rows, then vocab_rows_per_rank - (hi - lo) zero rows.

    `floor_offset` is the buggy offset (fault vocab-shard-offset): the shard starts at
    rank * (vocab // tp) while its size stays ceil(vocab / tp), so on an uneven split neighbouring
    shards overlap and the gathered logits of later ranks are shifted."""
    rows = vocab_rows_per_rank(vocab, tp)
    lo = min(rank * (vocab // tp if floor_offset else rows), vocab)
    return (lo, min(lo + rows, vocab))


def _local_mapping(q_heads: tuple[int, ...], kv_heads: tuple[int, ...], shape: AttentionShape,
                   faulty: bool) -> tuple[int, ...]:
    """Global-index mapping (raising if a KV head is not held). Only a fault's KV split (`faulty`)
    may leave Q heads without their KV head; there the buggy engines' local-count mapping is used."""
    if not faulty or all(kv_of_q(shape, q) in kv_heads for q in q_heads):
        return local_kv_index(q_heads, kv_heads, shape)
    return naive_local_kv_index(len(q_heads), len(kv_heads))


def plan_speculator(shape: AttentionShape, tp: int) -> LayoutPlan:
    """The speculator keeps the plain TP layout: it is not part of the DCP group (dcp = 1)."""
    return plan_layout(shape, tp, dcp=1)


def token_owner(position: T, dcp: int, placement: Placement = ROUND_ROBIN, prompt_len: Any = 0) -> T:
    """The DCP rank that stores the K/V of token `position` (an int, or a tensor of positions).

    `prompt_len` (contiguous placement only; an int or a tensor broadcasting with `position`) is the
    length of the sequence's first forward: its tokens are dealt in dcp blocks of ceil(prompt_len / dcp),
    every later token goes to the last rank."""
    if placement.kind == "interleave":
        return (position // placement.size) % dcp
    block = (prompt_len + dcp - 1) // dcp + (prompt_len <= 0)  # ceil(P / dcp), 1 where P = 0
    inside = position < prompt_len
    return inside * (position // block) + (position >= prompt_len) * (dcp - 1)


def local_token_count(seq_len: int, dcp_rank: int, dcp: int, placement: Placement = ROUND_ROBIN,
                      prompt_len: int = 0) -> int:
    """How many of positions 0..seq_len-1 DCP rank `dcp_rank` stores (closed form of counting
    token_owner over the positions)."""
    if placement.kind == "interleave":
        k = placement.size
        cycles, rest = divmod(max(seq_len, 0), k * dcp)
        return cycles * k + min(max(rest - dcp_rank * k, 0), k)
    block = max(1, -(-prompt_len // dcp))
    lo, hi = dcp_rank * block, min((dcp_rank + 1) * block, prompt_len, seq_len)
    later = max(0, seq_len - max(prompt_len, 0)) if dcp_rank == dcp - 1 else 0
    return max(0, hi - lo) + later


def local_positions(seq_len: int, dcp_rank: int, dcp: int, placement: Placement = ROUND_ROBIN,
                    prompt_len: int = 0) -> list[int]:
    """Positions 0..seq_len-1 that DCP rank `dcp_rank` stores, in increasing (storage) order: the positions
    whose token_owner is `dcp_rank`, listed by the ranges that rule gives (an engine calls this per sequence
    and forward, so it takes time in the rank's share, not in seq_len)."""
    if placement.kind == "interleave":  # chunk c of `size` positions goes to rank c % dcp
        k = placement.size
        starts = range(dcp_rank * k, max(seq_len, 0), k * dcp)
        return [t for start in starts for t in range(start, min(start + k, seq_len))]
    block = (prompt_len + dcp - 1) // dcp + (prompt_len <= 0)  # token_owner's block
    inside = range(dcp_rank * block, min((dcp_rank + 1) * block, prompt_len, seq_len))  # the prompt's block
    later = range(max(prompt_len, 0), seq_len) if dcp_rank == dcp - 1 else range(0)  # every later token: the last rank
    return [*inside, *later]


def max_local_tokens(max_seq_len: int, dcp: int, placement: Placement = ROUND_ROBIN) -> int:
    """The most tokens of one sequence of up to max_seq_len tokens that any rank of a DCP group stores:
    rank 0's share under interleave; under contiguous the whole sequence bounds it (a one-token
    prompt leaves every later token to the last rank)."""
    if placement.kind == "contiguous" and dcp > 1:
        return max_seq_len
    return local_token_count(max_seq_len, 0, dcp, placement)


def pool_capacity(plan: LayoutPlan, budget_bytes: int, max_seq_len: int, block_size: int = 16) -> PoolCapacity:
    """Size a rank's KV pool from a budget: a whole number of per-sequence slots, each holding
    the rank's largest share (max_local_tokens; ceil(max_seq_len / dcp) round-robin) of one
    max-length sequence.

    Raises naming the shortfall when the budget cannot hold one slot (never clamps to one).
    """
    if block_size <= 0 or max_seq_len <= 0 or budget_bytes < 0:
        raise ConfigError(f"block_size={block_size}, max_seq_len={max_seq_len} must be positive "
                          f"and budget={budget_bytes} bytes non-negative")
    tokens_per_slot = max_local_tokens(max_seq_len, plan.dcp, plan.placement)
    blocks_per_slot = -(-tokens_per_slot // block_size)
    block_bytes = block_size * plan.kv_bytes_per_token_per_rank
    slot_bytes = blocks_per_slot * block_bytes
    slots = budget_bytes // slot_bytes
    if slots < 1:
        raise ConfigError(
            f"KV budget of {budget_bytes} bytes per rank cannot hold one sequence slot of {slot_bytes} bytes "
            f"({blocks_per_slot} blocks x {block_size} tokens x {plan.kv_bytes_per_token_per_rank} bytes/token, "
            f"max_seq_len={max_seq_len}, dcp={plan.dcp}): short by {slot_bytes - budget_bytes} bytes")
    return PoolCapacity(budget_bytes=budget_bytes, block_size=block_size, blocks_per_slot=blocks_per_slot,
                        slots=slots, block_bytes=block_bytes)


def block_pool(plan: LayoutPlan, budget_bytes: int, max_seq_len: int, block_size: int = 16) -> PoolCapacity:
    """A rank's pool as an engine that sizes it in whole blocks sizes it (vLLM: floor(budget / block bytes)
    blocks, not whole sequence slots): a PoolCapacity of one-block "slots". Raises like pool_capacity when the
    budget cannot hold one max-length sequence."""
    whole = pool_capacity(plan, budget_bytes, max_seq_len, block_size)  # the shortfall check
    return PoolCapacity(budget_bytes=budget_bytes, block_size=block_size, blocks_per_slot=1,
                        slots=budget_bytes // whole.block_bytes, block_bytes=whole.block_bytes)


# how an engine turns a KV budget into its pool (a layout entry's pool "sizing"; absent: whole slots, as the planner)
POOL_SIZINGS: dict[str, Callable[[LayoutPlan, int, int, int], PoolCapacity]] = {"slots": pool_capacity,
                                                                                "blocks": block_pool}


def slot_pool(plan: LayoutPlan, slots: int, max_seq_len: int, block_size: int) -> PoolCapacity:
    """A pool of exactly `slots` sequence slots for `plan`, sized by the planner's own rule: the budget
    is `slots` times the planner's slot size (blocks_per_slot x block_bytes)."""
    unit = pool_capacity(plan, 2 ** 62, max_seq_len, block_size)  # only its per-slot numbers are used
    return pool_capacity(plan, slots * unit.blocks_per_slot * unit.block_bytes, max_seq_len, block_size)
