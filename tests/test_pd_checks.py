"""The pd checks as pure functions: the load-path robustness check on records a correct and a faulty connector
leave (each problem named; a fallback on an undamaged store, end to end too), the prefill-only vs prefill->decode
consistency, and the store's row digest."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from harness.cli import main
from harness.compare.pd_transfer import check_consistency, check_load
from harness.core.verdict import Verdict
from harness.engine.pd.store import row_digest
from harness.records.results import results_cells

POLICY = {"max_attempts": 3, "deadline_s": 10.0, "backoff_s": 0.05, "on_failure": "recompute"}


def _load(request: int, attempts: list[str], state: str, outcome: str, offset: int = 0) -> dict[str, Any]:
    return {"route": "generation", "request": request, "tokens": 40, "state": state, "attempts": attempts,
            "outcome": outcome, "resume_offset": offset, "blocks_held": 3, "waited_s": 0.2}


def _record() -> dict[str, Any]:
    """Two decode ranks: request 0 loaded, request 1's entry lost and recomputed from 0 after 3 attempts."""
    loads = [_load(0, ["ok"], "loaded", "loaded"), _load(1, ["FileNotFoundError: x"] * 3, "failed", "recomputed")]
    pool = {"blocks": 64, "free_start": 64, "free_end": 64}
    return {"policy": POLICY, "block_size": 16,
            "prefill": {"requests": [{"index": 0, "tokens": 41}, {"index": 1, "tokens": 41}],
                        "ranks": [{"free_start": 64, "free_end": 64, "sent": [0], "lost": [1]}] * 2},
            "decode": [{"rank": r, "loads": copy.deepcopy(loads), "pool": dict(pool), "kv_heads": [r]}
                       for r in range(2)]}


def test_a_recomputed_lost_entry_with_balanced_pools_passes() -> None:
    result = check_load(_record())
    assert result.verdict is Verdict.PASS, result.reason
    assert result.metrics["recomputed"] == 2 and result.metrics["lost_entries"] == [1]


def test_pools_an_engine_does_not_record_are_said_unchecked_not_balanced() -> None:
    """vLLM's scheduler owns its KV pool: the harness's connector records no free-block counts (null). The check
    says the pools were not checked; a pool that is recorded and unbalanced beside them still FAILs."""
    rec = _record()
    for rank in rec["decode"]:
        rank["pool"] = {"free_start": None, "free_end": None}
    rec["prefill"]["ranks"] = [{"free_start": None, "free_end": None, "sent": [0], "lost": [1]}] * 2
    result = check_load(rec)
    assert result.verdict is Verdict.PASS and "pools not checked" in result.reason, result.reason
    assert "balanced" not in result.reason
    rec["decode"][0]["pool"] = {"free_start": 64, "free_end": 61}
    partly = check_load(rec)
    assert partly.verdict is Verdict.FAIL and "decode rank 0: its KV pool ends with 61 free blocks" in partly.reason


def _broken(change: str) -> dict[str, Any]:
    rec = _record()
    for rank in rec["decode"]:
        lost = rank["loads"][1]
        if change == "unbounded":
            lost["attempts"] = ["FileNotFoundError: x"] * 40
        elif change == "false-success":
            lost["state"], lost["outcome"] = "loaded", "loaded"
        elif change == "offset":
            lost["resume_offset"] = 40
        elif change == "stuck":
            lost["state"] = "loading"
    if change == "leak":
        rec["decode"][1]["pool"]["free_end"] = 61
    if change == "prefill-leak":
        rec["prefill"]["ranks"] = [{"free_start": 64, "free_end": 60, "sent": [0], "lost": [1]}] * 2
    if change == "disagree":
        rec["decode"][1]["loads"][1]["outcome"] = "failed"
    return rec


def test_each_load_path_problem_is_a_fail_naming_it() -> None:
    expected = {
        "unbounded": "request 1 (generation) on decode rank 0: 40 load attempts, the policy bounds them at 3; it held "
                     "3 block(s)",
        "false-success": "request 1 (generation) on decode rank 0: reported loaded though every attempt failed",
        "offset": "recomputed after a failed load from position 40, not 0",
        "stuck": "left in state loading",
        "leak": "decode rank 1: its KV pool ends with 61 free blocks, it started with 64 (3 not returned)",
        "prefill-leak": "prefill rank 0: its KV pool ends with 60 free blocks",
        "disagree": "request 1 (generation): the decode ranks ended its load differently",
    }
    for change, fragment in expected.items():
        result = check_load(_broken(change))
        assert result.verdict is Verdict.FAIL, change
        assert fragment in result.reason, (change, result.reason)


