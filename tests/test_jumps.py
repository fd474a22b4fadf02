"""Jumps (divergences outside near ties) against the reference engine's own jump rate (compare/parity/jumps.py):
benign only where rounding-only comparisons jump as often; with no such evidence every jump FAILs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from harness.cli import main
from harness.compare.parity.generation import check_generation
from harness.compare.parity.jumps import JumpEvidence, JumpTest, pooled
from harness.compare.parity.schedule import Steps, compare_consistency, compare_schedules, evidence_of, grade
from harness.compare.settings import (
    ConsistencySettings,
    GenerationSettings,
    LosslessSettings,
    SelfConsistencySettings,
)
from harness.compare.speculative import check_lossless
from harness.core.errors import ConfigError
from harness.core.verdict import Verdict
from harness.records.results import results_cells
from tests.test_compare_generation import decode, diverge_at, runs  # noqa: F401 (fixture)

NOISE_FREE = JumpEvidence((1e-5,), 300)  # rounding-only comparisons that differ only at a near tie
ROUTING = JumpEvidence((math.inf, math.inf), 300)  # ... that jump twice in 300 steps (an expert routing flip)


def test_jump_test_needs_evidence_and_a_matching_rate() -> None:
    assert not JumpTest(1, 50, 0, 300, 1e-3).benign  # no evidence of any jump: one is a FAIL
    assert JumpTest(2, 50, 2, 300, 1e-3).benign  # as often as the evidence
    assert not JumpTest(12, 72, 2, 300, 1e-3).benign  # every prompt jumps: far more often
    assert JumpTest(0, 50, 0, 0, 1e-3).benign


def test_jumps_alpha_is_validated() -> None:
    with pytest.raises(ConfigError, match="jumps_alpha=1.5 must be within"):
        GenerationSettings(jumps_alpha=1.5)


def _steps(n: int, k: int = 5, tokens: list[int] | None = None) -> Steps:
    """n greedy steps with top-k ids 10*t .. 10*t + k - 1 and logprobs -1, -1.5, ... (gap 0.5)."""
    ids = torch.tensor([[10 * t + j for j in range(k)] for t in range(n)])  # [n, k]
    lps = torch.tensor([[-1.0 - 0.5 * j for j in range(k)] for _ in range(n)], dtype=torch.float64)  # [n, k]
    return Steps(tokens if tokens is not None else ids[:, 0].tolist(), ids, lps)


def _jumped(base: Steps, step: int) -> Steps:
    """A copy of `base` that picks a token outside base's top-k at `step`, with its own logprobs far off there."""
    tokens = list(base.tokens)
    tokens[step:] = [999] * (len(tokens) - step)
    ids, lps = base.ids.clone(), base.lps.clone()
    ids[step, 0], lps[step, 0] = 999, -0.1
    return Steps(tokens, ids, lps)


def test_schedule_jump_fails_without_evidence_and_passes_with_it() -> None:
    base = _steps(6)
    pairs = [compare_schedules(0, base, _jumped(base, 2)), compare_schedules(1, base, base)]
    noise = [[compare_schedules(0, base, base)]]
    settings = SelfConsistencySettings()
    failed = grade("self_consistency", pairs, noise, settings, "copies", evidence=NOISE_FREE)
    assert failed.verdict is Verdict.FAIL
    assert "prompt 0 copies diverges at generation step 2 (outside its top-k)" in failed.reason
    passed = grade("self_consistency", pairs, noise, settings, "copies", evidence=ROUTING)
    assert passed.verdict is Verdict.PASS, passed.reason
    assert "1 jump as often as rounding does" in passed.reason
    assert passed.metrics["max_logprob_diff"] == 0.0  # the jump's own step is left out of the logprob bound
    assert passed.metrics["benign_jumps"] == 1 and passed.metrics["noise_jumps"] == 2


def test_schedule_jumps_on_every_prompt_fail_even_with_evidence() -> None:
    base = _steps(6)
    pairs = [compare_schedules(i, base, _jumped(base, 1)) for i in range(12)]
    rare = JumpEvidence((math.inf,), 3000)  # one jump in 3000 rounding-only steps
    result = grade("self_consistency", pairs, [[compare_schedules(0, base, base)]], SelfConsistencySettings(),
                   "copies", evidence=rare)
    assert result.verdict is Verdict.FAIL
    assert "12/12 prompts diverge outside near ties (12 jumps in 24 steps against 1 in 3000" in result.reason


