"""Logits parity on constructed tensors: noise-floor scaling, near ties, NaN/Inf, corruption."""

from __future__ import annotations

import json

import pytest
import torch

from harness.compare.parity.logits import check_logits, position_metrics
from harness.compare.settings import LogitsSettings
from harness.core.fmt import multiple as times_text
from harness.core.verdict import Verdict
from harness.partition.layout import plan_layout
from tests.test_compare_support import GQA, synthetic_runs, with_tensors

NOISE_ONLY = LogitsSettings(kl_floor=0.0, abs_floor=0.0)  # bounds from the noise run alone


@pytest.fixture(scope="module")
def runs():
    return synthetic_runs(plan_layout(GQA, 4, 2))


def test_identical_logits_pass(runs) -> None:
    ref, noise, _ = runs
    for path in ("prefill", "decode"):
        result, prompts = check_logits(path, ref, ref, noise, LogitsSettings())
        assert result.verdict is Verdict.PASS, result.reason
        assert result.name == f"logits_{path}"
        assert result.metrics["max_kl"] == 0.0 and result.metrics["top1_agreement"] == 1.0
        assert [p["first_diverging_position"] for p in prompts] == [None, None]
        json.dumps([result.to_dict(), prompts], allow_nan=False)


def test_noise_floor_sized_error_passes_on_noise_scaled_bounds(runs) -> None:
    ref, noise, par = runs
    result, _ = check_logits("decode", ref, par, noise, NOISE_ONLY)
    assert result.verdict is Verdict.PASS, result.reason
    assert "noise" in result.reason and result.metrics["kl_bound"]["noise"] > 0


def _scaled_noise(ref, noise, scale: float):
    """A parallel run whose decode logits differ from the reference's as the noise run's do, `scale` times."""
    return with_tensors(noise, **{f"decode_logits_{i}": ref.tensors[f"decode_logits.{i}"] + scale *
                                  (noise.tensors[f"decode_logits.{i}"] - ref.tensors[f"decode_logits.{i}"])
                                  for i in range(2)})


def test_scaling_the_noise_floor_changes_the_verdict(runs) -> None:
    ref, noise, par = runs
    # a noise run 1000x closer to the reference: the same parallel error is now far beyond the bound
    quiet = _scaled_noise(ref, noise, 1e-3)
    result, _ = check_logits("decode", ref, par, quiet, NOISE_ONLY)
    assert result.verdict is Verdict.FAIL, result.reason
    # and a tighter factor on the original noise run lands in the WARN band or beyond
    tight, _ = check_logits("decode", ref, par, noise, LogitsSettings(kl_floor=0.0, abs_floor=0.0,
                                                                      kl_factor=0.5, abs_factor=0.5))
    assert tight.verdict in (Verdict.WARN, Verdict.FAIL)
    # without any noise run the floors decide: tiny floors fail, default floors pass
    assert check_logits("decode", ref, par, None, NOISE_ONLY)[0].verdict is Verdict.FAIL
    assert check_logits("decode", ref, par, None, LogitsSettings())[0].verdict is Verdict.PASS


def test_the_kl_bound_grows_with_the_square_of_the_logit_error(runs) -> None:
    """KL is quadratic in the logit error: a difference shaped as the noise run's and 3x its size has 3x its max abs
    error and ~9x its KL, which the default KL factor (25 = 5^2) passes and a KL factor equal to the max abs one (10)
    came close to flagging; at 4x (KL ~16x) that factor flags it, the default does not; at 30x the error WARNs and
    the KL (~900x) FAILs."""
    ref, noise, _ = runs
    linear = LogitsSettings(kl_floor=0.0, abs_floor=0.0, kl_factor=10)
    for scale in (3.0, 4.0):
        result, _ = check_logits("decode", ref, _scaled_noise(ref, noise, scale), noise, NOISE_ONLY)
        assert result.verdict is Verdict.PASS, result.reason
        ratio = result.metrics["max_kl"] / result.metrics["kl_bound"]["noise"]
        assert 0.7 * scale ** 2 < ratio < 1.3 * scale ** 2
    four = check_logits("decode", ref, _scaled_noise(ref, noise, 4.0), noise, linear)[0]
    assert four.verdict is Verdict.WARN and "max abs" in four.reason and "(noise" in four.reason
    thirty, _ = check_logits("decode", ref, _scaled_noise(ref, noise, 30.0), noise, NOISE_ONLY)
    assert thirty.verdict is Verdict.FAIL
    assert thirty.metrics["max_kl"] > thirty.metrics["kl_bound"]["fail_limit"]
    assert thirty.metrics["max_abs"] <= thirty.metrics["abs_bound"]["fail_limit"]


