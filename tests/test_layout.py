"""The layout planner against brute-force enumeration (docs/architecture.md, Layout math).

Expected values are rebuilt here from first principles (loops over heads and ranks), not from
the planner's own formulas, wherever that is possible.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest

from harness.core.errors import ConfigError
from harness.partition.layout import (
    AttentionShape,
    local_token_count,
    naive_local_kv_index,
    plan_layout,
    plan_speculator,
    pool_capacity,
    token_owner,
    vocab_rows_per_rank,
    vocab_shard,
)

HEADS = (8, 9, 12, 16, 24, 32, 64)
KV_HEADS = (1, 2, 3, 4, 6, 8)
TPS = (1, 2, 3, 4, 8, 9)
GRID = [(h, kv, tp, dcp) for h in HEADS for kv in KV_HEADS for tp in TPS
        for dcp in range(1, tp + 1) if tp % dcp == 0]
VALID = [c for c in GRID if c[0] % c[1] == 0 and c[0] % c[2] == 0]
INVALID = [c for c in GRID if c not in VALID]


def shape(heads: int, kv: int, head_dim: int = 8, layers: int = 2, dtype_bytes: int = 4,
          ffn: int = 0) -> AttentionShape:
    return AttentionShape(heads=heads, kv_heads=kv, head_dim=head_dim, layers=layers,
                          dtype_bytes=dtype_bytes, ffn=ffn)


def kv_reader_table(heads: int, kv: int) -> list[int]:
    """Global KV head read by each global Q head: KV head k serves the next heads/kv Q heads."""
    table: list[int] = []
    for k in range(kv):
        table.extend([k] * (heads // kv))
    assert len(table) == heads
    return table


def test_grid_has_both_valid_and_invalid_cases() -> None:
    assert len(GRID) == 7 * 6 * 15
    assert len(VALID) > 100 and len(INVALID) > 100


@pytest.mark.parametrize("heads,kv,tp,dcp", VALID, ids=[f"h{h}-kv{k}-tp{t}-dcp{d}" for h, k, t, d in VALID])
def test_valid_grid_layout(heads: int, kv: int, tp: int, dcp: int) -> None:
    s = shape(heads, kv)
    plan = plan_layout(s, tp, dcp)
    reads = kv_reader_table(heads, kv)
    assert plan.tp == tp and plan.dcp == dcp and plan.kv_tp_size == tp // dcp
    assert [r.rank for r in plan.ranks] == list(range(tp))

    # Q heads partition the heads exactly, in equal contiguous shares, ordered by rank.
    all_q = [q for r in plan.ranks for q in r.q_heads]
    assert all_q == list(range(heads))
    assert {len(r.q_heads) for r in plan.ranks} == {heads // tp}

    # DCP groups: consecutive blocks of dcp ranks, numbered in order; kv_tp_rank = rank // dcp.
    groups = [tuple(range(g * dcp, (g + 1) * dcp)) for g in range(tp // dcp)]
    assert list(plan.dcp_groups) == groups
    for r in plan.ranks:
        group = next(i for i, g in enumerate(groups) if r.rank in g)
        assert r.dcp_group == group and r.dcp_members == groups[group]
        assert r.dcp_rank == groups[group].index(r.rank)
        assert r.kv_tp_rank == group
        assert r.group_q_heads == tuple(q for m in groups[group] for q in plan.ranks[m].q_heads)

    for r in plan.ranks:
        # The rank's own Q heads and its whole DCP group's Q heads read KV heads the rank holds,
        # and the local indices point at the right global KV head.
        assert r.q_to_kv == tuple(reads[q] for q in r.q_heads)
        assert {reads[q] for q in r.group_q_heads} <= set(r.kv_heads)
        assert len(r.q_to_local_kv) == len(r.q_heads)
        assert [r.kv_heads[i] for i in r.q_to_local_kv] == [reads[q] for q in r.q_heads]
        assert len(r.group_q_to_local_kv) == len(r.group_q_heads)
        assert [r.kv_heads[i] for i in r.group_q_to_local_kv] == [reads[q] for q in r.group_q_heads]
        assert len(set(r.kv_heads)) == len(r.kv_heads) and all(0 <= k < kv for k in r.kv_heads)

    # Members of a DCP group hold identical KV heads.
    for g in groups:
        assert len({plan.ranks[m].kv_heads for m in g}) == 1

    # Every KV head is held somewhere; every rank holds the same number of KV heads.
    assert set().union(*(r.kv_heads for r in plan.ranks)) == set(range(kv))
    assert len({len(r.kv_heads) for r in plan.ranks}) == 1

    # Replication: brute-force count, and the same for every head: duplication x dcp.
    counts = [sum(1 for r in plan.ranks if k in r.kv_heads) for k in range(kv)]
    assert list(plan.kv_replicas) == counts
    assert all(c == plan.kv_duplication * dcp for c in counts)
    # Total KV head copies held = replicas summed over heads.
    assert sum(len(r.kv_heads) for r in plan.ranks) == sum(counts)
    # The GCD rule: each KV-parallel rank holds kv / gcd(kv, kv_tp_size) heads, so the copies over
    # the kv_tp_size ranks tile the KV heads exactly kv_duplication times.
    per_rank = len(plan.ranks[0].kv_heads)
    assert per_rank * (tp // dcp) == kv * plan.kv_duplication
    assert per_rank == kv // math.gcd(kv, tp // dcp)

    # KV bytes per stored token: K and V, every layer, the rank's KV heads.
    assert plan.kv_bytes_per_token_per_rank == 2 * s.layers * per_rank * s.head_dim * s.dtype_bytes

    # The speculator keeps the plain TP layout whatever dcp the target uses.
    spec = plan_speculator(s, tp)
    assert spec == plan_layout(s, tp, dcp=1)
    assert spec.dcp == 1 and all(r.dcp_members == (r.rank,) for r in spec.ranks)


@pytest.mark.parametrize("heads,kv,tp,dcp", INVALID, ids=[f"h{h}-kv{k}-tp{t}-dcp{d}" for h, k, t, d in INVALID])
def test_invalid_grid_raises_naming_numbers(heads: int, kv: int, tp: int, dcp: int) -> None:
    with pytest.raises(ConfigError) as info:
        plan_layout(shape(heads, kv), tp, dcp)
    msg = str(info.value)
    if heads % kv:
        assert msg == f"heads={heads} is not divisible by kv_heads={kv}"
    else:
        assert msg == f"heads={heads} is not divisible by tp={tp}"


@pytest.mark.parametrize("tp,dcp", [(4, 3), (8, 3), (6, 4), (2, 4)])
def test_dcp_not_dividing_tp_raises(tp: int, dcp: int) -> None:
    with pytest.raises(ConfigError, match=f"dcp={dcp} does not divide tp={tp}"):
        plan_layout(shape(24, 6), tp, dcp)


@pytest.mark.parametrize("field,kwargs,tp,dcp", [
    ("heads", {"heads": 0, "kv": 1}, 1, 1),
    ("kv_heads", {"heads": 8, "kv": 0}, 1, 1),
    ("head_dim", {"heads": 8, "kv": 2, "head_dim": 0}, 1, 1),
    ("layers", {"heads": 8, "kv": 2, "layers": -1}, 1, 1),
    ("tp", {"heads": 8, "kv": 2}, 0, 1),
    ("dcp", {"heads": 8, "kv": 2}, 2, 0),
])
def test_non_positive_numbers_raise(field: str, kwargs: dict, tp: int, dcp: int) -> None:
    with pytest.raises(ConfigError, match=f"^{field}=-?\\d+ must be positive$"):
        plan_layout(shape(**kwargs), tp, dcp)


def test_ffn_shards_cover_columns_even_when_uneven() -> None:
    with pytest.raises(ConfigError, match="ffn=4 is smaller than tp=8"):
        plan_layout(shape(8, 2, ffn=4), 8)
    plan = plan_layout(shape(8, 2, ffn=96), 4)
    assert [r.ffn_shard for r in plan.ranks] == [(0, 24), (24, 48), (48, 72), (72, 96)]
    # SmolLM2's ffn=1536 over tp9: contiguous shards of 170 or 171 columns covering all of them
    shards = [r.ffn_shard for r in plan_layout(shape(9, 3, ffn=1536), 9).ranks]
    assert shards[0][0] == 0 and shards[-1][1] == 1536
    assert all(a[1] == b[0] for a, b in zip(shards, shards[1:]))
    assert {hi - lo for lo, hi in shards} == {170, 171}


@pytest.mark.parametrize("vocab", [384, 383, 389, 5, 49152])
@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8, 9])
def test_vocab_shards_cover_every_token_once_with_padding_at_the_end(vocab: int, tp: int) -> None:
    """Every token id is held by exactly one rank, in rank order; each shard has ceil(vocab / tp) rows."""
    rows = -(-vocab // tp)
    owners = [None] * vocab
    for rank in range(tp):
        lo, hi = vocab_shard(vocab, rank, tp)
        for t in range(lo, hi):
            assert owners[t] is None
            owners[t] = rank
    assert owners == sorted(owners) and None not in owners
    plan = plan_layout(AttentionShape(72, 2, 8, 2, 4, ffn=64, vocab=vocab), tp)
    assert {r.vocab_rows for r in plan.ranks} == {rows} == {vocab_rows_per_rank(vocab, tp)}
    assert [r.vocab_shard for r in plan.ranks] == [vocab_shard(vocab, r, tp) for r in range(tp)]


def test_vocab_floor_offset_overlaps_shards_only_when_uneven() -> None:
    """The vocab-shard-offset fault: offsets by floor(389 / 4) = 97 while shards hold 98 rows."""
    assert [vocab_shard(389, r, 4) for r in range(4)] == [(0, 98), (98, 196), (196, 294), (294, 389)]
    assert [vocab_shard(389, r, 4, floor_offset=True) for r in range(4)] == [(0, 98), (97, 195), (194, 292),
                                                                            (291, 389)]
    assert [vocab_shard(384, r, 4, floor_offset=True) for r in range(4)] == [vocab_shard(384, r, 4) for r in range(4)]


def test_ffn_floor_split_drops_the_remainder_columns_only_when_uneven() -> None:
    s = shape(8, 2, ffn=290)
    held = {c for r in plan_layout(s, 4, ffn_floor=True).ranks for c in range(*r.ffn_shard)}
    assert held == set(range(288))  # columns 288, 289 computed by no rank
    assert plan_layout(shape(8, 2, ffn=288), 4, ffn_floor=True).ranks == plan_layout(shape(8, 2, ffn=288), 4).ranks


def test_kv6_at_tp4_gcd_duplication() -> None:
    s = shape(24, 6)
    plan = plan_layout(s, 4)
    assert [r.kv_heads for r in plan.ranks] == [(0, 1, 2), (0, 1, 2), (3, 4, 5), (3, 4, 5)]
    assert plan.kv_duplication == 2 and plan.kv_gcd == 2
    assert plan.kv_replicas == (2,) * 6
    # Rank 1 holds KV heads 0-2 but its Q heads 6-11 read only KV heads 1 and 2 (4 Q heads per KV head).
    r1 = plan.ranks[1]
    assert r1.q_heads == tuple(range(6, 12))
    assert r1.q_to_kv == (1, 1, 2, 2, 2, 2)
    assert r1.q_to_local_kv == (1, 1, 2, 2, 2, 2)
    # The naive repeat_interleave over local counts is silently wrong on every rank.
    for r in plan.ranks:
        naive = naive_local_kv_index(len(r.q_heads), len(r.kv_heads))
        assert naive != r.q_to_local_kv
        assert [r.kv_heads[i] for i in naive] != list(r.q_to_kv)
    assert naive_local_kv_index(6, 3) == (0, 0, 1, 1, 2, 2)
    # 3 KV heads x head_dim 8 x 2 layers x K,V x 4 bytes: duplication doubles the total.
    assert plan.kv_bytes_per_token_per_rank == 2 * 2 * 3 * 8 * 4
    assert plan.kv_bytes_per_token_total == 4 * plan.kv_bytes_per_token_per_rank


def test_mqa_at_tp8() -> None:
    plan = plan_layout(shape(8, 1), 8)
    assert [r.q_heads for r in plan.ranks] == [(i,) for i in range(8)]
    assert all(r.kv_heads == (0,) and r.q_to_kv == (0,) and r.q_to_local_kv == (0,) for r in plan.ranks)
    assert plan.kv_replicas == (8,) and plan.kv_duplication == 8


def test_gqa_at_tp4_dcp4() -> None:
    plan = plan_layout(shape(16, 2), 4, dcp=4)
    assert plan.kv_tp_size == 1 and plan.kv_duplication == 1
    assert plan.dcp_groups == ((0, 1, 2, 3),)
    for r in plan.ranks:
        assert r.kv_heads == (0, 1) and r.kv_tp_rank == 0 and r.dcp_group == 0 and r.dcp_rank == r.rank
        assert r.group_q_heads == tuple(range(16))
        assert r.group_q_to_local_kv == (0,) * 8 + (1,) * 8
    assert plan.ranks[2].q_heads == (8, 9, 10, 11) and plan.ranks[2].q_to_local_kv == (1, 1, 1, 1)
    assert plan.kv_replicas == (4, 4)
    # Each token lives on one rank of the group: per group, one stored copy.
    assert plan.kv_bytes_per_token_per_dcp_group == plan.kv_bytes_per_token_per_rank
    assert plan.kv_bytes_per_token_total == plan.kv_bytes_per_token_per_rank


def test_tp_only_kv_layout_breaks_dcp_group() -> None:
    """The SGLang bug: KV heads assigned by tp alone while tokens are split by dcp."""
    s = shape(8, 2)
    faulty = plan_layout(s, 4, dcp=4, kv_dcp=1)
    assert faulty.dcp_groups == ((0, 1, 2, 3),)
    held = [r.kv_heads for r in faulty.ranks]
    assert held == [(0,), (0,), (1,), (1,)]
    assert len(set(held)) > 1
    # Some of the group's Q heads then read a KV head their rank does not hold.
    reads = kv_reader_table(8, 2)
    r0 = faulty.ranks[0]
    assert not {reads[q] for q in r0.group_q_heads} <= set(r0.kv_heads)
    assert [r0.kv_heads[i] for i in r0.group_q_to_local_kv] != [reads[q] for q in r0.group_q_heads]
    # The correct layout of the same topology keeps the group identical.
    correct = plan_layout(s, 4, dcp=4)
    assert {r.kv_heads for r in correct.ranks} == {(0, 1)}


def test_speculator_under_dcp_uses_tp_layout() -> None:
    """The draft is not in the DCP group: its KV pool must not use the target's DCP head count."""
    s = shape(8, 2)
    target = plan_layout(s, 4, dcp=4)
    draft = plan_speculator(s, 4)
    assert [r.kv_heads for r in draft.ranks] == [(0,), (0,), (1,), (1,)]
    assert draft.kv_bytes_per_token_per_rank * 2 == target.kv_bytes_per_token_per_rank


