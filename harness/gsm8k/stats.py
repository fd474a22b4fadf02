"""Pure statistics for GSM8K: paired comparison with the reference, and the baseline gate.

All scores are fractions in 0..1 (0.880, not 88.0); sentences for people print points (x100).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Any, Sequence

from harness.core.errors import ConfigError, RunError
from harness.core.verdict import Verdict
from harness.gsm8k.records import STRICT, QuestionRecord

SIGMA_FLOOR = 0.05  # a measured score of 0 or 1 has Bernoulli sigma 0: never trust that much
DEFAULT_ALPHA = 0.05  # false-alarm rate of the gate (TensorRT-LLM's GSM8K default)
DEFAULT_BETA = 0.2  # miss rate at the minimum detectable drop theta
DEFAULT_DETECT_DROP = 0.05  # the drop a suite wants detected unless it says otherwise (5 points)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: binomial(b + c, 1/2) on the discordant pairs; 1 when b + c = 0."""
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be >= 0, got b={b}, c={c}")
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1))
    return min(1.0, 2.0 * tail / 2 ** n)


def agreement_rate(left: Sequence[str], right: Sequence[str]) -> float:
    """Fraction of positions where the two sequences hold equal strings (1.0 for empty input)."""
    if len(left) != len(right):
        raise ValueError(f"cannot compare {len(left)} items with {len(right)}")
    if not left:
        return 1.0
    return sum(a == b for a, b in zip(left, right, strict=True)) / len(left)


def _pair(ref: Sequence[QuestionRecord], par: Sequence[QuestionRecord]) -> list[tuple[QuestionRecord, QuestionRecord]]:
    ref_by = {r.index: r for r in ref}
    par_by = {r.index: r for r in par}
    if len(ref_by) != len(ref) or len(par_by) != len(par):
        raise RunError("GSM8K records hold a question index twice")
    if ref_by.keys() != par_by.keys():
        only_ref = sorted(ref_by.keys() - par_by.keys())[:10]
        only_par = sorted(par_by.keys() - ref_by.keys())[:10]
        raise RunError(f"reference and parallel runs scored different questions (only in reference: "
                       f"{only_ref}, only in parallel: {only_par}); run both with the same limit")
    pairs = [(ref_by[i], par_by[i]) for i in sorted(ref_by)]
    for r, p in pairs:
        if r.prompt_hash and p.prompt_hash and r.prompt_hash != p.prompt_hash:
            raise RunError(f"question {r.index}: reference and parallel prompts differ (few-shot context or chat "
                           f"template); both runs need the same task variant, num_fewshot and seed")
    return pairs


def paired_comparison(ref: Sequence[QuestionRecord], par: Sequence[QuestionRecord],
                      filter_name: str = STRICT) -> dict[str, Any]:
    """Per-question comparison of a parallel run with the reference on the same questions.

    b counts questions the reference got right and the parallel run wrong; c the reverse.
    flips lists every question whose correctness changed, with both extracted answers; disagreements
    every question whose extracted answers differ (flips included, and wrong -> another wrong answer).
    """
    pairs = _pair(ref, par)
    for r, p in pairs[:1]:
        if filter_name not in r.correct or filter_name not in p.correct:
            raise ConfigError(f"filter {filter_name!r} not in the records (have {', '.join(sorted(r.correct))})")
    n = len(pairs)
    b = sum(r.correct[filter_name] and not p.correct[filter_name] for r, p in pairs)
    c = sum(p.correct[filter_name] and not r.correct[filter_name] for r, p in pairs)
    flips = [{"index": r.index, "question": r.question, "target": r.target_answer,
              "ref_answer": r.answers[filter_name], "par_answer": p.answers[filter_name],
              "ref_correct": r.correct[filter_name], "par_correct": p.correct[filter_name]}
             for r, p in pairs if r.correct[filter_name] != p.correct[filter_name]]
    disagreements = [{"index": r.index, "question": r.question, "target": r.target_answer,
                      "ref_answer": r.answers[filter_name], "par_answer": p.answers[filter_name],
                      "ref_correct": r.correct[filter_name], "par_correct": p.correct[filter_name]}
                     for r, p in pairs if r.answers[filter_name] != p.answers[filter_name]
                     or r.correct[filter_name] != p.correct[filter_name]]
    return {"n": n, "filter": filter_name,
            "ref_score": sum(r.correct[filter_name] for r, _ in pairs) / n if n else 0.0,
            "par_score": sum(p.correct[filter_name] for _, p in pairs) / n if n else 0.0,
            "answer_agreement": agreement_rate([r.answers[filter_name] for r, _ in pairs],
                                               [p.answers[filter_name] for _, p in pairs]),
            "generation_agreement": agreement_rate([r.generation for r, _ in pairs],
                                                   [p.generation for _, p in pairs]),
            "b": b, "c": c, "p_value": mcnemar_exact(b, c), "flips": flips,
            "disagreements": disagreements}


def bernoulli_sigma(score: float, floor: float = SIGMA_FLOOR) -> float:
    """sqrt(p (1 - p)) of a 0..1 score, never below `floor`."""
    return max(math.sqrt(max(score * (1.0 - score), 0.0)), floor)