def test_a_token_outside_the_re_prefills_top_k_is_a_near_tie_where_the_decode_side_shows_one() -> None:
    """bfloat16 MoE (a clean tiny-hybrid-bf16 tp2ep2 run): the decode step's top-1 is just below the re-prefill's
    5-wide top-k, whose span is 0.56 nats, and the re-prefill's top-1 is in the decode step's top-k 0.06 below its
    top-1. Read from the decode side it is a tie of at most 0.56 nats (topk.crossed_tie, as generation reads one), so
    under a near-tie bound above that it is no jump and the step's logprob difference is the two top-1 logprobs';
    under a tighter bound it stays a jump, and a token outside both top-k lists stays one at any bound."""
    prefill = _steps(3)
    prefill.lps[1] = torch.tensor([-1.963, -2.213, -2.275, -2.463, -2.525], dtype=torch.float64)
    ids = prefill.ids.clone()
    ids[1] = torch.tensor([999, 10, 11, 12, 13])  # the decode's top-1 (999) is outside the re-prefill's top-k
    lps = prefill.lps.clone()
    lps[1] = torch.tensor([-2.143, -2.2, -2.205, -2.33, -2.393], dtype=torch.float64)
    decode_steps = Steps([0, 999, 20], ids, lps)
    pair = compare_consistency(0, decode_steps, prefill)
    assert pair.diffs == ((1, pytest.approx(0.562)),)
    assert pair.lps[1] == pytest.approx(abs(-2.143 + 1.963))  # the tied maxima
    noise = [[compare_consistency(0, prefill, prefill)]]
    loose = ConsistencySettings(near_tie=1.0, logprob_floor=1.0)  # a bfloat16 cell's measured bounds
    passed = grade("decode_consistency", [pair], noise, loose, "decode vs re-prefill", evidence=NOISE_FREE)
    assert passed.verdict is Verdict.PASS and "1 diverge at near ties" in passed.reason, passed.reason
    tight = grade("decode_consistency", [pair], noise, ConsistencySettings(), "decode vs re-prefill",
                  evidence=NOISE_FREE)
    assert tight.verdict is Verdict.FAIL and "gap 5.6e-01 > near-tie" in tight.reason, tight.reason
    ids[1, 1] = 998  # the re-prefill's top-1 leaves the decode's top-k too: a jump at any bound
    both = compare_consistency(0, Steps([0, 999, 20], ids, lps), prefill)
    assert math.isinf(both.diffs[0][1])


def test_consistency_counts_every_jumping_step() -> None:
    prefill = _steps(6)
    decode_steps = _steps(6, tokens=[0, 10, 999, 30, 998, 50])  # two steps outside the re-prefill's top-k
    pair = compare_consistency(0, decode_steps, prefill)
    assert [s for s, _ in pair.diffs] == [2, 4] and all(math.isinf(g) for _, g in pair.diffs)
    assert evidence_of([[pair]]).jumps(1.0) == 2
    noise = [[compare_consistency(0, prefill, prefill)]]
    assert grade("decode_consistency", [pair], noise, ConsistencySettings(), "decode vs re-prefill",
                 evidence=NOISE_FREE).verdict is Verdict.FAIL
    passed = grade("decode_consistency", [pair], noise, ConsistencySettings(), "decode vs re-prefill",
                   evidence=ROUTING)
    assert passed.verdict is Verdict.PASS, passed.reason  # the inf logprob differences are the jumps' own


def test_generation_jump_against_evidence(runs) -> None:  # noqa: F811
    ref, _, _ = runs
    ref_gap, par_gap = diverge_at(ref, step=3, gap=0.5)
    settings = GenerationSettings()
    clean_engine, _ = check_generation(ref_gap, par_gap, settings, decode=decode, evidence=NOISE_FREE)
    assert clean_engine.verdict is Verdict.FAIL and "(ref gap 5.0e-01 > near-tie 1.0e-03)" in clean_engine.reason
    routed, prompts = check_generation(ref_gap, par_gap, settings, decode=decode, evidence=ROUTING)
    assert routed.verdict is Verdict.PASS, routed.reason
    assert "0 diverge at near ties" in routed.reason and "; 1 jump as often as rounding does" in routed.reason
    assert prompts[0]["benign"] is False
    rare = JumpEvidence((math.inf,), 100_000)
    assert check_generation(ref_gap, par_gap, settings, decode=decode, evidence=rare)[0].verdict is Verdict.FAIL


def _hybrid_bf16(tmp_path: Path, *extra: str,
                 model: str = "tiny-hybrid-bf16") -> tuple[int, dict[str, dict[str, dict]]]:
    out = tmp_path / "out"
    code = main(["run", "--suite", "hybrid", "--model", model, "--topo", "tp2", "--seed", "0",
                 "--out", str(out), "--cache-dir", str(tmp_path.parent / "cache"), *extra])
    return code, {c["workload"]: {ch["name"]: ch for ch in c["checks"]} for c in results_cells(out)}