def test_warn_band_between_bound_and_fail_ratio(runs) -> None:
    ref, noise, par = runs
    base = ref.tensors["prefill_logits.0"]
    nudged = with_tensors(ref, prefill_logits_0=base.clone())
    settings = LogitsSettings(kl_floor=1.0, abs_floor=1e-3)
    nudged.tensors["prefill_logits.0"][3, 5] += 3e-3  # 3x the abs floor, < fail_ratio x
    result, _ = check_logits("prefill", ref, nudged, None, settings)
    assert result.verdict is Verdict.WARN, result.reason
    assert "max abs 3.0e-03 > 1.0e-03 (floor; no noise run)" in result.reason


def test_real_corruption_fails_with_key_numbers(runs) -> None:
    ref, noise, par = runs
    g = torch.Generator().manual_seed(7)
    bad = with_tensors(par, decode_logits_1=par.tensors["decode_logits.1"] +
                       torch.randn(par.tensors["decode_logits.1"].shape, generator=g, dtype=torch.float64))
    result, prompts = check_logits("decode", ref, bad, noise, LogitsSettings())
    assert result.verdict is Verdict.FAIL
    assert result.reason.startswith("decode: max KL ") and "top-1 agreement" in result.reason
    assert prompts[0]["first_diverging_position"] is None
    assert prompts[1]["first_diverging_position"] == ref.cases[1].decode_start  # absolute sequence position
    assert result.metrics["first_divergence"] == {"prompt": 1, "position": ref.cases[1].decode_start}
    # prefill is untouched
    assert check_logits("prefill", ref, bad, noise, LogitsSettings())[0].verdict is Verdict.PASS


def _two_way(gap: float, flip: bool) -> torch.Tensor:
    row = torch.full((1, 16), -4.0, dtype=torch.float64)
    row[0, 3], row[0, 9] = (5.0 - gap, 5.0) if flip else (5.0, 5.0 - gap)
    return row


def test_near_tie_flip_is_benign_and_large_gap_flip_fails() -> None:
    metrics = position_metrics(_two_way(1e-5, False), _two_way(1e-5, True), k=2)
    assert not bool(metrics.top1_match[0]) and float(metrics.flip_gap[0]) == pytest.approx(1e-5)
    ref, _, _ = synthetic_runs(plan_layout(GQA, 2), n_cases=1)
    near_ref = with_tensors(ref, prefill_logits_0=_two_way(1e-5, False))
    near_par = with_tensors(ref, prefill_logits_0=_two_way(1e-5, True))
    benign, prompts = check_logits("prefill", near_ref, near_par, None, LogitsSettings())
    assert benign.verdict is Verdict.PASS, benign.reason
    assert prompts[0]["top1_flips"] == 1 and prompts[0]["benign_flips"] == 1
    assert "near ties (benign)" in benign.reason
    far_ref = with_tensors(ref, prefill_logits_0=_two_way(2.0, False))
    far_par = with_tensors(ref, prefill_logits_0=_two_way(2.0, True))
    flagged, _ = check_logits("prefill", far_ref, far_par, None, LogitsSettings())
    assert flagged.verdict is Verdict.FAIL
    assert "1 top-1 flip(s) outside near ties" in flagged.reason
    assert flagged.metrics["top1_agreement"] == 0.0


@pytest.mark.parametrize("value, word", [(float("nan"), "1 NaN and 0 Inf"), (float("inf"), "0 NaN and 1 Inf")])
def test_nonfinite_logits_fail_without_raising(runs, value: float, word: str) -> None:
    ref, noise, par = runs
    poisoned = par.tensors["decode_logits.0"].clone()
    poisoned[2, 7] = value
    result, prompts = check_logits("decode", ref, with_tensors(par, decode_logits_0=poisoned), noise,
                                   LogitsSettings())
    assert result.verdict is Verdict.FAIL
    position = ref.cases[0].decode_start + 2
    assert result.reason.startswith(f"decode: prompt 0: parallel logits contain {word} values "
                                    f"(first at position {position}: {value} at token 7); max KL ")
    assert prompts[0]["problem"] and prompts[1]["problem"] is None
    json.dumps([result.to_dict(), prompts], allow_nan=False)
    # in the reference too
    assert check_logits("decode", with_tensors(ref, decode_logits_0=poisoned), par, noise,
                        LogitsSettings())[0].verdict is Verdict.FAIL


