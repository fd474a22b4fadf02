"""The hybrid planner (harness/partition/hybrid_layout.py) against brute-force enumeration: linear-attention heads,
conv rows and state bytes, gated-attention Q rows, expert placement under EP, grouped cache capacity."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from harness.core.errors import ConfigError
from harness.partition.cache_groups import CacheGroup, grouped_capacity
from harness.partition.hybrid_layout import (
    FULL,
    LINEAR,
    HybridShape,
    hybrid_cache_groups,
    layer_kinds,
    plan_hybrid,
    plan_hybrid_speculator,
    plan_linear,
    plan_moe,
    q_proj_rows,
)
from harness.partition.layout import AttentionShape

V_K = [(v, k) for v in (1, 2, 3, 4, 6, 8, 12) for k in (1, 2, 3, 4, 6) if k <= v and v % k == 0]
TP_DCP = [(tp, dcp) for tp in (1, 2, 3, 4, 6, 8) for dcp in range(1, tp + 1) if tp % dcp == 0]
LINEAR_GRID = [(v, k, tp, dcp) for (v, k), (tp, dcp) in itertools.product(V_K, TP_DCP)]


def hshape(v: int = 6, k: int = 2, kd: int = 4, vd: int = 3, **kw: int) -> HybridShape:
    return HybridShape(linear_k_heads=k, linear_v_heads=v, linear_k_dim=kd, linear_v_dim=vd, **kw)  # type: ignore[arg-type]


def packed_rows(v: int, k: int, kd: int, vd: int) -> list[tuple[str, int, int]]:
    """Every row of the packed q|k|v block as (component, head, dim), in order."""
    return ([("q", h, d) for h in range(k) for d in range(kd)] + [("k", h, d) for h in range(k) for d in range(kd)]
            + [("v", h, d) for h in range(v) for d in range(vd)])


@pytest.mark.parametrize("v,k,tp,dcp", LINEAR_GRID, ids=[f"v{v}-k{k}-tp{t}-dcp{d}" for v, k, t, d in LINEAR_GRID])
def test_linear_attention_layout(v: int, k: int, tp: int, dcp: int) -> None:
    h = hshape(v, k)
    plan = plan_linear(h, layers=3, tp=tp, dcp=dcp)
    kv_tp = tp // dcp
    rows = packed_rows(v, k, 4, 3)
    held_by: dict[int, list[int]] = {head: [] for head in range(v)}
    for r in plan.ranks:
        assert r.kv_tp_rank == r.rank // dcp
        for head in r.v_heads:
            held_by[head].append(r.rank)
        # V heads: contiguous, and the same number on every rank
        assert list(r.v_heads) == list(range(r.v_heads[0], r.v_heads[-1] + 1))
        assert len(r.v_heads) == len(plan.ranks[0].v_heads)
        # K heads: exactly the ones the V heads read, by global ids
        readers = sorted({head // (v // k) for head in r.v_heads})
        assert list(r.k_heads) == readers
        assert [r.k_heads[i] for i in r.v_to_local_k] == [head // (v // k) for head in r.v_heads]
        # conv / in_proj rows per component: the q and k rows of its K heads and the v rows of its V heads
        got = [rows[i] for lo, hi in r.conv_rows for i in range(lo, hi)]
        want = ([("q", hh, d) for hh in readers for d in range(4)] + [("k", hh, d) for hh in readers for d in range(4)]
                + [("v", hh, d) for hh in r.v_heads for d in range(3)])
        assert got == want
        assert r.conv_state_bytes == len(want) * (h.conv_kernel - 1) * 4
        assert r.recurrent_state_bytes == len(r.v_heads) * 4 * 3 * 4
    # every V head is held; the ranks of one DCP group hold the same heads (whole state, never split)
    assert all(held_by.values())
    for r in plan.ranks:
        assert all(plan.ranks[m].v_heads == r.v_heads for m in r.dcp_members)
    # GCD duplication: each V head is held by the same number of KV-parallel ranks, kv_tp / gcd(v, kv_tp)
    g = math.gcd(v, kv_tp)
    assert plan.v_gcd == g
    assert plan.v_replicas == tuple(len(held_by[head]) for head in range(v))
    assert set(plan.v_replicas) == {(kv_tp // g) * dcp}
    # each V head's output projection is added by exactly one rank, the lowest holding it
    adders = sorted(head for r in plan.ranks for head in r.out_v_heads)
    assert adders == list(range(v))
    for r in plan.ranks:
        assert all(held_by[head][0] == r.rank for head in r.out_v_heads)
    r0 = plan.ranks[0]
    assert plan.state_bytes_per_seq_per_rank == 3 * (r0.conv_state_bytes + r0.recurrent_state_bytes)


def test_linear_attention_rejects_bad_shapes() -> None:
    with pytest.raises(ConfigError, match="linear_v_heads=6 is not divisible by linear_k_heads=4"):
        hshape(6, 4)
    with pytest.raises(ConfigError, match="dcp=3 does not divide tp=4"):
        plan_linear(hshape(), layers=1, tp=4, dcp=3)
    with pytest.raises(ConfigError, match="conv_kernel must be a positive integer, got 0"):
        hshape(conv_kernel=0)


def test_layer_kinds_follow_the_interval() -> None:
    assert layer_kinds(8, 4) == (LINEAR, LINEAR, LINEAR, FULL) * 2
    assert layer_kinds(3, 1) == (FULL,) * 3
    assert layer_kinds(5, 2) == (LINEAR, FULL, LINEAR, FULL, LINEAR)


@pytest.mark.parametrize("gate", [True, False])
def test_gated_q_projection_rows_split_with_q(gate: bool) -> None:
    """With an output gate each head owns 2 x head_dim consecutive rows (q then gate); the rows of the
    ranks partition the projection exactly."""
    heads, hd, tp = 8, 4, 4
    per = hd * (2 if gate else 1)
    all_rows = []
    for rank in range(tp):
        q_heads = tuple(range(rank * 2, rank * 2 + 2))
        got = q_proj_rows(hd, q_heads, gate)
        all_rows += [i for lo, hi in got for i in range(lo, hi)]
        assert [i // per for lo, hi in got for i in range(lo, hi)] == [q for q in q_heads for _ in range(per)]
    assert all_rows == list(range(heads * per))


MOE_GRID = [(e, tp, ep) for e in (2, 4, 6, 8, 16) for tp in (1, 2, 4, 6, 8) for ep in range(1, tp + 1)
            if tp % ep == 0 and e % ep == 0]


@pytest.mark.parametrize("experts,tp,ep", MOE_GRID, ids=[f"e{e}-tp{t}-ep{p}" for e, t, p in MOE_GRID])
def test_expert_placement(experts: int, tp: int, ep: int) -> None:
    h = hshape(experts=experts, top_k=2, moe_ffn=48, shared_ffn=24)
    plan = plan_moe(h, tp, ep)
    etp = tp // ep
    assert plan.etp == etp
    # every (expert, column) pair is held by exactly one rank; every shared column by exactly one rank
    cells = [(e, c) for r in plan.ranks for e in r.experts for c in range(*r.expert_ffn_shard)]
    assert sorted(cells) == [(e, c) for e in range(experts) for c in range(48)]
    shared = sorted(c for r in plan.ranks for c in range(*r.shared_ffn_shard))
    assert shared == list(range(24))
    assert plan.expert_replicas == (etp,) * experts
    for r in plan.ranks:
        assert (r.ep_rank, r.etp_rank) == (r.rank // etp, r.rank % etp)
        # the EP group: the ranks with this etp rank; their experts partition all experts, in order
        assert r.ep_members == tuple(m for m in range(tp) if m % etp == r.etp_rank)
        assert [e for m in r.ep_members for e in plan.ranks[m].experts] == list(range(experts))
        # the expert-TP group: the ranks holding the same experts
        assert r.etp_members == tuple(m for m in range(tp) if plan.ranks[m].experts == r.experts)


@pytest.mark.parametrize("kw,tp,ep,message", [
    ({"experts": 6, "top_k": 2, "moe_ffn": 8}, 4, 4, "experts=6 is not divisible by ep=4"),
    ({"experts": 8, "top_k": 2, "moe_ffn": 8}, 4, 3, "ep=3 does not divide the world tp=4"),
    ({"experts": 8, "top_k": 2, "moe_ffn": 2}, 8, 2, "moe_ffn=2 is smaller than etp=4"),
    ({}, 4, 2, "ep=2: the model has no experts"),
])
def test_moe_rejects_bad_configurations(kw: dict, tp: int, ep: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan_moe(hshape(**kw), tp, ep)


def test_moe_shape_validates_itself() -> None:
    with pytest.raises(ConfigError, match="experts=4 needs 1 <= top_k <= experts"):
        hshape(experts=4, top_k=5, moe_ffn=8)
    with pytest.raises(ConfigError, match="need experts > 0"):
        hshape(shared_ffn=8)


def test_grouped_capacity_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(300):
        groups = tuple(CacheGroup(f"g{i}", rng.randint(1, 9), rng.randint(1, 4096)) for i in range(rng.randint(1, 4)))
        budget = rng.randint(0, 200_000)
        slot = sum(g.blocks_per_seq * g.block_bytes for g in groups)
        slots = 0
        while (slots + 1) * slot <= budget:
            slots += 1
        if slots == 0:
            with pytest.raises(ConfigError) as info:
                grouped_capacity(groups, budget)
            text = str(info.value)
            assert f"short by {slot - budget} bytes" in text
            assert all(f"{g.name}: {g.blocks_per_seq} blocks x {g.block_bytes} bytes" in text for g in groups)
            continue
        cap = grouped_capacity(groups, budget)
        assert cap.slots == slots
        for g in groups:  # every group holds the same number of whole sequences
            assert cap.blocks(g.name) == slots * g.blocks_per_seq
            assert cap.blocks(g.name) // g.blocks_per_seq == cap.slots and cap.blocks(g.name) % g.blocks_per_seq == 0
        assert cap.pool_bytes == sum(cap.blocks(g.name) * g.block_bytes for g in groups) <= budget


def test_exhausted_budget_is_one_error_naming_each_group() -> None:
    groups = (CacheGroup("attention", 4, 1000), CacheGroup("recurrent", 1, 3000), CacheGroup("mtp", 8, 125))
    with pytest.raises(ConfigError) as info:
        grouped_capacity(groups, 4000)
    assert str(info.value) == (
        "cache budget of 4000 bytes per rank cannot hold one sequence slot of 8000 bytes across 3 cache groups "
        "(short by 4000 bytes: attention: 4 blocks x 1000 bytes = 4000 bytes, short by 2000 bytes; "
        "recurrent: 1 blocks x 3000 bytes = 3000 bytes, short by 1500 bytes; "
        "mtp: 8 blocks x 125 bytes = 1000 bytes, short by 500 bytes)")


@pytest.mark.parametrize("tp,dcp,seq,block", [(1, 1, 100, 16), (4, 2, 100, 16), (4, 4, 33, 8), (8, 2, 64, 16)])
def test_hybrid_cache_groups(tp: int, dcp: int, seq: int, block: int) -> None:
    shape = AttentionShape(heads=8, kv_heads=2, head_dim=4, layers=8, dtype_bytes=2, ffn=64, vocab=32)
    h = hshape(v=4, k=2)
    plan = plan_hybrid(shape, h, tp, dcp)
    spec = plan_hybrid_speculator(shape, 1, tp)
    groups = {g.name: g for g in hybrid_cache_groups(plan.attention, plan.linear, spec, seq, block)}
    # attention: the rank that stores the most tokens (DCP rank 0) in whole pages; the 2 full layers only
    tokens = max(len([t for t in range(seq) if t % dcp == r]) for r in range(dcp))
    n_kv = len(plan.attention.ranks[0].kv_heads)
    assert groups["attention"].blocks_per_seq == math.ceil(tokens / block)
    assert groups["attention"].block_bytes == block * 2 * 2 * n_kv * 4 * 2
    # recurrent: one block per sequence, all 6 linear layers' conv + recurrent state
    r0 = plan.linear.ranks[0]
    assert groups["recurrent"].blocks_per_seq == 1
    assert groups["recurrent"].block_bytes == 6 * (r0.conv_state_bytes + r0.recurrent_state_bytes)
    # the MTP head: every token (plain TP layout), one layer
    assert groups["mtp"].blocks_per_seq == math.ceil(seq / block)
    assert groups["mtp"].block_bytes == block * 2 * 1 * len(spec.ranks[0].kv_heads) * 4 * 2


def test_plan_hybrid_rejects_models_without_full_attention_and_ep_without_experts() -> None:
    shape = AttentionShape(heads=8, kv_heads=2, head_dim=4, layers=3, dtype_bytes=2)
    with pytest.raises(ConfigError, match="layers=3 with full_attention_interval=4 has no full-attention layer"):
        plan_hybrid(shape, hshape(), 2)
    with pytest.raises(ConfigError, match="ep=2 needs a MoE model"):
        plan_hybrid(AttentionShape(heads=8, kv_heads=2, head_dim=4, layers=4, dtype_bytes=2), hshape(), 2, ep=2)