@pytest.mark.parametrize("dcp", [1, 2, 3, 4, 8])
def test_token_ownership_round_robin(dcp: int) -> None:
    owners = itertools.cycle(range(dcp))
    expected = [next(owners) for _ in range(50)]
    assert [token_owner(t, dcp) for t in range(50)] == expected
    for seq_len in range(0, 50):
        counts = Counter(expected[:seq_len])
        per_rank = [local_token_count(seq_len, d, dcp) for d in range(dcp)]
        assert per_rank == [counts[d] for d in range(dcp)]
        assert sum(per_rank) == seq_len
        assert max(per_rank) - min(per_rank) <= 1


def _gqa_plan(dcp: int):
    # heads=8, kv=2, head_dim=16, 2 layers, fp32, at tp=4.
    return plan_layout(shape(8, 2, head_dim=16), 4, dcp)


def test_pool_capacity_whole_slots() -> None:
    plan = _gqa_plan(1)
    assert plan.kv_bytes_per_token_per_rank == 2 * 2 * 1 * 16 * 4  # one KV head per rank
    block_bytes = 16 * 256
    slot_bytes = 7 * block_bytes  # ceil(100 / 16) = 7 blocks per 100-token slot
    for budget in (slot_bytes, slot_bytes + 1, 3 * slot_bytes - 1, 3 * slot_bytes, 10 * slot_bytes + 999):
        cap = pool_capacity(plan, budget, max_seq_len=100, block_size=16)
        assert cap.blocks_per_slot == 7 and cap.block_bytes == block_bytes
        slots = max(n for n in range(0, 100) if n * slot_bytes <= budget)  # brute force
        assert cap.slots == slots
        assert cap.blocks == slots * 7 and cap.blocks % cap.blocks_per_slot == 0
        assert cap.pool_bytes == cap.blocks * block_bytes <= budget
        assert budget - cap.pool_bytes < slot_bytes
        assert cap.tokens_per_rank == cap.blocks * 16
        assert cap.to_dict()["slots"] == slots


