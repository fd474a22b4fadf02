"""DCP token placements and the MLA plan against naive enumeration; the topology grammar's DCP suffixes."""

from __future__ import annotations

import pytest

from harness.core.errors import ConfigError
from harness.partition.layout import (
    LAYOUT_SCHEMA_VERSION,
    ROUND_ROBIN,
    AttentionShape,
    Placement,
    local_positions,
    local_token_count,
    max_local_tokens,
    plan_layout,
    pool_capacity,
    token_owner,
)
from harness.partition.mla_layout import MLAShape, plan_mla
from harness.specs.topology import Topology, parse_topology_name

PLACEMENTS = [ROUND_ROBIN, Placement("interleave", 2), Placement("interleave", 3), Placement("interleave", 16),
              Placement("contiguous")]


def naive_owner(t: int, dcp: int, placement: Placement, prompt_len: int) -> int:
    """Deal the tokens by hand: chunks of K in turn, or the prompt cut into dcp equal blocks (the last
    shorter) and every later token to the last rank."""
    if placement.kind == "interleave":
        chunk, rank = 0, 0
        for s in range(t + 1):
            if s and s % placement.size == 0:
                chunk += 1
                rank = chunk % dcp
        return rank
    blocks: list[list[int]] = [[] for _ in range(dcp)]
    size = -(-prompt_len // dcp)
    for s in range(prompt_len):
        blocks[s // size].append(s)
    for rank, members in enumerate(blocks):
        if t in members:
            return rank
    return dcp - 1


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: p.label)
@pytest.mark.parametrize("dcp", [1, 2, 3, 4, 8])
def test_owner_and_counts_match_naive_dealing(placement: Placement, dcp: int) -> None:
    for prompt_len in (1, 2, 3, 5, 8, 17):
        for seq_len in range(0, 40, 3):
            owners = [naive_owner(t, dcp, placement, prompt_len) for t in range(seq_len)]
            assert [token_owner(t, dcp, placement, prompt_len) for t in range(seq_len)] == owners
            for r in range(dcp):
                mine = [t for t, o in enumerate(owners) if o == r]
                assert local_positions(seq_len, r, dcp, placement, prompt_len) == mine
                assert local_token_count(seq_len, r, dcp, placement, prompt_len) == len(mine)


def test_owner_works_on_tensors_as_the_engine_calls_it() -> None:
    import torch

    pos = torch.arange(12)[None, :].repeat(2, 1)  # [B, S]
    lens = torch.tensor([[5], [12]])  # [B, 1]
    got = token_owner(pos, 4, Placement("contiguous"), lens)
    assert got.tolist() == [[token_owner(t, 4, Placement("contiguous"), n) for t in range(12)] for n in (5, 12)]
    assert token_owner(pos, 4, Placement("interleave", 3)).tolist()[0] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: p.label)