def test_bf16_routing_flips_pass_and_a_stale_state_slot_still_fails(tmp_path: Path) -> None:
    """tiny-hybrid-bf16 at tp2, seed 0: a copy's expert routing flips at a router near tie and its tokens jump
    (outside the first copy's top-5) as the reference engine's own decode against re-prefill does: PASS
    (negative control). The stale state slot the reference shares still FAILs the same jump tests (positive
    control) on the float32 twin, tiny-hybrid: its decode jumps where its reference, which reuses no slot, never
    does. (On the bf16 model whether the stale state moves a token out of the top-k depends on the CPU's bf16
    kernels: flagged where AVX-512 runs them, not on an AVX2-only CPU; docs/tolerances.md.)"""
    code, cells = _hybrid_bf16(tmp_path / "clean")
    assert code == 0, {w: [(n, c["reason"]) for n, c in ch.items() if c["verdict"] != "PASS"]
                       for w, ch in cells.items()}
    sc = cells["self-consistency"]
    assert sc["decode_consistency"]["metrics"]["noise_jumps"] >= 1  # the engine jumps under rounding alone
    assert sum(sc[n]["metrics"]["jumps"] for n in ("self_consistency", "decode_consistency", "generation")) >= 1
    code, cells = _hybrid_bf16(tmp_path / "fault", "--fault", "state-slot-stale", model="tiny-hybrid")
    assert code == 1
    check = cells["self-consistency"]["decode_consistency"]
    assert check["verdict"] == "FAIL" and "outside its top-k" in check["reason"], check["reason"]
    assert cells["self-consistency"]["self_consistency"]["verdict"] == "FAIL"


def test_lossless_bound_follows_the_noise_and_jumps_the_evidence() -> None:
    """lossless: a speculative token at a plain gap of 2.9 FAILs against the 1e-3 floor, is a near tie where
    the noise run's top-2 gap error is 0.7 (bound 3.5); a token outside the plain top-k is a jump: FAIL
    without evidence, PASS against an engine that jumps as often."""
    plain = [[5, 6, 7, 8], [1, 2, 3, 4]]
    ids = [torch.tensor([[5, 9], [6, 9], [7, 4], [8, 9]]), torch.tensor([[1, 0], [2, 0], [3, 0], [4, 0]])]
    lps = [torch.tensor([[-0.1, -3.0]] * 4), torch.tensor([[-0.1, -3.0]] * 4)]
    gap = [[5, 6, 4, 8], [1, 2, 3, 4]]
    assert check_lossless(gap, plain, LosslessSettings(), ids, lps).verdict is Verdict.FAIL
    noisy = check_lossless(gap, plain, LosslessSettings(), ids, lps, gap_noise=0.7)
    assert noisy.verdict is Verdict.PASS and noisy.metrics["near_tie"] == pytest.approx(3.5), noisy.reason
    outside = [[5, 6, 99, 8], [1, 2, 3, 4]]
    assert check_lossless(outside, plain, LosslessSettings(), ids, lps, gap_noise=0.7,
                          evidence=NOISE_FREE).verdict is Verdict.FAIL
    routed = check_lossless(outside, plain, LosslessSettings(), ids, lps, gap_noise=0.7, evidence=ROUTING)
    assert routed.verdict is Verdict.PASS and "1 jump as often as rounding does" in routed.reason, routed.reason


def test_the_engines_jump_evidence_pools_its_workloads_steps() -> None:
    """The jump rate is the engine's, model's and dtype's: a run's greedy workloads are one measurement of it. A
    prompts view with no jump in 84 rounding-only steps alone FAILs a single jump; pooled with a self-consistency view
    of the same runs (2 jumps in 211 steps) that jump is as frequent as the engine's (a clean bfloat16 MoE run)."""
    prompts, copies = JumpEvidence((1e-5,), 84), JumpEvidence((math.inf, math.inf, 0.5), 211, (math.inf,), 100)
    both = pooled([prompts, copies])
    assert both == JumpEvidence((1e-5, math.inf, math.inf, 0.5), 295, (math.inf,), 100)
    assert not JumpTest(1, 36, *prompts.counted(1.0, 1e-3), 1e-3).benign
    assert JumpTest(1, 36, *both.counted(1.0, 1e-3), 1e-3).benign
    assert not JumpTest(12, 36, *both.counted(1.0, 1e-3), 1e-3).benign  # a bug's jump rate still FAILs
