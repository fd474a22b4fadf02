"""Layout invariants: a layout built from the plan passes; each known layout bug is named."""

from __future__ import annotations

import copy
import json

from harness.compare.layout.attention import check_layout, check_layout_with_pool, expected_pool
from harness.core.verdict import Verdict
from harness.partition.layout import AttentionShape, plan_layout, plan_speculator
from tests.test_compare_support import BLOCK, BUDGET, GQA, MAX_SEQ, layout_entry

KV6 = AttentionShape(heads=24, kv_heads=6, head_dim=8, layers=2, dtype_bytes=4)


def test_layout_built_from_the_plan_passes() -> None:
    for shape, tp, dcp in ((GQA, 4, 4), (GQA, 4, 2), (GQA, 8, 1), (KV6, 4, 1), (KV6, 4, 2)):
        plan = plan_layout(shape, tp, dcp)
        actual = layout_entry(plan)
        result = check_layout(plan, actual, expected_pool(plan, actual))
        assert result.verdict is Verdict.PASS, (shape, tp, dcp, result.reason)
        assert result.metrics["problems"] == []
        json.dumps(result.to_dict(), allow_nan=False)


def test_tp_only_kv_layout_under_dcp_fails_naming_the_group() -> None:
    plan = plan_layout(GQA, 4, 4)
    broken = layout_entry(plan_layout(GQA, 4, 4, kv_dcp=1), pool_plan=plan)
    result = check_layout(plan, broken, expected_pool(plan, broken))
    assert result.verdict is Verdict.FAIL
    assert result.reason.startswith("KV head ids differ inside DCP group 0: rank 0 holds 0, rank 1 holds 0, "
                                    "rank 2 holds 1, rank 3 holds 1 (+")
    assert result.metrics["kv_ids_differ_in_groups"] == [0]
    problems = result.metrics["problems"]
    assert "rank 0 holds kv heads 0, planned 0-1" in problems
    assert any(p.startswith("rank 0 group Q heads 4-7 read KV heads 0,0,0,0, should read 1,1,1,1") for p in problems)
    assert "KV head 0 held by 2 rank(s), planned 4" in problems


def test_vocab_and_ffn_shards_off_plan_fail_naming_the_rank() -> None:
    """An engine reporting the shards it holds: as planned passes; a floor-offset vocab shard and a
    floor FFN split are each named with the rank and both ranges."""
    shape = AttentionShape(heads=8, kv_heads=2, head_dim=4, layers=2, dtype_bytes=4, ffn=290, vocab=389)
    plan = plan_layout(shape, 4)
    for broken_plan, want in ((plan, None),
                              (plan_layout(shape, 4, vocab_floor_offset=True),
                               "rank 1 holds vocab rows (token ids) 97-194, planned 98-195"),
                              (plan_layout(shape, 4, ffn_floor=True),
                               "rank 1 holds FFN columns 72-143, planned 72-144")):
        actual = layout_entry(plan)
        for entry, r in zip(actual["ranks"], broken_plan.ranks):
            entry["vocab_shard"], entry["ffn_shard"] = list(r.vocab_shard), list(r.ffn_shard)
        result = check_layout(plan, actual, expected_pool(plan, actual))
        if want is None:
            assert result.verdict is Verdict.PASS, result.reason
        else:
            assert result.verdict is Verdict.FAIL and result.reason.startswith(want), result.reason


def test_checksum_mismatch_inside_a_group_fails() -> None:
    plan = plan_layout(GQA, 4, 2)
    actual = layout_entry(plan)
    actual["ranks"][1]["kv_weight_checksums"]["0"] = "deadbeef"  # ranks 0 and 1 form DCP group 0
    result = check_layout(plan, actual, expected_pool(plan, actual))
    assert result.verdict is Verdict.FAIL
    assert result.reason.startswith("K/V weights of KV head 0 differ between ranks holding it: ranks 0 (")
    assert result.reason.endswith("vs ranks 1 (deadbeef)")
    # the switch turns it off
    assert check_layout(plan, actual, None, check_checksums=False).verdict is Verdict.PASS


def test_missing_checksum_fails() -> None:
    plan = plan_layout(GQA, 2, 2)
    actual = layout_entry(plan)
    del actual["ranks"][0]["kv_weight_checksums"]["0"]
    result = check_layout(plan, actual, None)
    assert result.verdict is Verdict.FAIL and result.reason == "rank 0 reports no K/V weight checksum for KV head 0"
    actual["ranks"][1]["kv_weight_checksums"]["7"] = "00"
    assert "rank 1 reports K/V weight checksums of KV heads 7 it does not hold" in \
        check_layout(plan, actual, None).metrics["problems"]


def test_naive_gqa_mapping_with_gcd_duplication_fails() -> None:
    plan = plan_layout(KV6, 4)
    naive = layout_entry(plan, q_map="naive")
    result = check_layout(plan, naive, expected_pool(plan, naive))
    assert result.verdict is Verdict.FAIL
    assert result.reason.startswith("rank 0 Q heads 2-5 read KV heads 1,1,2,2, should read 0,0,1,1")
    assert sum("read KV heads" in p for p in result.metrics["problems"]) == 4  # every rank, once (dcp=1)
    # under DCP the group's mapping is checked too
    dcp_plan = plan_layout(KV6, 8, 2)  # group of 6 Q heads over 3 held KV heads
    dcp_naive = layout_entry(dcp_plan, q_map="naive")
    problems = check_layout(dcp_plan, dcp_naive, None).metrics["problems"]
    assert any(p.startswith("rank 0 group Q heads") for p in problems)


