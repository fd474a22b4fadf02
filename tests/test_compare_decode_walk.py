"""Decode-path parity from greedy generations (HTTP engines): the top-k of both runs compared along the
common greedy prefix, the walk stopping after the first diverging step; tokens at the divergence must be
in each other's top-k; near-tie flips are benign only while rare; non-finite logprobs FAIL naming where."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from harness.compare.parity.decode_walk import check_decode_walk, walk_case
from harness.compare.settings import LogitsSettings
from harness.core.verdict import Verdict
from harness.partition.layout import plan_layout
from harness.records.contract import MANIFEST_LOGPROB_VALUES
from tests.test_compare_support import GQA, synthetic_runs, with_tensors

GEN, K = 6, 4


@pytest.fixture(scope="module")
def runs():
    return synthetic_runs(plan_layout(GQA, 4, 2), n_cases=3, gen=GEN, k=K)


def gapped(run, case: int, step: int, gap: float):
    """`run` with its top-2 gap at `step` of `case` set to `gap` (as the reference and its noise run see it)."""
    lps = run.tensors[f"gen_topk_logprobs.{case}"].clone()
    lps[step, 1] = lps[step, 0] - gap
    return with_tensors(run, **{f"gen_topk_logprobs_{case}": lps})


def diverge(run, case: int, step: int, gap: float, pick: int = 1, outside: bool = False):
    """(reference, parallel) from `run`: the reference's top-2 gap at `step` of `case` set to `gap`; the
    parallel run picks the reference's choice number `pick` there (or, `outside`, a token outside the
    reference top-k, its own top-1) and generates other tokens after it."""
    lps = run.tensors[f"gen_topk_logprobs.{case}"].clone()
    lps[step, 1] = lps[step, 0] - gap
    ref = with_tensors(run, **{f"gen_topk_logprobs_{case}": lps})
    ids = run.tensors[f"gen_topk_ids.{case}"].clone()
    tokens = run.tensors[f"gen_tokens.{case}"].clone()
    if outside:
        token = int(ids[step].max()) + 1
        ids[step, 0] = token
    else:
        token = int(ids[step, pick])
        ids[step, [0, pick]] = ids[step, [pick, 0]]  # the parallel run's own top-1 is what it picked
    tokens[step] = token
    tokens[step + 1:] = (tokens[step + 1:] + 1) % 32
    par_lps = lps.clone()
    return ref, with_tensors(run, **{f"gen_tokens_{case}": tokens, f"gen_topk_ids_{case}": ids,
                                     f"gen_topk_logprobs_{case}": par_lps})


def test_identical_generations_compare_every_step_and_pass(runs) -> None:
    ref, noise, par = runs
    result, prompts = check_decode_walk(ref, par, noise, LogitsSettings(), k=K)
    assert result.verdict is Verdict.PASS, result.reason
    assert result.metrics["steps_compared"] == 3 * GEN and result.metrics["decode_steps_compared"] == 3 * (GEN - 1)
    assert result.reason.startswith(f"decode (greedy walk, top-{K}): {3 * GEN} greedy steps compared")
    assert [p["steps"] for p in prompts] == [GEN] * 3 and all(p["diverged_at_step"] is None for p in prompts)
    # the first step sits at the prompt's last position (the prefill's output), as on the prefill path
    assert prompts[0]["offset"] == len(ref.cases[0].prompt_ids) - 1


def test_a_near_tie_divergence_stops_the_walk_and_passes(runs) -> None:
    ref, noise, par = runs
    ref_tie, par_tie = diverge(ref, case=1, step=2, gap=1e-6)
    result, prompts = check_decode_walk(ref_tie, par_tie, gapped(noise, 1, 2, 1e-6), LogitsSettings(), k=K)
    assert result.verdict is Verdict.PASS, result.reason
    assert prompts[1]["steps"] == 3 and prompts[1]["diverged_at_step"] == 2  # steps 0, 1 and the diverging one
    assert result.metrics["steps_compared"] == 2 * GEN + 3 and result.metrics["benign_flips"] == 1


def test_a_clear_divergence_fails(runs) -> None:
    ref, noise, par = runs
    ref_gap, par_gap = diverge(ref, case=0, step=3, gap=2.0)
    result, _ = check_decode_walk(ref_gap, par_gap, gapped(noise, 0, 3, 2.0), LogitsSettings(), k=K)
    assert result.verdict is Verdict.FAIL and "top-1 flip(s) outside near ties" in result.reason


def test_a_token_outside_the_other_runs_top_k_fails_naming_it(runs) -> None:
    ref, noise, par = runs
    ref_out, par_out = diverge(ref, case=2, step=1, gap=1e-6, outside=True)
    result, prompts = check_decode_walk(ref_out, par_out, gapped(noise, 2, 1, 1e-6), LogitsSettings(), k=K)
    ref_token, token = int(ref_out.tensors["gen_tokens.2"][1]), int(par_out.tensors["gen_tokens.2"][1])
    assert result.verdict is Verdict.FAIL
    assert (f"prompt 2 step 1: reference token {ref_token} not in the parallel top-{K} and parallel token {token} "
            f"not in the reference top-{K}") in result.reason
    assert prompts[2]["problem"].startswith("prompt 2 step 1")


def test_logprob_drift_before_any_divergence_fails(runs) -> None:
    ref, noise, par = runs
    lps = par.tensors["gen_topk_logprobs.0"].clone()
    lps[4, 1:] -= 0.5  # same greedy tokens, a different distribution at step 4
    result, prompts = check_decode_walk(ref, with_tensors(par, gen_topk_logprobs_0=lps), noise, LogitsSettings(), k=K)
    assert result.verdict is Verdict.FAIL and "max logprob error 5.0e-01" in result.reason
    assert prompts[0]["first_diverging_position"] == prompts[0]["offset"] + 4


def test_systematic_near_tie_flips_fail() -> None:
    n = 6
    ref, noise, par = synthetic_runs(plan_layout(GQA, 4, 2), n_cases=n, gen=GEN, k=K)
    # positive control: every prompt flips at a near tie on its first step, the noise walks never do:
    # 6 flips in 6 steps against 0 in 36 -> FAIL
    for case in range(n):
        ref, par = diverge(ref, case=case, step=0, gap=1e-6)[0], diverge(par, case=case, step=0, gap=1e-6)[1]
    result, _ = check_decode_walk(ref, par, noise, LogitsSettings(), k=K)
    assert result.verdict is Verdict.FAIL
    assert "6 top-1 flips at near ties in 6 steps against 0 in 36 of the noise run (+1 prior)" in result.reason
    assert result.metrics["tie_flip_p_value"] < LogitsSettings().tie_flips_alpha
    # negative control: a noise run that flips as often (its walks stop as early) passes
    noisy = noise
    for case in range(n):
        noisy = diverge(noisy, case=case, step=0, gap=1e-6)[1]
    assert check_decode_walk(ref, par, noisy, LogitsSettings(), k=K)[0].verdict is Verdict.PASS
    # a few prompts diverging late at near ties are within the noise run's rate (prior, floor)
    ref2, _, par2 = synthetic_runs(plan_layout(GQA, 4, 2), n_cases=n, gen=GEN, k=K)
    for case in range(3):
        ref2 = diverge(ref2, case=case, step=3, gap=1e-6)[0]
        par2 = diverge(par2, case=case, step=3, gap=1e-6)[1]
    late, _ = check_decode_walk(ref2, par2, noise, LogitsSettings(), k=K)
    assert late.verdict is Verdict.PASS, late.reason


@pytest.mark.parametrize("value, raw, said", [(math.nan, "null", "NaN at generation step 2 (token {t}; the engine "
                                                                  "answered null)"),
                                              (math.inf, None, "inf at generation step 2 (token {t})")])
def test_nonfinite_logprobs_fail_naming_prompt_step_and_value(runs, value: float, raw: str | None, said: str) -> None:
    ref, noise, par = runs
    lps = par.tensors["gen_topk_logprobs.1"].clone()
    lps[2, 1] = value
    bad = with_tensors(par, gen_topk_logprobs_1=lps)
    token = int(bad.tensors["gen_topk_ids.1"][2, 1])
    if raw:  # what the server answered there, as its backend recorded it
        bad = replace(bad, manifest={**bad.manifest, MANIFEST_LOGPROB_VALUES: [
            {"case": 1, "kind": "gen_topk_logprobs", "row": 2, "token": token, "value": raw}]})
    result, _ = check_decode_walk(ref, bad, noise, LogitsSettings(), k=K)
    assert result.verdict is Verdict.FAIL
    assert result.reason == "decode (greedy walk): parallel gen_topk_logprobs of prompt 1: " + said.format(t=token)


def test_missing_generation_tensors_are_an_error(runs) -> None:
    ref, noise, par = runs
    tensors = {k: v for k, v in par.tensors.items() if not k.startswith("gen_topk_ids")}
    result, _ = check_decode_walk(ref, replace(par, tensors=tensors), noise, LogitsSettings(), k=K)
    assert result.verdict is Verdict.ERROR


def test_walk_case_counts_the_common_prefix_plus_the_diverging_step(runs) -> None:
    ref, _, par = runs
    ref_tie, par_tie = diverge(ref, case=0, step=0, gap=1e-6)
    walk = walk_case(ref_tie, par_tie, 0, K)
    assert walk.steps == 1 and walk.diverged_at == 0 and walk.missing is None
    assert torch.equal(walk.metrics.top1_match, torch.tensor([False]))
