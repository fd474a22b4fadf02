"""Paired statistics and the baseline gate against hand-computed values."""

from __future__ import annotations

import math

import pytest

from harness.core.errors import ConfigError, RunError
from harness.core.verdict import Verdict
from harness.gsm8k.records import FLEXIBLE, STRICT, QuestionRecord, final_answer
from harness.gsm8k.stats import (
    SIGMA_FLOOR,
    agreement_rate,
    baseline_gate,
    bernoulli_sigma,
    gate_numbers,
    mcnemar_exact,
    min_questions,
    paired_comparison,
)


@pytest.mark.parametrize(("b", "c", "p"), [
    (8, 2, 0.109375),          # 2 * (1 + 10 + 45) / 2**10
    (2, 8, 0.109375),          # symmetric
    (0, 0, 1.0),
    (5, 0, 0.0625),            # 2 / 2**5
    (10, 0, 0.001953125),      # 2 / 2**10
    (1, 1, 1.0),               # capped at 1
    (3, 3, 1.0),
    (6, 1, 0.125),             # 2 * (1 + 7) / 2**7
])
def test_mcnemar_exact(b: int, c: int, p: float) -> None:
    assert mcnemar_exact(b, c) == pytest.approx(p, abs=1e-12)


def test_mcnemar_rejects_negative_counts() -> None:
    with pytest.raises(ValueError):
        mcnemar_exact(-1, 2)


def test_agreement_rate() -> None:
    assert agreement_rate(["1", "2", "3", "4"], ["1", "2", "x", "4"]) == 0.75
    assert agreement_rate([], []) == 1.0
    with pytest.raises(ValueError):
        agreement_rate(["1"], [])


def _record(index: int, answer: str, correct: bool, generation: str | None = None,
            prompt_hash: str = "p") -> QuestionRecord:
    return QuestionRecord(index=index, question=f"question {index}", target=f"work\n#### {index}",
                          target_answer=str(index), generation=generation if generation is not None else answer,
                          answers={STRICT: answer, FLEXIBLE: answer}, correct={STRICT: correct, FLEXIBLE: correct},
                          prompt_hash=prompt_hash)


def test_paired_comparison_counts_by_hand() -> None:
    # 6 questions: 0,1 right in both; 2,3 ref right -> par wrong (b=2); 4 ref wrong -> par right (c=1);
    # 5 wrong in both with equal answers; generations equal only for 0, 1 and 5.
    ref = [_record(0, "0", True), _record(1, "1", True), _record(2, "2", True), _record(3, "3", True),
           _record(4, "9", False), _record(5, "7", False)]
    par = [_record(0, "0", True), _record(1, "1", True), _record(2, "5", False), _record(3, "6", False),
           _record(4, "4", True), _record(5, "7", False)]
    out = paired_comparison(ref, list(reversed(par)))  # order does not matter: paired by index
    assert out["n"] == 6 and out["b"] == 2 and out["c"] == 1
    assert out["ref_score"] == pytest.approx(4 / 6) and out["par_score"] == pytest.approx(3 / 6)
    assert out["answer_agreement"] == pytest.approx(3 / 6)
    assert out["generation_agreement"] == pytest.approx(3 / 6)
    assert out["p_value"] == pytest.approx(1.0)  # 2 * (1 + 3) / 8 capped
    assert [f["index"] for f in out["flips"]] == [2, 3, 4]
    assert out["flips"][0] == {"index": 2, "question": "question 2", "target": "2", "ref_answer": "2",
                               "par_answer": "5", "ref_correct": True, "par_correct": False}


def test_paired_comparison_needs_the_same_questions() -> None:
    with pytest.raises(RunError, match="different questions"):
        paired_comparison([_record(0, "0", True)], [_record(1, "1", True)])


def test_paired_comparison_needs_the_same_prompts() -> None:
    with pytest.raises(RunError, match="prompts differ"):
        paired_comparison([_record(0, "0", True, prompt_hash="a")], [_record(0, "0", True, prompt_hash="b")])


def test_paired_comparison_unknown_filter() -> None:
    with pytest.raises(ConfigError, match="filter 'maj@8'"):
        paired_comparison([_record(0, "0", True)], [_record(0, "0", True)], filter_name="maj@8")


def test_final_answer() -> None:
    assert final_answer("16 - 3 = 13\n#### 13") == "13"
    assert final_answer("42") == "42"


def test_gate_numbers_match_tensorrt_llm() -> None:
    # TensorRT-LLM GSM8K defaults: n=1319, sigma=50 points, alpha=0.05, beta=0.2 -> ref - 3.2, theta 4.8.
    scale, offset, theta = gate_numbers(1319, 0.5, 0.05, 0.2)
    assert scale == pytest.approx(math.sqrt(2 * 0.25 / 1319))
    assert offset == pytest.approx(-0.0320, abs=5e-5)
    assert theta == pytest.approx(0.0484, abs=5e-5)
    assert -offset == pytest.approx(1.6448536 * scale, rel=1e-6)
    assert theta == pytest.approx((1.6448536 + 0.8416212) * scale, rel=1e-6)