def test_pool_slot_holds_the_largest_share(placement: Placement) -> None:
    shape = AttentionShape(heads=8, kv_heads=2, head_dim=16, layers=2, dtype_bytes=4)
    for dcp in (1, 2, 4):
        plan = plan_layout(shape, 4, dcp, placement=placement)
        worst = max(local_token_count(100, r, dcp, placement, p) for r in range(dcp) for p in range(1, 101))
        assert max_local_tokens(100, dcp, placement) >= worst
        if placement.kind == "interleave":
            assert max_local_tokens(100, dcp, placement) == worst
        cap = pool_capacity(plan, 1 << 20, 100, 16)
        assert cap.blocks_per_slot == -(-max_local_tokens(100, dcp, placement) // 16)


def test_placement_errors_name_the_value() -> None:
    with pytest.raises(ConfigError, match="DCP placement 'zigzag' is not one of interleave, contiguous"):
        Placement("zigzag")
    with pytest.raises(ConfigError, match="interleave size 0 must be a positive integer"):
        Placement("interleave", 0)


MLA = AttentionShape(heads=8, kv_heads=1, head_dim=16, layers=2, dtype_bytes=2, kv_lora_rank=32, qk_rope_dim=8)
EXTRA = MLAShape(q_lora_rank=48, qk_nope_dim=16, hidden=128)


@pytest.mark.parametrize(("tp", "dcp"), [(1, 1), (2, 1), (4, 1), (8, 1), (4, 2), (4, 4), (8, 2), (8, 8)])
@pytest.mark.parametrize("q_replicated", [False, True])
def test_mla_plan_by_enumeration(tp: int, dcp: int, q_replicated: bool) -> None:
    if q_replicated and dcp == 1:
        with pytest.raises(ConfigError, match="needs dcp > 1, got dcp=1"):
            plan_mla(MLA, EXTRA, tp, dcp, q_replicated=True)
        return
    plan = plan_mla(MLA, EXTRA, tp, dcp, q_replicated=q_replicated)
    per = 8 // tp
    latent = 2 * (32 + 8) * 2  # layers x (kv_lora + rope) x bytes: one row per token, not K and V
    assert plan.latent_dim == 40 and plan.base.kv_bytes_per_token_per_rank == latent
    # every rank of a TP group holds the whole latent cache; a DCP group stores each token once
    assert plan.latent_duplication == tp // dcp
    assert plan.base.kv_bytes_per_token_total == latent * (tp // dcp)
    for r, rank in enumerate(plan.ranks):
        assert rank.q_heads == tuple(range(r * per, (r + 1) * per))
        group = [m for m in range(tp) if m // dcp == r // dcp]
        want = tuple(h for m in group for h in range(m * per, (m + 1) * per)) if q_replicated else rank.q_heads
        assert rank.q_weight_heads == want
        per_head = (16 + 8) * 48 + 16 * 32  # q_b rows x q_lora, w_kc
        assert rank.q_weight_bytes == 2 * len(want) * per_head * 2
        assert rank.latent_bytes_per_token == latent


def test_q_replicated_needs_an_mla_model() -> None:
    gqa = AttentionShape(heads=8, kv_heads=2, head_dim=16, layers=2, dtype_bytes=4)
    with pytest.raises(ConfigError, match="Q-replicated DCP .* needs an MLA model"):
        plan_layout(gqa, 4, 4, q_replicated=True)
    with pytest.raises(ConfigError, match="kv_heads=2 must be 1"):
        plan_layout(AttentionShape(heads=8, kv_heads=2, head_dim=16, layers=2, dtype_bytes=4, kv_lora_rank=8,
                                   qk_rope_dim=4), 2)


@pytest.mark.parametrize(("name", "placement", "q"), [
    ("tp4dcp4i16", Placement("interleave", 16), False), ("tp4dcp4c", Placement("contiguous"), False),
    ("tp4dcp4q", ROUND_ROBIN, True), ("tp8dcp2i64q-mtp", Placement("interleave", 64), True),
    ("tp4dcp2cq-draft", Placement("contiguous"), True), ("tp4dcp4", ROUND_ROBIN, False),
])
def test_topology_suffixes_round_trip(name: str, placement: Placement, q: bool) -> None:
    topo = parse_topology_name(name)
    assert (topo.placement, topo.q_replicated, topo.canonical_name) == (placement, q, name)
    assert Topology.from_dict(topo.to_dict()) == topo
    assert topo.without_speculator().placement == placement
    assert parse_topology_name("tp4dcp4i1").canonical_name == "tp4dcp4"  # i1 is round-robin


@pytest.mark.parametrize(("name", "message"), [
    ("tp4i16", "bad topology name"), ("tp4dcp4i16c", "bad topology name"), ("tp4dcp4qc", "bad topology name"),
    ("tp4dcp4i0", "interleave=0 must be >= 1"), ("tp4dcp1c", "need dcp > 1"),
])
def test_bad_suffixes_are_one_clear_error(name: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_topology_name(name)


def test_plan_shows_each_ranks_heads_latent_bytes_and_q_weights(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from harness.cli import main

    assert main(["plan", "--model", "tiny-mla", "--topo", "tp4dcp4q"]) == 0
    out = capsys.readouterr().out
    assert "Q mode replicated (group queries computed locally)" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"], ["3"])]
    # the MLA table: rank, own Q heads, Q-weight heads (the whole DCP group), latent bytes per stored token
    assert [r[:4] for r in rows[4:]] == [["0", "0-1", "0-7", "320"], ["1", "2-3", "0-7", "320"],
                                         ["2", "4-5", "0-7", "320"], ["3", "6-7", "0-7", "320"]]
    assert "duplication x1 over 4 ranks" in out
    assert main(["plan", "--model", "tiny-mla", "--topo", "tp4dcp2c", "--tokens", "10", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema_version"] == LAYOUT_SCHEMA_VERSION and doc["placement"]["kind"] == "contiguous"
    assert doc["token_owners"]["owners"] == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1]
    assert doc["mla"]["latent_duplication"] == 2 and doc["mla"]["ranks"][1]["q_weight_heads"] == [2, 3]
    assert main(["plan", "--model", "tiny-gqa", "--topo", "tp4dcp4q"]) == 2  # one clear error
    assert "needs an MLA model" in capsys.readouterr().err
