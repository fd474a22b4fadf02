"""Generation agreement: identical, benign near-tie divergence, clear divergence, noise scaling."""

from __future__ import annotations

import json
from typing import Sequence

import pytest
import torch

from harness.compare.parity.generation import check_generation, first_divergence
from harness.compare.settings import GenerationSettings
from harness.core.verdict import Verdict
from harness.partition.layout import plan_layout
from tests.test_compare_support import GQA, synthetic_runs, with_tensors

WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "away"]


def decode(ids: Sequence[int]) -> str:
    return "".join(f" {WORDS[i % len(WORDS)]}" for i in ids)


@pytest.fixture(scope="module")
def runs():
    return synthetic_runs(plan_layout(GQA, 4, 2), n_cases=3)


def diverge_at(run, step: int, gap: float, rank_in_ref: int = 1, case: int = 0):
    """A copy of `run` whose reference top-k logprobs at `step` have a top-1 minus top-2 gap of
    `gap`, and a parallel copy that picks the reference's choice number `rank_in_ref` there."""
    lps = run.tensors[f"gen_topk_logprobs.{case}"].clone()
    lps[step, 1] = lps[step, 0] - gap
    ref = with_tensors(run, **{f"gen_topk_logprobs_{case}": lps})
    tokens = run.tensors[f"gen_tokens.{case}"].clone()
    tokens[step] = int(run.tensors[f"gen_topk_ids.{case}"][step, rank_in_ref])
    tokens[step + 1:] = (tokens[step + 1:] + 1) % 32  # what follows differs too
    return ref, with_tensors(run, **{f"gen_tokens_{case}": tokens})


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_identical_generations_pass(runs) -> None:
    ref, noise, par = runs
    result, prompts = check_generation(ref, par, GenerationSettings(), noise=noise, decode=decode)
    assert result.verdict is Verdict.PASS and result.reason == "3/3 prompts identical (18 tokens)"
    assert all(p["first_divergence"] is None and p["benign"] is None for p in prompts)
    assert prompts[0]["ref_text"] == decode(ref.tensors["gen_tokens.0"].tolist())


def test_near_tie_divergence_is_benign(runs) -> None:
    ref, _, par = runs
    ref_tie, par_tie = diverge_at(ref, step=2, gap=1e-4)
    result, prompts = check_generation(ref_tie, par_tie, GenerationSettings(), decode=decode)
    assert result.verdict is Verdict.PASS, result.reason
    assert "2/3 prompts identical; 1 diverge at near ties" in result.reason
    div = prompts[0]
    assert div["first_divergence"] == 2 and div["benign"] is True and div["ref_gap"] == pytest.approx(1e-4)


def test_clear_gap_divergence_fails_with_context(runs) -> None:
    ref, _, par = runs
    ref_gap, par_gap = diverge_at(ref, step=3, gap=0.5)
    result, prompts = check_generation(ref_gap, par_gap, GenerationSettings(context_tokens=2), decode=decode)
    assert result.verdict is Verdict.FAIL
    ref_ids = ref.tensors["gen_tokens.0"].tolist()
    par_ids = par_gap.tensors["gen_tokens.0"].tolist()
    assert result.reason.startswith(f"prompt 0 diverges at token 3: ref {decode(ref_ids[3:4])!r} (id {ref_ids[3]}) "
                                    f"vs par {decode(par_ids[3:4])!r} (id {par_ids[3]}) "
                                    f"(ref gap 5.0e-01 > near-tie 1.0e-03)")
    assert [e["id"] for e in prompts[0]["ref_topk"]] == ref_gap.tensors["gen_topk_ids.0"][3].tolist()
    assert prompts[0]["par_topk"] and all(isinstance(e["token"], str) for e in prompts[0]["par_topk"])
    assert result.reason.endswith("1/3 prompts diverge outside near ties")
    div = prompts[0]
    assert div["benign"] is False
    assert div["context_ref"] == {"before": decode(ref_ids[1:3]), "token": decode(ref_ids[3:4]),
                                  "after": decode(ref_ids[4:6])}
    assert div["context_par"]["before"] == div["context_ref"]["before"]
    assert (div["par_token"], div["par_token_id"]) == (decode(par_ids[3:4]), par_ids[3])
    assert prompts[0]["par_text"] == decode(par_ids)
    assert result.metrics["first_divergence"] == {"prompt": 0, "position": 3}
    json.dumps([result.to_dict(), prompts], allow_nan=False)


