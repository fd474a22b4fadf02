"""The placement and Q-weight layout invariants on constructed layout reports: a report as planned
passes (negative control), each kind of departure is named (positive controls)."""

from __future__ import annotations

import copy
from typing import Any

from harness.compare.layout.attention import check_layout, reports_by_rank
from harness.compare.layout.placement import placement_problems, q_weight_problems
from harness.core.verdict import Verdict
from harness.partition.layout import AttentionShape, LayoutPlan, Placement, local_positions, plan_layout

MLA = AttentionShape(heads=8, kv_heads=1, head_dim=16, layers=2, dtype_bytes=4, kv_lora_rank=32, qk_rope_dim=8)


def report(plan: LayoutPlan, length: int = 14, prompt_len: int = 3) -> dict[str, Any]:
    """The layout report a correct engine writes for `plan` (ranks only; no pool)."""
    ranks = []
    for r in plan.ranks:
        held = r.group_q_heads if plan.q_replicated else r.q_heads
        ranks.append({
            "rank": r.rank, "q_heads": list(r.q_heads), "kv_heads": list(r.kv_heads), "dcp_group": r.dcp_group,
            "dcp_rank": r.dcp_rank, "dcp_members": list(r.dcp_members), "kv_tp_rank": r.kv_tp_rank,
            "q_to_kv": list(r.q_to_kv), "group_q_heads": list(r.group_q_heads),
            "group_q_to_kv": [0] * len(r.group_q_heads), "kv_pool_bytes": 0, "kv_pool_blocks": 0,
            "kv_weight_checksums": {"0": "latent"},
            "stored_positions": {"length": length, "prompt_len": prompt_len,
                                 "positions": local_positions(length, r.dcp_rank, plan.dcp, plan.placement,
                                                              prompt_len)},
            "q_mode": "replicated" if plan.q_replicated else "split", "q_weight_heads": list(held),
            "q_weight_checksums": {str(h): f"head{h}" for h in held}, "latent_dim": 40})
    return {"ranks": ranks}


def test_a_report_as_planned_passes_for_every_placement_and_q_mode() -> None:
    for placement in (Placement(), Placement("interleave", 4), Placement("contiguous")):
        for q in (False, True):
            plan = plan_layout(MLA, 4, 4, placement=placement, q_replicated=q)
            result = check_layout(plan, report(plan), None)
            assert result.verdict is Verdict.PASS, result.reason
    plan = plan_layout(MLA, 4, 2)  # two DCP groups: each token's latent row once per group
    reason = check_layout(plan, report(plan), None).reason
    assert "MLA latent row (32 + 8 values) stored on 2 rank(s) per token" in reason


def test_a_token_dealt_by_another_rule_is_named() -> None:
    plan = plan_layout(MLA, 4, 4, placement=Placement("interleave", 4))
    actual = report(plan)
    by_token = plan_layout(MLA, 4, 4)  # what a per-token dealer stores
    for r, entry in enumerate(actual["ranks"]):
        entry["stored_positions"]["positions"] = local_positions(14, r, 4, by_token.placement, 3)
    problems = placement_problems(plan, reports_by_rank(actual))
    assert problems[0] == ("rank 0 stores tokens 0,4,8,12 of a 14-token sequence, the interleave 4 placement "
                           "gives it 0-3")
    result = check_layout(plan, actual, None)
    assert result.verdict is Verdict.FAIL and "interleave 4 placement" in result.reason


def test_a_token_stored_twice_or_never_is_named() -> None:
    plan = plan_layout(MLA, 4, 2)
    actual = report(plan)
    actual["ranks"][1]["stored_positions"]["positions"] = [1, 2, 3, 5, 7, 9, 11, 13]  # token 2 also on rank 1
    actual["ranks"][2]["stored_positions"]["positions"] = [0, 2, 4, 6, 8, 10]  # token 12 on neither rank of group 1
    problems = placement_problems(plan, reports_by_rank(actual))
    assert "tokens 2 are stored on several ranks of DCP group 0 (token 2: ranks 0-1)" in problems
    assert "tokens 12 are stored on no rank of DCP group 1" in problems


def test_q_weights_not_replicated_or_not_equal_are_named() -> None:
    plan = plan_layout(MLA, 4, 4, q_replicated=True)
    actual = report(plan)
    assert q_weight_problems(plan, reports_by_rank(actual)) == []
    actual["ranks"][1]["q_weight_checksums"]["0"] = "other"  # rank 1's copy of head 0 is not the owner's
    actual["ranks"][3]["q_weight_heads"] = [6, 7]  # rank 3 holds only its own heads
    by_rank = reports_by_rank(actual)
    problems = q_weight_problems(plan, by_rank)
    assert problems[0] == ("rank 3 holds Q weights (q_b_proj, w_kc) of heads 6-7, planned 0-7 "
                           "(Q replicated in the DCP group)")
    assert any(p.startswith("Q weights (q_b_proj, w_kc) of head 0 differ between ranks holding it: ranks 0,2-3")
               for p in problems), problems
    split = plan_layout(MLA, 4, 4)
    assert q_weight_problems(split, by_rank)[0].startswith("rank 0 holds Q weights (q_b_proj, w_kc) of heads 0-7, "
                                                           "planned 0-1 (Q split by tp)")


def test_a_report_without_the_new_entries_is_left_alone() -> None:
    """Engines that do not report stored positions or Q weights (HTTP probes, older runs) pass as before."""
    plan = plan_layout(MLA, 4, 4)
    actual = copy.deepcopy(report(plan))
    for entry in actual["ranks"]:
        del entry["stored_positions"], entry["q_mode"], entry["q_weight_heads"], entry["q_weight_checksums"]
        del entry["latent_dim"]
    assert check_layout(plan, actual, None).verdict is Verdict.PASS
