"""Sparse attention (harness/partition/sparse_layout.py, harness/engine/layers/sparse.py,
harness/compare/layout/sparse.py):
the indexer's split and row planners against brute force, cache groups sized as one slot count with named
errors, the selection check's positive and negative controls, and the dsa faults end to end (each a silent
corruption FAIL of a real multi-process run, the clean cells passing)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from harness.cli import main
from harness.cli.plan.command import plan_document, render_table
from harness.compare.layout.sparse import near_tie_bound, selection_problems
from harness.core.errors import ConfigError
from harness.engine.fault_scope import inert_reason
from harness.engine.faults import FAULTS, fault_flags
from harness.engine.layers.sparse import top_tokens
from harness.formats.locate import load_model
from harness.partition.cache_groups import (
    CacheBudgetExhausted,
    CacheGroup,
    CacheGroupUnaligned,
    NoCacheGroups,
    check_aligned,
    grouped_capacity,
    unaligned_groups,
)
from harness.partition.layout import max_local_tokens, plan_layout
from harness.partition.sparse_layout import (
    INDEX_GROUP,
    KV_GROUP,
    SparseShape,
    indexer_query_rows,
    plan_sparse,
    row_source,
    sparse_cache_groups,
)
from harness.records.rankreport import SparseReport
from harness.specs.topology import parse_topology_name
from tests.test_engine_parity import ATOL, _max_err

SHAPE = SparseShape(index_heads=8, index_head_dim=16, index_topk=4, index_sinks=1)


@pytest.mark.parametrize(("tp", "dcp"), [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4), (8, 2), (8, 4)])
def test_indexer_heads_split_over_tp_and_gather_in_each_dcp_group(tp: int, dcp: int) -> None:
    attention = plan_layout(load_model("tiny-dsa").attention_shape, tp, dcp)
    plan = plan_sparse(SHAPE, attention)
    held = [h for r in plan.ranks for h in r.index_heads]
    assert sorted(held) == list(range(SHAPE.index_heads))  # every head on exactly one rank
    for r in plan.ranks:
        members = [m for m in range(tp) if m // dcp == r.rank // dcp]  # its DCP group: consecutive ranks
        assert r.group_index_heads == tuple(h for m in members for h in plan.ranks[m].index_heads)
        assert r.dcp_rank == r.rank % dcp
    assert plan.key_bytes_per_token == attention.shape.layers * SHAPE.index_head_dim * attention.shape.dtype_bytes


def test_indexer_heads_that_tp_does_not_divide_are_refused() -> None:
    attention = plan_layout(load_model("tiny-dsa").attention_shape, 4, 1)
    with pytest.raises(ConfigError, match="index_heads=6 is not divisible by tp=4"):
        plan_sparse(replace(SHAPE, index_heads=6), attention)
    with pytest.raises(ConfigError, match=r"index_sinks must be an integer in \[0, index_topk=4\)"):
        SparseShape(index_heads=4, index_head_dim=16, index_topk=4, index_sinks=4)


def test_query_row_shards_cover_every_row_once_and_the_planners_agree_only_with_one_rule() -> None:
    disagree = 0
    for n in range(1, 24):
        for dcp in (1, 2, 3, 4):
            shards = [list(indexer_query_rows(n, dcp, m)) for m in range(dcp)]
            assert sorted(r for s in shards for r in s) == list(range(n))
            for s in range(n):  # the attention's planner reads row s where the indexer's wrote it
                member, index = row_source(s, n, dcp)
                assert shards[member][index] == s
                disagree += row_source(s, n, dcp, "round-robin") != (member, index)
    assert disagree > 0  # the dsa-planner-rows fault's rule is another mapping
    with pytest.raises(ConfigError, match="row rule 'diagonal' is not one of contiguous, round-robin"):
        row_source(0, 4, 2, "diagonal")


@pytest.mark.parametrize("topo", ["tp2", "tp4dcp4", "tp4dcp2i4", "tp4dcp2c"])
def test_cache_groups_take_one_slot_count_of_the_dcp_share(topo: str) -> None:
    t = parse_topology_name(topo)
    attention = plan_layout(load_model("tiny-dsa").attention_shape, t.tp, t.dcp, placement=t.placement)
    groups = sparse_cache_groups(attention, plan_sparse(SHAPE, attention), 512, 16)
    assert [g.name for g in groups] == [KV_GROUP, INDEX_GROUP]
    rows = max_local_tokens(512, t.dcp, t.placement)
    assert all(g.blocks_per_seq == -(-rows // 16) for g in groups)  # slot-aligned: one row per stored token
    cap = grouped_capacity(groups, 10 ** 7)
    assert cap.slots == 10 ** 7 // sum(g.slot_bytes for g in groups)
    assert unaligned_groups(cap, {g.name: cap.blocks(g.name) for g in groups}) == []


def test_grouped_capacity_errors_are_named_and_never_clamp() -> None:
    groups = (CacheGroup("ori", 4, 1000), CacheGroup("idx", 4, 250))
    with pytest.raises(NoCacheGroups, match="needs at least one cache group, got none"):
        grouped_capacity((), 10 ** 6)
    assert issubclass(NoCacheGroups, ConfigError) and not issubclass(NoCacheGroups, ValueError)
    with pytest.raises(CacheBudgetExhausted) as exc:
        grouped_capacity(groups, 4999, where="on device cpu:0")
    text = str(exc.value)
    assert "cache budget of 4999 bytes on device cpu:0 cannot hold one sequence slot of 5000 bytes" in text
    assert "ori: 4 blocks x 1000 bytes = 4000 bytes" in text and "idx: 4 blocks x 250 bytes = 1000 bytes" in text
    cap = grouped_capacity(groups, 12000)
    assert cap.slots == 2
    problems = unaligned_groups(cap, {"ori": 8, "idx": 9})
    assert problems == ["cache group idx: 9 blocks (not a whole number of slots), planned 2 slots x 4 blocks per "
                        "slot = 8 blocks (1000 bytes per slot, budget 12000 bytes)"]
    assert "idx: 16 blocks = 4 slots, not the groups' one count" in unaligned_groups(cap, {"ori": 8, "idx": 16})[0]
    with pytest.raises(CacheGroupUnaligned, match="cache groups on rank 3: cache group idx: 9 blocks"):
        check_aligned(cap, {"ori": 8, "idx": 9}, where="on rank 3")


def test_top_tokens_keep_sinks_break_ties_by_position_and_pad() -> None:
    inf = float("inf")
    scores = torch.tensor([[[inf, 0.0, 0.0, 3.0, -inf], [2.0, -inf, -inf, -inf, -inf]]], dtype=torch.float64)
    sel = top_tokens(scores, 3)
    assert sel.positions.tolist() == [[[0, 3, 1], [0, -1, -1]]]  # the tie of 0.0s goes to the lower position
    assert sel.margins.tolist() == [[1.0, 1.0]]  # an exact tie is no near tie; no competitor left is none


def _report(selected: tuple[tuple[tuple[int, ...], ...], ...], margins: float = 0.5) -> SparseReport:
    return SparseReport(index_heads=(0,), index_weight_checksums={}, index_key_checksum="k", cache_group_blocks={},
                        block_size=16, selected=selected, margins=tuple(tuple(margins for _ in q) for q in selected))


def test_selection_mismatch_names_query_layer_and_rank_and_near_ties_pass() -> None:
    ref = _report((((0,), (0, 1)), ((0,), (0, 1))))
    same = {0: ref, 1: ref}
    assert selection_problems(ref, same, 1e-6) == ([], None)
    bad = _report((((0,), (0, 1)), ((0,), (1,))))
    problems, first = selection_problems(ref, {0: ref, 1: bad}, 1e-6)
    assert problems[0] == ("divergence starts at the indexer's top-k selection: query 1 layer 1 rank 1: selected "
                           "tokens differ from the reference's (reads none it does not, misses [0])")
    assert first is not None and (first["layer"], first["query"], first["rank"]) == (1, 1, 1)
    near = replace(ref, margins=((0.5, 0.5), (0.5, 1e-9)))  # the reference's own scores were a near tie there
    assert selection_problems(near, {0: bad}, 1e-6) == ([], None)
    # the near-tie bound: the floor, or a multiple of the largest margin the noise run's selection moved at
    assert near_tie_bound(ref, None, 1e-6, 4.0) == near_tie_bound(ref, ref, 1e-6, 4.0) == 1e-6
    moved = replace(ref, margins=((0.5, 0.5), (0.5, 0.01)))
    assert near_tie_bound(moved, bad, 1e-6, 4.0) == pytest.approx(0.04)
    assert selection_problems(moved, {0: bad}, 0.04) == ([], None)
    assert near_tie_bound(replace(ref, margins=((0.5, 0.5), (0.5, 0.9))), bad, 1e-6, 4.0) == 1.0


def test_plan_shows_the_indexer_split_the_selection_rule_and_every_cache_group() -> None:
    doc = plan_document(load_model("tiny-dsa"), "tp4dcp4", None, 512, 16)
    sparse = doc["sparse"]
    assert [r["index_heads"] for r in sparse["ranks"]] == [[0], [1], [2], [3]]
    assert all(r["group_index_heads"] == [0, 1, 2, 3] for r in sparse["ranks"])
    groups = {g["name"]: g for g in sparse["capacity"]["groups"]}
    assert set(groups) == {KV_GROUP, INDEX_GROUP} and groups[KV_GROUP]["blocks"] == groups[INDEX_GROUP]["blocks"]
    text = render_table(doc)
    for phrase in ("indexer heads split over tp=4", "selection: per query and layer", "global top-16",
                   "index_keys", "bytes_per_slot", "slots of"):
        assert phrase in text, phrase


def test_dsa_faults_act_only_on_sparse_models_and_their_topologies() -> None:
    gqa, dsa = load_model("tiny-gqa"), load_model("tiny-dsa")
    for name in ("dsa-local-topk", "dsa-indexer-offset", "dsa-sinks-evicted", "dsa-planner-rows",
                 "dsa-groups-unaligned"):
        assert name in FAULTS
        reason = inert_reason(name, gqa, parse_topology_name("tp4dcp4"))
        assert reason is not None and "acts on sparse attention" in reason
        assert inert_reason(name, dsa, parse_topology_name("tp4dcp4")) is None
    no_sinks = replace(dsa, sparse=replace(dsa.sparse, index_sinks=0))
    reason = inert_reason("dsa-sinks-evicted", no_sinks, parse_topology_name("tp2"))
    assert reason is not None and "index_sinks=0" in reason
    with pytest.raises(ConfigError, match="needs a DCP topology"):
        fault_flags("dsa-local-topk", parse_topology_name("tp2"))
    assert fault_flags("dsa-planner-rows", parse_topology_name("tp2dcp2")).dsa_row_rule == "round-robin"


# ---- real multi-process runs (gloo) -----------------------------------------------------------------------------

@pytest.mark.parametrize("topo", ["tp2", "tp4dcp2"])
def test_parallel_matches_tp1_with_the_same_selections(run, topo: str) -> None:
    ref, par = run("tiny-dsa", "tp1"), run("tiny-dsa", topo)
    assert ref.ok and par.ok, par.manifest.get("error")
    for kind in ("prefill_logits", "decode_logits", "hidden", "attn"):
        assert _max_err(ref, par, kind) < ATOL, kind
    want = ref.layout["target"]["ranks"][0]["sparse"]["selected"]
    ranks = par.layout["target"]["ranks"]
    assert all(r["sparse"]["selected"] == want for r in ranks)
    assert max(len(q) for layer in want for q in layer) == 16  # the prompt passes index_topk: selection bites
    t = parse_topology_name(topo)
    blocks = {json.dumps(r["sparse"]["cache_group_blocks"], sort_keys=True) for r in ranks}
    assert len(blocks) == 1 and len(set(json.loads(blocks.pop()).values())) == 1  # one slot count everywhere
    assert sorted(h for r in ranks for h in r["sparse"]["index_heads"]) == list(range(4))
    assert t.tp == len(ranks)


SMALL_SUITE = """
name: dsa-small
version: 1
description: two prompts longer than index_topk on tiny-dsa
models: [tiny-dsa]
topologies: [tp2dcp2]
reference: tp1
seeds: [0]
max_new_tokens: 4
decode_prefix_tokens: 3
prompts:
  - "Once upon a time, in a land far away, there lived a clever fox who"
  - "Q: 17 + 25 = ?\\nA: 42. Q: 3 + 4 = ?\\nA:"