@pytest.mark.parametrize("budget", [0, 1, 7 * 16 * 256 - 1])
def test_pool_capacity_shortfall_is_an_error(budget: int) -> None:
    plan = _gqa_plan(1)
    slot_bytes = 7 * 16 * 256
    with pytest.raises(ConfigError) as info:
        pool_capacity(plan, budget, max_seq_len=100, block_size=16)
    msg = str(info.value)
    assert f"short by {slot_bytes - budget} bytes" in msg
    assert f"{budget} bytes" in msg and f"{slot_bytes} bytes" in msg


def test_pool_capacity_bad_arguments() -> None:
    plan = _gqa_plan(1)
    for kwargs in ({"budget_bytes": 10 ** 9, "max_seq_len": 0},
                   {"budget_bytes": 10 ** 9, "max_seq_len": 8, "block_size": 0},
                   {"budget_bytes": -1, "max_seq_len": 8}):
        with pytest.raises(ConfigError, match="must be positive"):
            pool_capacity(plan, **kwargs)


@pytest.mark.parametrize("dcp", [1, 2, 4])
@pytest.mark.parametrize("max_seq_len", [1, 15, 16, 17, 100, 2048])
def test_pool_slot_holds_the_rank_share_of_a_sequence(dcp: int, max_seq_len: int) -> None:
    plan = _gqa_plan(dcp)
    cap = pool_capacity(plan, 10 ** 9, max_seq_len=max_seq_len, block_size=16)
    slot_tokens = cap.blocks_per_slot * cap.block_size
    # The busiest DCP rank of the group (rank 0) must fit its tokens of a max-length sequence in a slot,
    # with less than one block to spare.
    share = max(local_token_count(max_seq_len, d, dcp) for d in range(dcp))
    assert share <= slot_tokens < share + cap.block_size


def test_dcp_reduces_tokens_per_slot() -> None:
    per_slot = {dcp: pool_capacity(_gqa_plan(dcp), 10 ** 9, max_seq_len=2048).blocks_per_slot for dcp in (1, 2, 4)}
    assert per_slot == {1: 128, 2: 64, 4: 32}
    # dcp=2 at tp=4 keeps one KV head per rank (kv_tp_size=2), so the same budget holds twice the slots.
    budget = 10 * 128 * 16 * 256
    assert pool_capacity(_gqa_plan(2), budget, 2048).slots == 2 * pool_capacity(_gqa_plan(1), budget, 2048).slots