@dataclass(frozen=True)
class GateOutcome:
    """The baseline gate's verdict and every number behind it (0..1 scale)."""

    verdict: Verdict
    reason: str
    ref_score: float
    measured: float
    n: int
    alpha: float
    beta: float
    sigma: float
    sigma_source: str
    scale: float
    threshold: float
    theta: float
    detect_drop: float | None

    def metrics(self) -> dict[str, Any]:
        out = asdict(self)
        out["verdict"] = self.verdict.value
        out["min_detectable_drop"] = self.theta
        return out


def _points(x: float) -> str:
    return f"{100.0 * x:.1f}"


def gate_numbers(n: int, sigma: float, alpha: float, beta: float) -> tuple[float, float, float]:
    """(scale, z_alpha * scale, theta) of a one-sided two-sample test, as TensorRT-LLM's accuracy gate:
    scale = sqrt(2 sigma^2 / n); the threshold is ref + z(alpha) * scale (z(alpha) < 0);
    theta = (z(1 - alpha) + z(1 - beta)) * scale is the smallest drop detected with power 1 - beta."""
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    for name, value in (("alpha", alpha), ("beta", beta)):
        if not 0.0 < value < 1.0:
            raise ConfigError(f"{name}={value} must be strictly between 0 and 1")
    if sigma <= 0:
        raise ConfigError(f"sigma={sigma} must be > 0")
    normal = NormalDist()
    scale = math.sqrt(2.0 * sigma ** 2 / n)
    return scale, normal.inv_cdf(alpha) * scale, (normal.inv_cdf(1 - alpha) + normal.inv_cdf(1 - beta)) * scale


def baseline_gate(ref_score: float, measured: float, n: int, alpha: float = DEFAULT_ALPHA,
                  beta: float = DEFAULT_BETA, sigma: float | None = None, detect_drop: float | None = None,
                  sigma_floor: float = SIGMA_FLOOR) -> GateOutcome:
    """Gate a measured 0..1 score against its baseline with a one-sided test.

    FAIL when measured < ref + z(alpha) * scale. SKIP when the threshold is <= 0: no score in 0..1
    can fall below it, so the test can never reject (no power at all, e.g. a baseline of 0.000 on 3
    questions); its reason names the n that would detect `detect_drop` (DEFAULT_DETECT_DROP when unset)
    at this alpha and beta. A PASS becomes WARN when theta (the smallest drop this n detects with
    power 1 - beta) exceeds `detect_drop`, the drop the suite says it cares about.
    sigma defaults to the Bernoulli sigma of the measured score, floored at `sigma_floor`.
    """
    for name, value in (("baseline score", ref_score), ("measured score", measured)):
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"{name}={value} must be a fraction in 0..1")
    used_sigma = sigma if sigma is not None else bernoulli_sigma(measured, sigma_floor)
    scale, offset, theta = gate_numbers(n, used_sigma, alpha, beta)
    threshold = ref_score + offset
    where = (f"threshold {threshold:.3f} = baseline {ref_score:.3f} - {_points(-offset)} points "
             f"(n={n}, alpha={alpha}, sigma={used_sigma:.3f})")
    if threshold <= 0.0:
        drop = detect_drop if detect_drop is not None else DEFAULT_DETECT_DROP
        verdict = Verdict.SKIP
        reason = (f"no power: {where} is <= 0, so no score can fail it (measured {measured:.3f}); "
                  f"n >= {min_questions(used_sigma, drop, alpha, beta)} would detect a drop of {_points(drop)} "
                  f"points at alpha={alpha}, beta={beta}")
    elif measured < threshold:
        verdict = Verdict.FAIL
        reason = (f"score {measured:.3f} < {where}: a drop of {_points(ref_score - measured)} points, "
                  f"beyond noise")
    elif detect_drop is not None and theta > detect_drop:
        verdict = Verdict.WARN
        reason = (f"score {measured:.3f} >= {where}, but n={n} can only detect drops >= {_points(theta)} points; "
                  f"the suite asks for {_points(detect_drop)} (needs n >= "
                  f"{min_questions(used_sigma, detect_drop, alpha, beta)} at beta={beta})")
    else:
        verdict = Verdict.PASS
        reason = f"score {measured:.3f} >= {where}; detects drops >= {_points(theta)} points (beta={beta})"
    return GateOutcome(verdict=verdict, reason=reason, ref_score=ref_score, measured=measured, n=n, alpha=alpha,
                       beta=beta, sigma=used_sigma, sigma_source="given" if sigma is not None else "measured",
                       scale=scale, threshold=threshold, theta=theta, detect_drop=detect_drop)


def min_questions(sigma: float, detect_drop: float, alpha: float = DEFAULT_ALPHA,
                  beta: float = DEFAULT_BETA) -> int:
    """The smallest n whose gate detects a drop of `detect_drop` (theta <= detect_drop)."""
    if detect_drop <= 0:
        raise ConfigError(f"detect_drop={detect_drop} must be > 0")
    normal = NormalDist()
    z = normal.inv_cdf(1 - alpha) + normal.inv_cdf(1 - beta)
    return math.ceil(2.0 * (sigma * z / detect_drop) ** 2)