def test_bernoulli_sigma_and_floor() -> None:
    assert bernoulli_sigma(0.5) == 0.5
    assert bernoulli_sigma(0.9) == pytest.approx(0.3)
    assert bernoulli_sigma(0.0) == SIGMA_FLOOR
    assert bernoulli_sigma(1.0) == SIGMA_FLOOR


def test_gate_pass_full_test_set() -> None:
    out = baseline_gate(0.60, 0.58, 1319, sigma=0.5, detect_drop=0.05)
    assert out.verdict is Verdict.PASS
    assert out.threshold == pytest.approx(0.60 - 0.0320, abs=5e-5)
    assert out.sigma_source == "given"
    assert "detects drops >= 4.8 points" in out.reason


def test_gate_fail_beyond_theta() -> None:
    out = baseline_gate(0.98, 0.88, 1319, detect_drop=0.05)  # the SGLang DCP bug's drop
    assert out.verdict is Verdict.FAIL
    assert out.sigma == pytest.approx(math.sqrt(0.88 * 0.12))
    assert "drop of 10.0 points" in out.reason


def test_gate_warns_when_n_is_too_small() -> None:
    out = baseline_gate(0.60, 0.60, 50, sigma=0.5, detect_drop=0.05)
    assert out.verdict is Verdict.WARN
    assert out.theta == pytest.approx(0.2486, abs=5e-4)
    assert "n=50 can only detect drops >= 24.9 points" in out.reason
    assert "the suite asks for 5.0" in out.reason and "needs n >= 1237" in out.reason


def test_small_n_still_fails_a_clear_drop() -> None:
    assert baseline_gate(0.90, 0.10, 20, detect_drop=0.05).verdict is Verdict.FAIL


def test_gate_metrics_are_complete() -> None:
    metrics = baseline_gate(0.5, 0.5, 100).metrics()
    assert {"verdict", "reason", "ref_score", "measured", "n", "alpha", "beta", "sigma", "scale", "threshold",
            "theta", "min_detectable_drop", "detect_drop"} <= set(metrics)
    assert metrics["verdict"] == "PASS"


def test_min_questions() -> None:
    assert min_questions(0.5, 0.05) == 1237
    assert gate_numbers(1237, 0.5, 0.05, 0.2)[2] <= 0.05 < gate_numbers(1236, 0.5, 0.05, 0.2)[2]


@pytest.mark.parametrize("kwargs", [{"alpha": 0.0}, {"beta": 1.0}, {"sigma": 0.0}])
def test_gate_rejects_bad_parameters(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        baseline_gate(0.5, 0.5, 100, **kwargs)


def test_gate_rejects_percent_scale() -> None:
    with pytest.raises(ConfigError, match="0..1"):
        baseline_gate(88.0, 0.88, 100)


def test_gate_that_cannot_fail_is_a_skip_naming_the_n_it_needs() -> None:
    """'score 0.000 >= threshold -0.067' on 3 questions: no score in 0..1 is below the threshold."""
    out = baseline_gate(0.0, 0.0, 3, detect_drop=0.05)
    assert out.threshold <= 0 and out.verdict is Verdict.SKIP
    need = min_questions(out.sigma, 0.05, out.alpha, out.beta)
    assert "no power" in out.reason and f"n >= {need}" in out.reason and "alpha=0.05, beta=0.2" in out.reason
    assert baseline_gate(0.0, 0.0, 3).verdict is Verdict.SKIP  # without a detect_drop: the default 5 points
    assert baseline_gate(0.60, 0.60, 50, sigma=0.5, detect_drop=0.05).verdict is Verdict.WARN  # some power


def test_paired_comparison_lists_answer_disagreements() -> None:
    ref = [QuestionRecord(index=i, question=f"q{i}", target=a, target_answer=a, generation="g",
                          answers={STRICT: r}, correct={STRICT: r == a}) for i, (a, r) in enumerate(
                              [("1", "1"), ("2", "5"), ("3", "3")])]
    par = [QuestionRecord(index=i, question=f"q{i}", target=a, target_answer=a, generation="g",
                          answers={STRICT: r}, correct={STRICT: r == a}) for i, (a, r) in enumerate(
                              [("1", "1"), ("2", "6"), ("3", "4")])]
    out = paired_comparison(ref, par)
    assert [d["index"] for d in out["disagreements"]] == [1, 2] and [f["index"] for f in out["flips"]] == [2]
