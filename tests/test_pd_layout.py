"""Disaggregated topologies (PREFILL>DECODE): the grammar, the transfer plan against brute force over both
sides' layout plans, the buggy source mapping of the pd-gqa-replication fault, the hybrid state sources, and
`harness plan`'s pd section."""

from __future__ import annotations

import itertools
import json

import pytest

from harness.cli import main
from harness.core.errors import ConfigError
from harness.partition.hybrid_layout import HybridShape, plan_hybrid
from harness.partition.layout import AttentionShape, Placement, local_positions, plan_layout, token_owner
from harness.partition.pd_layout import naive_head_sources, plan_pd, plan_pd_state
from harness.specs.topology import PD_GRAMMAR, Topology, load_catalog, parse_topology_name


def test_pd_names_parse_to_a_decode_layout_with_its_prefill_layout() -> None:
    topo = parse_topology_name("tp4>tp2dcp2")
    assert (topo.tp, topo.dcp, topo.world_size, topo.name) == (2, 2, 2, "tp4>tp2dcp2")
    assert topo.prefill == Topology(tp=4)
    assert topo.disaggregated and topo.canonical_name == "tp4>tp2dcp2"
    assert topo.decode_layout() == Topology(tp=2, dcp=2)
    assert Topology.from_dict(topo.to_dict()) == topo
    assert "prefill" not in Topology(tp=4).to_dict()  # other topologies keep their dict (and cache keys)
    assert parse_topology_name("tp2dcp2i16>tp1").prefill == Topology(tp=2, dcp=2, interleave=16)
    assert [t.name for t in load_catalog().resolve("tp4>tp2dcp2,tp2")] == ["tp4>tp2dcp2", "tp2"]


