"""A speculator configured and proposing nothing: a FAIL where the proposer proposes at every verify step (a draft
model, an MTP head), a SKIP naming why where it may legitimately find nothing (a prompt lookup)."""

from __future__ import annotations

import math

from harness.compare.settings import AcceptanceSettings
from harness.compare.speculative import check_acceptance_aggregate
from harness.core.verdict import Verdict

COUNTERS = "the engines' spec-decode counters"


def test_a_draft_or_mtp_speculator_that_counted_no_drafts_fails() -> None:
    for kind in ("draft", "mtp"):
        silent = check_acceptance_aggregate(2.1, math.nan, 3, AcceptanceSettings(), COUNTERS, kind)
        assert silent.verdict is Verdict.FAIL
        assert f"though its {kind} speculator proposes k=3 tokens at every verify step" in silent.reason
        assert "silently off" in silent.reason


def test_a_prompt_lookup_proposer_that_found_nothing_is_a_skip_and_a_counted_one_passes() -> None:
    lookup = check_acceptance_aggregate(math.nan, math.nan, 3, AcceptanceSettings(), COUNTERS, "lookup")
    assert lookup.verdict is Verdict.SKIP and "proposed nothing" in lookup.reason
    counted = check_acceptance_aggregate(2.1, 2.1, 3, AcceptanceSettings(), COUNTERS, "draft")
    assert counted.verdict is Verdict.PASS, counted.reason