def test_consistency_passes_equal_first_tokens_and_flags_a_changed_one() -> None:
    ids = torch.tensor([5, 7, 9])
    lps = torch.tensor([-0.1, -2.5, -3.0])
    same = check_consistency([(ids, lps)], [(ids.clone(), lps + 1e-6)])
    assert same.verdict is Verdict.PASS
    other = check_consistency([(ids, lps)], [(torch.tensor([7, 5, 9]), torch.tensor([-0.2, -0.3, -3.0]))])
    assert other.verdict is Verdict.FAIL and "request 0: first token 7 after the transfer, 5 on the prefill side" \
        in other.reason
    drift = check_consistency([(ids, lps)], [(ids.clone(), lps - 0.3)])
    assert drift.verdict is Verdict.FAIL and "delta 0.3000" in drift.reason
    tie = check_consistency([(ids, torch.tensor([-0.70, -0.71, -3.0]))], [(torch.tensor([7, 5, 9]),
                                                                           torch.tensor([-0.70, -0.71, -3.0]))])
    assert tie.verdict is Verdict.PASS  # a near tie of the prefill side: another first token is no finding


def test_row_digest_is_exact_per_row_and_head() -> None:
    k = torch.randn(5, 2, 8)
    v = torch.randn(5, 2, 8)
    base = row_digest(k, v)
    assert base.shape == (2, 5) and torch.equal(base, row_digest(k.clone(), v.clone()))
    bumped = k.clone()
    bumped[3, 1, 7] = torch.nextafter(bumped[3, 1, 7], torch.tensor(1e9))  # one ulp in one value
    diff = (row_digest(bumped, v) != base).nonzero().tolist()
    assert diff == [[1, 3]]  # head 1, row 3 only
    assert not torch.equal(row_digest(v, k), base)  # K and V are not interchangeable
    half = row_digest(k.to(torch.bfloat16), None)
    assert half.shape == (2, 5) and torch.equal(half, row_digest(k.to(torch.bfloat16).clone(), None))


def test_a_load_that_falls_back_on_an_undamaged_store_fails() -> None:
    """Positive control: every load fails and recomputes while no stored entry was lost (a decode instance whose
    loads all fall back: outputs right, P/D silently off). Negative control: the same fallback of request 1 under
    its injected loss passes (test_a_recomputed_lost_entry_with_balanced_pools_passes)."""
    rec = _record()
    for rank in rec["decode"]:
        rank["loads"][0] = _load(0, ["FileNotFoundError: x"] * 3, "failed", "recomputed")
    rec["prefill"]["ranks"] = [{"free_start": 64, "free_end": 64, "sent": [0, 1], "lost": []}] * 2
    result = check_load(rec)
    assert result.verdict is Verdict.FAIL
    assert "2 of 2 loads fell back on an undamaged store (requests 0-1" in result.reason, result.reason
    assert result.metrics["fallback_undamaged"] == [[0, "generation"], [1, "generation"]]
    # the same fallbacks under store damage the run applied (pd-store-missing): legitimate
    assert check_load(rec, "pd-store-missing").verdict is Verdict.PASS
    # one request's entry lost: only the other one's fallback is a finding
    rec["prefill"]["ranks"] = [{"free_start": 64, "free_end": 64, "sent": [0], "lost": [1]}] * 2
    partly = check_load(rec)
    assert partly.verdict is Verdict.FAIL
    assert "1 of 2 loads fell back on an undamaged store (requests 0:" in partly.reason, partly.reason


def test_a_decode_side_that_never_reads_its_undamaged_store_fails_pd_load_end_to_end(tmp_path: Path) -> None:
    """Positive control (pd-load-never-reads): every load fails and the prompts are recomputed, so the outputs and
    pd_consistency stay right; pd_load FAILs naming the fallback on an undamaged store."""
    out = tmp_path / "out"
    code = main(["run", "--suite", "pd", "--model", "tiny-gqa", "--topo", "tp2>tp1", "--workload", "prompts",
                 "--fault", "pd-load-never-reads", "--seed", "0", "--out", str(out), "--cache-dir",
                 str(tmp_path / "cache")])
    assert code == 1
    checks = {ch["name"]: ch for c in results_cells(out) for ch in c["checks"]}
    assert checks["pd_load"]["verdict"] == "FAIL"
    assert "12 of 12 loads fell back on an undamaged store (requests 0-5" in checks["pd_load"]["reason"]
    assert checks["pd_consistency"]["verdict"] == "PASS"