@pytest.mark.parametrize(("name", "fragment"), [
    ("tp4>", "bad disaggregated topology 'tp4>'"),
    (">tp2", "bad disaggregated topology '>tp2'"),
    ("tp4>tp2>tp1", "bad disaggregated topology 'tp4>tp2>tp1'"),
    ("tp4>tp2x", "the decode layout 'tp2x' is not"),
    ("tpx>tp2", "the prefill layout 'tpx' is not"),
    ("tp4>tp2-mtp", "the decode layout has speculator 'mtp'"),
    ("tp4dcp2c>tp2", "the prefill layout's DCP placement is contiguous"),
    ("tp4>tp2dcp3", "dcp=3 does not divide tp=2"),
])
def test_bad_pd_names_name_the_value_and_the_form(name: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_catalog().resolve(name)
    assert fragment in str(err.value)
    if "dcp=3" not in fragment:
        assert PD_GRAMMAR in str(err.value)


SHAPES = [AttentionShape(heads=8, kv_heads=2, head_dim=4, layers=2, dtype_bytes=4),
          AttentionShape(heads=24, kv_heads=6, head_dim=4, layers=1, dtype_bytes=2),
          AttentionShape(heads=8, kv_heads=8, head_dim=4, layers=1, dtype_bytes=4),
          AttentionShape(heads=8, kv_heads=1, head_dim=4, layers=2, dtype_bytes=4, kv_lora_rank=8, qk_rope_dim=4)]
LAYOUTS = [(1, 1, 1), (2, 1, 1), (4, 1, 1), (4, 2, 1), (4, 2, 3), (8, 2, 1), (8, 4, 1)]  # (tp, dcp, interleave)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s.heads}kv{s.kv_heads}{'mla' if s.mla else ''}")
def test_every_decode_row_comes_from_a_prefill_rank_that_holds_it(shape: AttentionShape) -> None:
    """Brute force over both plans: each decode rank's (head, position) is read from a prefill rank holding that
    head at the named slice and storing that position at the named row; every position of every DCP group is
    held by exactly one decode rank of it; the bytes are the rows times the bytes per stored token."""
    tokens = 37
    for (ptp, pdcp, pk), (dtp, ddcp, dk) in itertools.product(LAYOUTS, LAYOUTS):
        if shape.heads % ptp or shape.heads % dtp:
            continue
        pre = plan_layout(shape, ptp, pdcp, placement=Placement("interleave", pk))
        dec = plan_layout(shape, dtp, ddcp, placement=Placement("interleave", dk))
        pd = plan_pd(pre, dec)
        for rank in pd.ranks:
            owned = pd.owned_positions(rank.rank, tokens)
            assert owned == [t for t in range(tokens) if token_owner(t, ddcp, dec.placement) == rank.dcp_rank]
            assert rank.kv_heads == dec.ranks[rank.rank].kv_heads
            for head in rank.heads:
                assert dec.ranks[rank.rank].kv_heads[head.dest_slot] == head.kv_head
                for t, (src, row) in zip(owned, pd.source_rows(head, owned, tokens)):
                    source = pre.ranks[src]
                    assert source.kv_heads[head.src_slots[source.dcp_rank]] == head.kv_head
                    assert token_owner(t, pdcp, pre.placement) == source.dcp_rank
                    assert local_positions(tokens, source.dcp_rank, pdcp, pre.placement)[row] == t
        for group in dec.dcp_groups:
            held = sorted(t for r in group for t in pd.owned_positions(r, tokens))
            assert held == list(range(tokens))
        assert sum(pd.bytes_per_rank(tokens)) == tokens * dec.kv_bytes_per_token_per_rank * (dtp // ddcp)


def test_the_gqa_replication_fault_mapping_differs_only_where_prefill_duplicates_kv_heads() -> None:
    shape = SHAPES[0]  # kv_heads=2
    for ptp, changed in ((1, False), (2, False), (4, True), (8, True)):
        pd = plan_pd(plan_layout(shape, ptp), plan_layout(shape, 2))
        assert any(naive_head_sources(pd, r.rank) != r.heads for r in pd.ranks) == changed, ptp
    # where it differs, some head is read from a prefill rank that does not hold it
    pd = plan_pd(plan_layout(shape, 4), plan_layout(shape, 2))
    wrong = [(h.kv_head, h.sources[0]) for r in pd.ranks for h in naive_head_sources(pd, r.rank)
             if h.kv_head not in pd.prefill.ranks[h.sources[0]].kv_heads]
    assert wrong == [(1, 1)]


def test_hybrid_state_comes_from_a_prefill_rank_holding_each_v_head() -> None:
    shape = AttentionShape(heads=8, kv_heads=2, head_dim=4, layers=8, dtype_bytes=4)
    hyb = HybridShape(linear_k_heads=2, linear_v_heads=6, linear_k_dim=4, linear_v_dim=4)
    pre, dec = plan_hybrid(shape, hyb, 4).linear, plan_hybrid(shape, hyb, 2, 2).linear
    for state in plan_pd_state(pre, dec):
        assert state.v_heads == dec.ranks[state.rank].v_heads
        assert all(v in pre.ranks[src].v_heads for v, src in zip(state.v_heads, state.sources))
        assert state.state_bytes == dec.state_bytes_per_seq_per_rank


def test_harness_plan_shows_the_assembly_and_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "tiny-gqa", "--topo", "tp4>tp2dcp2", "--tokens", "40"]) == 0
    out = capsys.readouterr().out
    assert "disaggregated: prefill tp=4 dcp=1" in out and "h1<-p2[slot 0]" in out
    assert "bytes moved per request: 20480" in out  # 40 tokens x 512 B/token, once per DCP group
    assert main(["plan", "--model", "tiny-hybrid", "--topo", "tp4>tp2", "--format", "json"]) == 0

    doc = json.loads(capsys.readouterr().out)["pd"]
    assert doc["state"] and doc["bytes_per_request"] == doc["kv_bytes_per_request"] + doc["state_bytes_per_request"]
    assert main(["plan", "--model", "tiny-gqa", "--topo", "tp4>tp2c"]) == 2
    assert "tp2c" in capsys.readouterr().err
