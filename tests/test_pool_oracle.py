"""The KV pool held to first principles (compare/layout/capacity.py), not to the planner's sizing function the
engine shares: a correct pool passes at every shape, DCP and placement; a pool sized by a wrong shared function
passes the planner comparison and fails the oracle."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from harness.compare.layout.attention import check_layout, check_layout_with_pool, reports_by_rank
from harness.compare.layout.capacity import FirstPrinciplesPool, largest_share, pool_problems
from harness.core.verdict import Verdict
from harness.partition.layout import AttentionShape, Placement, PoolCapacity, plan_layout
from tests.test_compare_support import BLOCK, BUDGET, GQA, MAX_SEQ, layout_entry

KV6 = AttentionShape(heads=24, kv_heads=6, head_dim=8, layers=2, dtype_bytes=4)
MLA = AttentionShape(heads=8, kv_heads=1, head_dim=16, layers=2, dtype_bytes=2, kv_lora_rank=32, qk_rope_dim=8)


@pytest.mark.parametrize(("shape", "tp", "dcp", "placement"), [
    (GQA, 4, 4, Placement()), (GQA, 4, 2, Placement("interleave", 4)), (GQA, 8, 1, Placement()),
    (KV6, 4, 2, Placement()), (GQA, 4, 4, Placement("contiguous")), (MLA, 4, 4, Placement()), (MLA, 2, 1, Placement())])
def test_a_correct_pool_passes_the_first_principles_oracle(shape: AttentionShape, tp: int, dcp: int,
                                                           placement: Placement) -> None:
    """Negative control: the planner's correct pool, at every shape and placement, is what first principles give."""
    plan = plan_layout(shape, tp, dcp, placement=placement)
    actual = layout_entry(plan)
    assert pool_problems(shape, dcp, placement, actual["pool"], reports_by_rank(actual)) == []
    result = check_layout_with_pool(plan, actual)
    assert result.verdict is Verdict.PASS, result.reason


def test_the_largest_share_is_counted_position_by_position() -> None:
    assert largest_share(64, 4, Placement()) == 16
    assert largest_share(65, 4, Placement()) == 17
    assert largest_share(40, 2, Placement("interleave", 16)) == 24  # chunks 0-15, 32-39 on rank 0
    assert largest_share(64, 4, Placement("contiguous")) == 64
    assert largest_share(64, 1, Placement("contiguous")) == 64


def _sized(tokens_per_slot: int, bytes_per_token: int) -> PoolCapacity:
    """The pool a sizing function that counts `tokens_per_slot` tokens per slot of `bytes_per_token` bytes gives
    (the engine's and the planner's, when they share it)."""
    block_bytes = BLOCK * bytes_per_token
    blocks_per_slot = -(-tokens_per_slot // BLOCK)
    return PoolCapacity(budget_bytes=BUDGET, block_size=BLOCK, blocks_per_slot=blocks_per_slot,
                        slots=BUDGET // (blocks_per_slot * block_bytes), block_bytes=block_bytes)


def test_a_wrong_shared_sizing_function_passes_the_planner_and_fails_the_oracle() -> None:
    """Positive control: the engine and the planner share a sizing function that counts the KV heads of the TP-only
    layout (one per rank) where a tp4/dcp4 rank holds both: its blocks of half the real bytes give the budget
    twice the blocks it can hold. The planner comparison agrees with the engine; first principles do not."""
    plan = plan_layout(GQA, 4, 4)
    real = 2 * GQA.layers * 2 * GQA.head_dim * GQA.dtype_bytes  # K and V x layers x 2 KV heads x head_dim x 4 bytes
    assert real == plan.kv_bytes_per_token_per_rank
    buggy = _sized(MAX_SEQ // 4, real // 2)
    actual = copy.deepcopy(layout_entry(plan))
    for rank in actual["ranks"]:
        rank["kv_pool_bytes"], rank["kv_pool_blocks"] = buggy.pool_bytes, buggy.blocks
    blind = check_layout(plan, actual, buggy)  # what holding the engine to its own function sees
    assert blind.verdict is Verdict.PASS, blind.reason
    problems = pool_problems(GQA, 4, Placement(), actual["pool"], reports_by_rank(actual))
    assert len(problems) == 4 and problems[0] == (
        f"rank 0's KV pool of {buggy.blocks} blocks takes {buggy.pool_bytes} bytes, "
        f"{buggy.blocks * BLOCK * real} at {real} bytes per token")
    want = FirstPrinciplesPool(real, MAX_SEQ // 4, BLOCK, BUDGET, "slots")
    assert buggy.blocks == 2 * want.blocks


def test_a_pool_over_its_budget_or_with_the_wrong_bytes_per_block_fails() -> None:
    plan = plan_layout(KV6, 4, 2)
    actual = copy.deepcopy(layout_entry(plan))
    actual["ranks"][2]["kv_pool_bytes"] = BUDGET + 1
    actual["ranks"][3]["kv_pool_bytes"] -= 4
    problems = pool_problems(KV6, 2, Placement(), actual["pool"], reports_by_rank(actual))
    assert problems[0] == f"rank 2's KV pool of {BUDGET + 1} bytes exceeds its budget of {BUDGET} bytes"
    assert problems[1].startswith("rank 3's KV pool of")
    result = check_layout_with_pool(plan, actual)
    assert result.verdict is Verdict.FAIL and result.metrics["pool_first_principles"] == problems


def test_block_sized_pools_are_whole_blocks_of_the_budget() -> None:
    plan = plan_layout(GQA, 2, 1)
    actual = layout_entry(plan)
    pool = {**actual["pool"], "sizing": "blocks"}
    per_token = 2 * GQA.layers * 1 * GQA.head_dim * GQA.dtype_bytes
    reports = reports_by_rank(actual)
    blocks = BUDGET // (BLOCK * per_token)
    fixed = {r: replace(g, kv_pool_blocks=blocks, kv_pool_bytes=blocks * BLOCK * per_token) for r, g in reports.items()}
    assert pool_problems(GQA, 1, Placement(), pool, fixed) == []
    short = {r: replace(g, kv_pool_blocks=blocks - 1, kv_pool_bytes=(blocks - 1) * BLOCK * per_token)
             for r, g in reports.items()}
    assert pool_problems(GQA, 1, Placement(), pool, short)[0].startswith(
        f"rank 0 allocated {blocks - 1} KV blocks")  # a whole block of the budget left unused
