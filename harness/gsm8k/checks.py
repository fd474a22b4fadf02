"""The paired GSM8K check of one cell against the reference topology, as a CheckResult."""

from __future__ import annotations

from typing import Any, Mapping

from harness.core.verdict import CheckResult, Verdict
from harness.gsm8k.settings import GSM8KSettings

PAIRED_CHECK = "gsm8k_paired"


def paired_check(comparison: Mapping[str, Any], settings: GSM8KSettings) -> CheckResult:
    """FAIL when the parallel run is significantly worse (exact McNemar p < alpha with b > c), or its
    extracted answers agree with the reference's on fewer than `min_answer_agreement` of the questions,
    or its greedy generations are identical on fewer than `min_generation_agreement` of them.

    `comparison` is `stats.paired_comparison`'s result; it becomes the check's metrics (flips included).
    """
    n, b, c, p = comparison["n"], comparison["b"], comparison["c"], comparison["p_value"]
    agree, gen_agree = comparison["answer_agreement"], comparison["generation_agreement"]
    numbers = (f"{comparison['filter']}: reference {comparison['ref_score']:.3f}, parallel "
               f"{comparison['par_score']:.3f} on n={n}; answers agree {agree:.1%}, generations agree "
               f"{gen_agree:.1%}; {b} right->wrong, {c} wrong->right, McNemar p={p:.3g}")
    if b > c and p < settings.alpha:
        return CheckResult(PAIRED_CHECK, Verdict.FAIL, f"parallel run significantly worse: {numbers}",
                           dict(comparison))
    if agree < settings.min_answer_agreement:
        return CheckResult(PAIRED_CHECK, Verdict.FAIL,
                           f"answers disagree with the reference beyond {settings.min_answer_agreement:.0%} "
                           f"agreement: {numbers}", dict(comparison))
    if gen_agree < settings.min_generation_agreement:
        return CheckResult(PAIRED_CHECK, Verdict.FAIL,
                           f"generations disagree with the reference beyond {settings.min_generation_agreement:.0%} "
                           f"agreement: {numbers}", dict(comparison))
    if b or c:
        return CheckResult(PAIRED_CHECK, Verdict.PASS, f"flips within noise: {numbers}", dict(comparison))
    return CheckResult(PAIRED_CHECK, Verdict.PASS, numbers, dict(comparison))