checks: {layout: {}, logits: {}, generation: {}}
"""


@pytest.fixture(scope="module")
def suite_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("suite") / "dsa-small.yaml"
    path.write_text(SMALL_SUITE)
    return path


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _cell(tmp_path: Path, suite_file: Path, cache_dir: Path, *extra: str) -> tuple[int, dict]:  # type: ignore[type-arg]
    rc = main(["run", "--suite", str(suite_file), "--out", str(tmp_path), "--cache-dir", str(cache_dir), *extra])
    (cell,) = json.loads((tmp_path / "results.json").read_text())["cells"]
    return rc, cell


def test_the_clean_cell_passes(tmp_path: Path, suite_file: Path, cache_dir: Path) -> None:
    """Negative control of the faults below."""
    rc, cell = _cell(tmp_path, suite_file, cache_dir)
    reasons = {c["name"]: c["reason"] for c in cell["checks"]}
    assert rc == 0 and cell["status"] == "PASS", reasons
    assert "selected token sets of" in reasons["layout"] and "match the reference's on every rank" in reasons["layout"]


@pytest.mark.parametrize(("fault", "layout_problem"), [
    ("dsa-local-topk", "divergence starts at the indexer's top-k selection: query "),
    ("dsa-indexer-offset", "divergence starts at the indexer's top-k selection: query 0 layer 0 rank 0"),
    ("dsa-sinks-evicted", "divergence starts at the indexer's top-k selection: query 17 layer 0 rank 0"),
    ("dsa-planner-rows", "divergence starts at the indexer's top-k selection: query 1 layer 0 rank 0"),
])
def test_selection_faults_are_silent_corruption_localized_at_the_indexer(
        tmp_path: Path, suite_file: Path, cache_dir: Path, fault: str, layout_problem: str) -> None:
    rc, cell = _cell(tmp_path, suite_file, cache_dir, "--fault", fault)
    verdicts = {c["name"]: c["verdict"] for c in cell["checks"]}
    reasons = {c["name"]: c["reason"] for c in cell["checks"]}
    assert rc == 1 and cell["status"] == "FAIL" and cell["silent_corruption"] is True
    assert verdicts["layout"] == "FAIL" and reasons["layout"].startswith(layout_problem), reasons["layout"]
    assert "FAIL" in (verdicts["logits_prefill"], verdicts["logits_decode"]), reasons
    assert "sparse attention: the indexer's top-k selection diverges first" in cell["localization"]["summary"]


def test_an_unaligned_cache_group_fails_the_layout_naming_it(tmp_path: Path, suite_file: Path,
                                                            cache_dir: Path) -> None:
    rc, cell = _cell(tmp_path, suite_file, cache_dir, "--fault", "dsa-groups-unaligned")
    verdicts = {c["name"]: c["verdict"] for c in cell["checks"]}
    reasons = {c["name"]: c["reason"] for c in cell["checks"]}
    assert rc == 1 and cell["status"] == "FAIL" and cell["silent_corruption"] is True
    assert verdicts["layout"] == "FAIL" and reasons["layout"].startswith("rank 0: cache group index_keys: "), reasons
    assert verdicts["logits_prefill"] == verdicts["logits_decode"] == "PASS"  # the output is unchanged