def test_token_outside_reference_topk_fails_even_at_a_tie(runs) -> None:
    ref, _, _ = runs
    ref_tie, par_tie = diverge_at(ref, step=1, gap=1e-6)
    tokens = par_tie.tensors["gen_tokens.0"].clone()
    tokens[1] = 31 - int(ref.tensors["gen_topk_ids.0"][1, 0]) % 4  # not among the 4 top ids
    assert int(tokens[1]) not in ref.tensors["gen_topk_ids.0"][1].tolist()
    result, _ = check_generation(ref_tie, with_tensors(par_tie, gen_tokens_0=tokens), GenerationSettings())
    assert result.verdict is Verdict.FAIL and "not in the reference top-k" in result.reason


def test_length_difference_fails(runs) -> None:
    ref, _, par = runs
    short = with_tensors(par, gen_tokens_2=par.tensors["gen_tokens.2"][:4])
    result, prompts = check_generation(ref, short, GenerationSettings())
    assert result.verdict is Verdict.FAIL and "lengths differ: ref 6 vs par 4 tokens" in result.reason
    assert prompts[2]["par_token"] is None and prompts[2]["first_divergence"] == 4


def test_noise_run_scales_the_near_tie_bound(runs) -> None:
    ref, _, _ = runs
    ref_gap, par_gap = diverge_at(ref, step=2, gap=0.01)
    # a noise run equal to the reference: bound = the 1e-3 floor
    assert check_generation(ref_gap, par_gap, GenerationSettings(), noise=ref_gap)[0].verdict is Verdict.FAIL
    # a noise run whose top-2 gaps differ from the reference's by 0.004: bound 5 x 0.004 = 0.02
    lps = ref_gap.tensors["gen_topk_logprobs.1"].clone()
    lps[:, 1] -= 0.004
    noisy = with_tensors(ref_gap, gen_topk_logprobs_1=lps)
    result, prompts = check_generation(ref_gap, par_gap, GenerationSettings(), noise=noisy)
    assert result.verdict is Verdict.PASS, result.reason
    assert prompts[0]["near_tie_bound"] == pytest.approx(0.02)
    assert "noise 4.0e-03 x 5" in result.reason


def test_without_decoder_texts_come_from_cases_and_tokens_show_ids(runs) -> None:
    ref, _, par = runs
    ref_gap, par_gap = diverge_at(ref, step=0, gap=3.0)
    result, prompts = check_generation(ref_gap, par_gap, GenerationSettings())
    assert result.verdict is Verdict.FAIL
    assert prompts[0]["ref_text"] == "text 0"
    assert prompts[0]["ref_token"] == f"[{int(ref.tensors['gen_tokens.0'][0])}]"


def test_missing_generation_tensor_is_error(runs) -> None:
    ref, _, par = runs
    missing = with_tensors(par)
    del missing.tensors["gen_tokens.1"]
    assert check_generation(ref, missing, GenerationSettings())[0].verdict is Verdict.ERROR


def test_nan_logprobs_at_a_divergence_fail(runs) -> None:
    ref, _, _ = runs
    ref_tie, par_tie = diverge_at(ref, step=2, gap=1e-4)
    lps = ref_tie.tensors["gen_topk_logprobs.0"].clone()
    lps[2, :] = float("nan")
    result, prompts = check_generation(with_tensors(ref_tie, gen_topk_logprobs_0=lps), par_tie,
                                       GenerationSettings())
    assert result.verdict is Verdict.FAIL
    json.dumps([result.to_dict(), prompts], allow_nan=False)
    assert torch.isnan(lps[2, 0])


@pytest.mark.parametrize("who", ["reference", "parallel"])
def test_nonfinite_generation_logprobs_fail_naming_prompt_step_and_value(runs, who: str) -> None:
    ref, noise, par = runs
    lps = par.tensors["gen_topk_logprobs.2"].clone()
    lps[4, 0] = float("nan")
    token = int(par.tensors["gen_topk_ids.2"][4, 0])
    bad = with_tensors(ref if who == "reference" else par, gen_topk_logprobs_2=lps)
    pair = (bad, par) if who == "reference" else (ref, bad)
    result, prompts = check_generation(*pair, GenerationSettings(), noise=noise, decode=decode)
    assert result.verdict is Verdict.FAIL and prompts == []  # identical tokens, yet wrong output
    assert result.reason == f"{who} gen_topk_logprobs of prompt 2: NaN at generation step 4 (token {token})"
    # padding (an engine that returned fewer than k entries) is not a wrong value
    short = par.tensors["gen_topk_logprobs.2"].clone()
    ids = par.tensors["gen_topk_ids.2"].clone()
    short[4, -1], ids[4, -1] = float("-inf"), -1
    padded = with_tensors(par, gen_topk_logprobs_2=short, gen_topk_ids_2=ids)
    assert check_generation(ref, padded, GenerationSettings(), noise=noise)[0].verdict is Verdict.PASS