def test_wrong_pool_bytes_fail_and_name_the_ratio() -> None:
    plan = plan_layout(GQA, 4, 4)
    actual = layout_entry(plan)
    pool = expected_pool(plan, actual)
    for rank in (1, 3):
        actual["ranks"][rank]["kv_pool_bytes"] = 2 * pool.pool_bytes
    result = check_layout(plan, actual, pool)
    assert result.verdict is Verdict.FAIL
    assert result.reason == f"ranks 1,3 have kv pool bytes {2 * pool.pool_bytes}, planned {pool.pool_bytes} (2.00x)"
    assert check_layout(plan, actual, None).verdict is Verdict.PASS  # pool not checked


def test_pool_sized_from_another_layout_has_the_wrong_block_count() -> None:
    plan = plan_layout(GQA, 4, 4)
    actual = layout_entry(plan, pool_plan=plan_layout(GQA, 4, 1))  # sized as if without dcp
    result = check_layout(plan, actual, expected_pool(plan, actual))
    assert result.verdict is Verdict.FAIL and result.reason.startswith("ranks 0-3 have kv pool blocks")


def test_speculator_reusing_the_dcp_layout_over_allocates() -> None:
    spec_plan = plan_speculator(GQA, 4)
    actual = layout_entry(spec_plan, pool_plan=plan_layout(GQA, 4, 4))
    result = check_layout_with_pool(spec_plan, actual, name="speculator_layout")
    assert result.verdict is Verdict.FAIL and result.name == "speculator_layout"
    assert "kv pool blocks" in " ".join(result.metrics["problems"])
    assert check_layout_with_pool(spec_plan, layout_entry(spec_plan)).verdict is Verdict.PASS


def test_budget_the_planner_cannot_fit_is_a_problem() -> None:
    plan = plan_layout(GQA, 2)
    actual = layout_entry(plan)
    actual["pool"]["budget_bytes"] = 100
    result = check_layout_with_pool(plan, actual)
    assert result.verdict is Verdict.FAIL and result.reason.startswith("KV pool: KV budget of 100 bytes")
    assert "short by" in result.reason


def test_heads_off_plan_and_missing_ranks_and_malformed_entries() -> None:
    plan = plan_layout(GQA, 4, 2)
    actual = layout_entry(plan)
    swapped = copy.deepcopy(actual)
    swapped["ranks"][0]["q_heads"], swapped["ranks"][1]["q_heads"] = [2, 3], [0, 1]
    result = check_layout(plan, swapped, None)
    assert result.verdict is Verdict.FAIL and "rank 0 holds q heads 2-3, planned 0-1" in result.metrics["problems"]
    missing = copy.deepcopy(actual)
    missing["ranks"].pop()
    assert "layout reports ranks 0-2, planned 0-3" in check_layout(plan, missing, None).metrics["problems"]
    malformed = copy.deepcopy(actual)
    del malformed["ranks"][2]["q_to_kv"]
    bad = check_layout(plan, malformed, None)
    assert bad.verdict is Verdict.ERROR and bad.reason == "layout entry rank 2: field 'q_to_kv' is missing"
    assert check_layout(plan, {}, None).verdict is Verdict.ERROR
    assert check_layout_with_pool(plan, {"ranks": actual["ranks"]}).verdict is Verdict.ERROR


def test_budget_fixture_is_consistent() -> None:
    assert (BUDGET, MAX_SEQ, BLOCK) == (1 << 20, 64, 16)


def _served(**logged: dict) -> dict:
    return {"ranks": [], "pool": {"budget_bytes": BUDGET, "max_seq_len": MAX_SEQ, "block_size": BLOCK},
            "kv_budget_given": True, **logged}


def test_logged_kv_capacity_as_planned_passes_and_a_speculator_pool_split_like_dcp_fails() -> None:
    from harness.compare.layout.attention import check_kv_capacity, predicted_kv_capacity
    plan, spec_plan = plan_layout(GQA, 4, 4), plan_speculator(GQA, 4)
    pool = _served()["pool"]
    shown = ("tokens", "blocks", "bytes")
    plain = {k: v for k, v in predicted_kv_capacity(plan, pool, None).items() if k in shown}
    spec = {k: v for k, v in predicted_kv_capacity(plan, pool, spec_plan).items() if k in shown}
    assert spec["bytes"] > plain["bytes"] and plain["tokens"] == plain["blocks"] * BLOCK * 4
    ok = check_kv_capacity(plan, _served(kv_capacity=plain, kv_capacity_speculative=spec), spec_plan)
    assert ok.verdict is Verdict.PASS, ok.reason
    # the speculator's KV heads split over tp // dcp like the target's: more heads per rank, more bytes
    split = plan_layout(GQA, 4, dcp=1, kv_dcp=4)
    over = {k: v for k, v in predicted_kv_capacity(plan, pool, split).items() if k in shown}
    bad = check_kv_capacity(plan, _served(kv_capacity=plain, kv_capacity_speculative=over), spec_plan)
    assert bad.verdict is Verdict.FAIL and bad.reason.startswith(
        f"speculative server logged KV cache bytes={over['bytes']}")
    # bugs nobody catalogued: an engine that forgets dcp in its token count, or sizes one block short
    for wrong in ({**plain, "tokens": plain["tokens"] // 4}, {"blocks": plain["blocks"] - 1}):
        assert check_kv_capacity(plan, _served(kv_capacity=wrong), None).verdict is Verdict.FAIL
    # vLLM's line has tokens only; an engine not given the budget is recorded, not compared
    assert check_kv_capacity(plan, _served(kv_capacity={"tokens": plain["tokens"]}), None).verdict is Verdict.PASS
    assert check_kv_capacity(plan, {**_served(kv_capacity=plain), "kv_budget_given": False},
                             None).verdict is Verdict.SKIP
    assert check_kv_capacity(plan, _served(), None).verdict is Verdict.ERROR