def test_missing_tensor_is_error_and_shape_mismatch_fails(runs) -> None:
    ref, noise, par = runs
    missing = with_tensors(par)
    del missing.tensors["decode_logits.1"]
    assert check_logits("decode", ref, missing, noise, LogitsSettings())[0].verdict is Verdict.ERROR
    short = with_tensors(par, decode_logits_1=par.tensors["decode_logits.1"][:-1])
    result, _ = check_logits("decode", ref, short, noise, LogitsSettings())
    assert result.verdict is Verdict.FAIL and "shape [3, 32] != reference [4, 32]" in result.reason


def test_unusable_noise_run_falls_back_to_floors(runs) -> None:
    ref, noise, par = runs
    broken = with_tensors(noise)
    del broken.tensors["prefill_logits.0"]
    result, _ = check_logits("prefill", ref, par, broken, LogitsSettings())
    assert result.verdict is Verdict.PASS
    assert "noise run unusable" in result.reason and result.metrics["kl_bound"]["noise"] is None


def test_topk_overlap_below_bound_warns() -> None:
    ref_logits = torch.arange(16, dtype=torch.float64)[None, :].repeat(3, 1)  # [3, 16], clear ranking
    par_logits = ref_logits.clone()
    par_logits[:, 11] = -1.0  # token 11 leaves the top-5; the top-1 (15) stays
    ref, _, _ = synthetic_runs(plan_layout(GQA, 2), n_cases=1)
    a, b = with_tensors(ref, prefill_logits_0=ref_logits), with_tensors(ref, prefill_logits_0=par_logits)
    result, _ = check_logits("prefill", a, b, None, LogitsSettings(abs_floor=100.0, kl_floor=100.0, topk_warn=0.9))
    assert result.verdict is Verdict.WARN and "top-5 overlap 0.80 < 0.90" in result.reason


def _tied_rows(n: int, flip_rows: int) -> torch.Tensor:
    """[n, 16] logits with a 1e-5 top-2 tie on every row; the first `flip_rows` rows flipped."""
    return torch.cat([_two_way(1e-5, r < flip_rows) for r in range(n)])


def test_systematic_near_tie_flips_fail_and_noise_run_flips_raise_the_limit() -> None:
    ref, _, _ = synthetic_runs(plan_layout(GQA, 2), n_cases=1)
    n = 64
    tied = with_tensors(ref, prefill_logits_0=_tied_rows(n, 0))
    settings = LogitsSettings()
    # positive control: every position flips, each at a near tie, against a noise run that flips none:
    # far above the noise run's rate (even with its prior pseudo-flip) -> FAIL
    quiet = with_tensors(ref, prefill_logits_0=_tied_rows(n, 0))
    many = with_tensors(ref, prefill_logits_0=_tied_rows(n, 40))
    result, _ = check_logits("prefill", tied, many, quiet, settings)
    assert result.verdict is Verdict.FAIL, result.reason
    assert "40 top-1 flips at near ties in 64 steps against 0 in 64 of the noise run (+1 prior)" in result.reason
    assert result.metrics["tie_flip_p_value"] < settings.tie_flips_alpha
    assert result.metrics["tie_flip_limit"] == 12  # (k + 2) / 2^(k + 1) < 1e-3 first at k = 13
    # a noise run with 0 flips does not make a few flips significant (the prior and the floor)
    few = with_tensors(ref, prefill_logits_0=_tied_rows(n, 8))
    assert check_logits("prefill", tied, few, quiet, settings)[0].verdict is Verdict.PASS
    # negative control: a count within the noise run's rate passes, however many steps
    noisy = with_tensors(ref, prefill_logits_0=_tied_rows(n, 30))
    allowed, _ = check_logits("prefill", tied, many, noisy, settings)
    assert allowed.verdict is Verdict.PASS, allowed.reason
    assert allowed.metrics["noise_flips"] == 30 and allowed.metrics["tie_flip_limit"] >= 40
    assert "systematic" not in allowed.reason and "at near ties (benign)" in allowed.reason


def test_metrics_are_reported_as_multiples_of_the_noise(runs) -> None:
    ref, noise, par = runs
    result, _ = check_logits("decode", ref, par, noise, NOISE_ONLY)
    multiple = result.metrics["abs_noise_multiple"]
    assert multiple == pytest.approx(result.metrics["max_abs"] / result.metrics["abs_bound"]["noise"])
    assert f"({times_text(multiple)} noise)" in result.reason
