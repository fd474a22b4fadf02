"""A check's key metric and its noise multiples, as history and sign-off store and compare them.

Key metric: the number `metrics["headline"]` names, else the first of KEY_METRICS that holds a
plain number (the report's matrix shows the same metric as text). Noise multiples: for every bound
`<p>_bound` carrying a measured `noise` > 0 (logits checks: kl_bound, abs_bound), the measured
`max_<p>` divided by that noise.
"""

from __future__ import annotations

import math
from typing import Any, Callable, TypeVar

from harness.core.verdict import CheckResult

T = TypeVar("T")
BOUND_SUFFIX = "_bound"
# the metrics a check's key number is looked for in, in this order (unless metrics["headline"] names one)
KEY_METRICS: tuple[str, ...] = (
    "max_kl", "kl_max", "kl", "first_divergence", "mean_acceptance", "mean_accepted_length", "acceptance", "score",
    "accuracy", "answer_agreement", "agreement", "mismatches", "max_abs", "max_abs_error", "problems",
)
# the checks that compare outputs with the reference (a failure of one of them wants a localization)
PARITY_CHECKS: tuple[str, ...] = ("logits_prefill", "logits_decode", "generation")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def find_key_metric(check: CheckResult, read: Callable[[Any], T | None]) -> tuple[str, T] | None:
    """(name, read(value)) of the first key metric that `read` accepts (returns non-None for)."""
    named = check.metrics.get("headline")
    for name in [named] if isinstance(named, str) else KEY_METRICS:
        value = read(check.metrics.get(name))
        if value is not None:
            return name, value
    return None


def key_metric(check: CheckResult) -> tuple[str, float] | None:
    """(name, value) of the check's key number, or None when it has no numeric one."""
    return find_key_metric(check, _number)


def noise_multiples(check: CheckResult) -> dict[str, float]:
    """{'max_kl': 0.54, 'max_abs': 0.95, ...}: each measured maximum as a multiple of its noise floor."""
    out: dict[str, float] = {}
    for name, bound in check.metrics.items():
        if not (name.endswith(BOUND_SUFFIX) and isinstance(bound, dict)):
            continue
        measured_name = "max_" + name[: -len(BOUND_SUFFIX)]
        noise, measured = _number(bound.get("noise")), _number(check.metrics.get(measured_name))
        if noise is not None and noise > 0 and measured is not None:
            out[measured_name] = measured / noise
    return out
