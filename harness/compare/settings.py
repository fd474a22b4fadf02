"""Tolerances of the parity checks: one frozen dataclass per check, parsed from a suite.

Every tolerance default lives here, once. A suite sets them under `checks.<name>`, either flat
(applies to every dtype) or per dtype, the dtype entry overriding the flat keys:

    checks:
      logits: {kl_factor: 100, float32: {kl_floor: 1.0e-8}, bfloat16: {kl_floor: 1.0e-3}}

Noise-scaled bounds: a metric passes at or below max(floor, factor * noise), where noise is the
same metric measured between the reference run and the noise run (the reference topology in the
same dtype with another reduction order, see runner.noise_run). Between that bound and fail_ratio
times it the check WARNs; beyond it FAILs (see bounds.Bound): with the defaults a max abs error FAILs at
50x the measured noise, and KL, quadratic in the logit error, at 125x (25x for PASS: 5 squared).
Floors sit near the dtype's machine precision (DTYPE_DEFAULTS), so they only matter when the noise run
measures (almost) nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, TypeVar

from harness.core.errors import ConfigError
from harness.specs.loader import build, did_you_mean
from harness.specs.model import DTYPES

T = TypeVar("T")

# dtypes a settings section may name: the model dtypes, and float64 (the noise recompute).
SETTINGS_DTYPES: tuple[str, ...] = (*DTYPES, "float64")


def _coerce_fields(obj: Any) -> None:
    """Type-check fields after YAML loading; '1e-8' (a YAML 1.1 string) becomes a float.
    Errors start with the class name, which _build replaces by where the keys came from."""
    where = type(obj).__name__
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.type in ("float", float):
            if isinstance(value, str):
                try:
                    value = float(value)
                except ValueError:
                    raise ConfigError(f"{where}: {f.name} must be a number, got {value!r}") from None
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{where}: {f.name} must be a number, got {value!r}")
            if value != value or value < 0:
                raise ConfigError(f"{where}: {f.name}={value} must be a non-negative number")
            object.__setattr__(obj, f.name, float(value))
        elif f.type in ("int", int):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{where}: {f.name} must be a positive integer, got {value!r}")
        elif f.type in ("bool", bool) and not isinstance(value, bool):
            raise ConfigError(f"{where}: {f.name} must be true or false, got {value!r}")


def _check_alpha(obj: Any, name: str) -> None:
    value = getattr(obj, name)
    if not 0 < value < 1:
        raise ConfigError(f"{type(obj).__name__}: {name}={value} must be within (0, 1)")


@dataclass(frozen=True)
class LayoutSettings:
    """Layout invariants have no tolerance; these switch optional parts off."""

    check_pool: bool = True        # KV pool bytes/blocks per rank as the planner sizes them
    check_checksums: bool = True   # K/V weight checksums identical on every rank holding a KV head, and every
    #                                checkpoint tensor a rank holds as the plan slices it (compare/layout/params.py)
    # sparse attention: a selected token set may differ from the reference's only where the reference's
    # indexer scores were a near tie (relative margin of its last selected over its first unselected token)
    # below max(selection_tie, selection_tie_factor x the largest such margin the noise run flipped at)
    selection_tie: float = 1e-6
    selection_tie_factor: float = 4.0

    def __post_init__(self) -> None:
        _coerce_fields(self)


@dataclass(frozen=True)
class LogitsSettings:
    """Teacher-forced logits parity (prefill and decode paths)."""

    kl_floor: float = 1e-10        # nats: smallest per-position KL(ref||par) bound (float32; DTYPE_DEFAULTS)
    kl_factor: float = 25.0        # x the noise run's max KL: 5 squared (KL is quadratic in the logit error; clean
    #                                cells reach ~5x the noise run's logit error, docs/tolerances.md#bounds)
    abs_floor: float = 5e-5        # smallest per-logit max abs error bound (float32; DTYPE_DEFAULTS)
    abs_factor: float = 10.0       # x the noise run's max abs error
    fail_ratio: float = 5.0        # WARN between bound and fail_ratio x bound, FAIL beyond
    topk: int = 5                  # k of the top-k overlap
    topk_warn: float = 0.8         # mean top-k overlap below this WARNs (never FAILs on its own)
    top1_tie_floor: float = 1e-4   # a top-1 flip is benign where the reference logprob gap between
    #                                the two tokens is <= max(this, 2 x the max-abs FAIL bound)
    tie_flips_floor: int = 2       # near-tie flips are benign only while as rare as the noise run's
    #                                (compare/parity/tie_flips.py): never FAIL at or below this many,
    tie_flips_alpha: float = 1e-3  # FAIL where the one-sided p-value of the count under the noise run's
    #                                flip rate is below this (the false-positive level per check),
    tie_flips_prior: int = 1       # the noise run's flips counted with this many pseudo-flips added

    def __post_init__(self) -> None:
        _coerce_fields(self)
        if self.fail_ratio < 1:
            raise ConfigError(f"LogitsSettings: fail_ratio={self.fail_ratio} must be >= 1")
        if self.topk_warn > 1:
            raise ConfigError(f"LogitsSettings: topk_warn={self.topk_warn} must be within [0, 1]")
        if not 0 < self.tie_flips_alpha < 1:
            raise ConfigError(f"LogitsSettings: tie_flips_alpha={self.tie_flips_alpha} must be within (0, 1)")


@dataclass(frozen=True)
class GenerationSettings:
    """Greedy generation agreement."""

    near_tie: float = 1e-3         # logprob gap below which a reference step is a near tie
    near_tie_factor: float = 5.0   # x the noise run's top-2 gap error (bound = max of the two)
    context_tokens: int = 4        # tokens of text shown on each side of the first divergence
    jumps_alpha: float = 1e-3      # divergences outside near ties FAIL unless as frequent as the rounding-only
    #                                comparisons' (compare/parity/jumps.py): at p < this

    def __post_init__(self) -> None:
        _coerce_fields(self)
        _check_alpha(self, "jumps_alpha")


@dataclass(frozen=True)
class LocalizationSettings:
    """First diverging layer and heads: relative L2 error of hidden states and attention outputs."""

    rel_floor: float = 1e-6        # smallest relative-error bound (layer and head; float32, DTYPE_DEFAULTS)
    factor: float = 20.0           # x the noise run's relative error at the same layer
    onset_factor: float = 5.0      # a divergence began at the earliest layer of the run of layers, ending at
    #                                the first one over its bound, each above this x its own noise

    def __post_init__(self) -> None:
        _coerce_fields(self)


@dataclass(frozen=True)
class CollectiveSettings:
    """Each collective's output against an exact float64 recompute from its own inputs (suite
    `checks.collectives`), in unit roundoffs u of the model dtype (contract.COLLECTIVES). These bounds
    come from rounding analysis, not from a noise run, so a collective done in a lower precision than
    the model's (or reading wrong inputs) is a FAIL even where the logits stay near their noise."""

    allreduce_factor: float = 1.0  # per element: this x tp x u x the sum of the partials' |values|; a
    #                                correct all-reduce of tp partials rounds at most tp - 1 times, any order
    dcp_factor: float = 16.0       # DCP Q gather and LSE merge, normwise: this x tp x u x |exact output|

    def __post_init__(self) -> None:
        _coerce_fields(self)

    def bound(self, site: str, tp: int) -> float:
        """How many unit roundoffs a correct `site` (contract.COLLECTIVE_SITES) may be off by."""
        return (self.allreduce_factor if site.endswith("allreduce") else self.dcp_factor) * max(1, tp)


@dataclass(frozen=True)
class LosslessSettings:
    """Speculative vs plain greedy output of one run (suite `checks.lossless`)."""

    near_tie: float = 1e-3          # benign divergence: plain logprob gap to the speculative token <= this
    near_tie_factor: float = 5.0    # x the noise run's top-2 gap error (bound = max of the two)
    jumps_alpha: float = 1e-3       # divergences outside near ties FAIL unless as frequent as the rounding-only
    #                                 comparisons' (compare/parity/jumps.py): at p < this

    def __post_init__(self) -> None:
        _coerce_fields(self)
        _check_alpha(self, "jumps_alpha")


@dataclass(frozen=True)
class AcceptanceSettings:
    """Acceptance against the reference topology with the same speculator (suite `checks.acceptance`)."""

    abs_floor: float = 0.05         # tokens: a mean accepted length drop at or below this passes
    rel_floor: float = 0.03         # x the reference's mean accepted length (the larger floor applies)
    trace_fail_fraction: float = 0.25  # FAIL when more prompts than this fraction have a different trace
    tv_warn: float = 0.1            # WARN above this total-variation distance of the histograms
    # against the stored baseline (baselines/acceptance.yaml), either way: FAIL when
    # |mean accepted length - baseline| > max(baseline_abs_tol, baseline_rel_tol x baseline)
    baseline_abs_tol: float = 0.05  # tokens
    baseline_rel_tol: float = 0.03  # x the baseline's mean accepted length
    # acceptance_per_position: each draft position's rate against the baseline's (else reference_floor x the
    # reference run's) by GSM8K's one-sided test at this false-alarm rate
    position_alpha: float = 0.05
    reference_floor: float = 0.95   # TensorRT-LLM's acceptance floor: 0.95 x the reference

    def __post_init__(self) -> None:
        _coerce_fields(self)
        if not 0 < self.position_alpha < 1:
            raise ConfigError(f"{type(self).__name__}: position_alpha={self.position_alpha} must be within (0, 1)")
        for name in ("trace_fail_fraction", "tv_warn", "reference_floor"):
            if getattr(self, name) > 1:
                raise ConfigError(f"{type(self).__name__}: {name}={getattr(self, name)} must be within [0, 1]")

    def floor(self, reference_mean: float) -> float:
        return max(self.abs_floor, self.rel_floor * reference_mean)

    def baseline_tolerance(self, baseline_mean: float) -> float:
        return max(self.baseline_abs_tol, self.baseline_rel_tol * baseline_mean)


# Floors per dtype, a few times what a correct float32 tp/dcp run of the tiny models measures (KL
# ~1e-11, max abs ~1.5e-5), scaled by the unit roundoff for the half types (float32 6e-8, float16
# 4.9e-4, bfloat16 3.9e-3) for logits of magnitude ~1-10. They decide only without a usable noise
# run (or when it measures almost nothing). A suite's own keys override them.
DTYPE_DEFAULTS: dict[str, dict[str, dict[str, float]]] = {
    "LogitsSettings": {
        "float64": {"kl_floor": 1e-24, "abs_floor": 1e-12},
        "float32": {"kl_floor": 1e-10, "abs_floor": 5e-5},
        "float16": {"kl_floor": 1e-6, "abs_floor": 2e-2},
        "bfloat16": {"kl_floor": 1e-4, "abs_floor": 1.5e-1},
    },
    "LocalizationSettings": {
        "float64": {"rel_floor": 1e-13},
        "float32": {"rel_floor": 1e-6},
        "float16": {"rel_floor": 1e-3},
        "bfloat16": {"rel_floor": 1e-2},
    },
}


@dataclass(frozen=True)
class ScheduleSettings:
    """A run against itself under another schedule (batch_invariance, prefix_cache, chunked_prefill,
    preemption; suite `checks.schedule`): greedy tokens equal except at near ties of the plain batch, and
    along the common tokens the top-1 logprob within max(logprob_floor, logprob_factor x the noise: the
    same difference in the reference run and between the reference and the noise run)."""

    near_tie: float = 1e-3         # logprob gap of the plain batch below which a divergence is benign
    near_tie_factor: float = 5.0   # x the noise's top-2 gap error (bound = max of the two)
    logprob_floor: float = 1e-4    # smallest bound on the top-1 logprob difference
    logprob_factor: float = 20.0   # x the measured noise of that difference
    jumps_alpha: float = 1e-3      # divergences outside near ties FAIL unless as frequent as the rounding-only
    #                                comparisons' (compare/parity/jumps.py): at p < this

    def __post_init__(self) -> None:
        _coerce_fields(self)
        _check_alpha(self, "jumps_alpha")


@dataclass(frozen=True)
class ConsistencySettings:
    """decode_consistency (suite `checks.decode_consistency`): each generated step's decode-time top-k
    against a re-prefill of prompt + generated tokens of the same run: the same top-1 token except at
    near ties of the re-prefill, its logprob within max(logprob_floor, logprob_factor x the same
    difference in the reference and noise runs)."""

    near_tie: float = 1e-3
    near_tie_factor: float = 5.0
    logprob_floor: float = 1e-4
    logprob_factor: float = 20.0
    jumps_alpha: float = 1e-3      # divergences outside near ties FAIL unless as frequent as the rounding-only
    #                                comparisons' (compare/parity/jumps.py): at p < this

    def __post_init__(self) -> None:
        _coerce_fields(self)
        _check_alpha(self, "jumps_alpha")


@dataclass(frozen=True)
class SamplingSettings:
    """The sampling checks (suite `checks.sampling`), docs/checks.md#sampling: a draw outside the reference's
    processed support FAILs unless the token is a near tie at the cut-off (its status flips when its logit moves by
    the slack: max(slack_floor, slack_factor x the noise run's largest logit difference at that position)); each
    position's draws are tested against the reference's processed distribution (chi-square over the tokens whose
    membership is certain, bins of expected count below min_expected pooled), and the cell FAILs when the smallest
    p-value is below alpha / (the number of tests): a false-positive rate of at most alpha per cell."""

    alpha: float = 1e-3
    slack_floor: float = 1e-4
    slack_factor: float = 10.0
    min_expected: float = 20.0  # Pearson's tail near its nominal rate at small p (benchmarks/bench_sampling_power.py)

    def __post_init__(self) -> None:
        _coerce_fields(self)
        _check_alpha(self, "alpha")
        if self.slack_floor < 0 or self.slack_factor < 0 or self.min_expected <= 0:
            raise ConfigError(f"SamplingSettings: slack_floor={self.slack_floor} and slack_factor="
                              f"{self.slack_factor} must be >= 0, min_expected={self.min_expected} > 0")


@dataclass(frozen=True)
class SelfConsistencySettings:
    """self_consistency (suite `checks.self_consistency`): the copies of one prompt sent in one run under
    other schedules (first batch, reused slots in another order, alone, the one-batch twin) hold the first
    copy's greedy tokens except at its near ties, and its top-1 logprob along the common tokens, within
    max(floor, factor x the noise: the reference's generations against its noise run's, never the
    reference's own copies, which a shared bug would move as much)."""

    near_tie: float = 1e-3         # logprob gap of the first copy below which a divergence is benign
    near_tie_factor: float = 5.0   # x the noise's top-2 gap error (bound = max of the two)
    logprob_floor: float = 1e-4    # smallest bound on the top-1 logprob difference along the common tokens
    logprob_factor: float = 20.0   # x the noise of that difference
    jumps_alpha: float = 1e-3      # divergences outside near ties FAIL unless as frequent as the rounding-only
    #                                comparisons' (compare/parity/jumps.py): at p < this

    def __post_init__(self) -> None:
        _coerce_fields(self)
        _check_alpha(self, "jumps_alpha")


@dataclass(frozen=True)
class SpeculativeOutputSettings(ConsistencySettings):
    """speculative_logprobs (suite `checks.speculative_output`): what a speculative server returns, per
    generated step, against the plain server of the same setting (tokens equal but at near ties of the
    plain run, top-1 logprob within the bound) and against its own re-prefill of prompt + those tokens;
    the bounds as decode_consistency's, the noise the same comparisons in the reference run."""


def parse_section(cls: type[T], where: str, raw: Mapping[str, Any] | None, dtype: str) -> T:
    """Build `cls` from the dtype defaults (DTYPE_DEFAULTS), the flat keys, then the `dtype`
    sub-mapping; every dtype section is validated (unknown keys rejected with "did you mean") even
    when it is not the one used."""
    raw = raw or {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {raw!r}")
    flat = {k: v for k, v in raw.items() if not isinstance(v, Mapping)}
    sections = {k: v for k, v in raw.items() if isinstance(v, Mapping)}
    for name, section in sections.items():
        if name not in SETTINGS_DTYPES:
            raise ConfigError(f"{where}: {name!r} is not a dtype section{did_you_mean(str(name), SETTINGS_DTYPES)}"
                              f" (a mapping value must be keyed by a dtype: {', '.join(SETTINGS_DTYPES)})")
        _build(cls, f"{where}.{name}", {**flat, **section})
    defaults = DTYPE_DEFAULTS.get(cls.__name__, {}).get(dtype, {})
    return _build(cls, where, {**defaults, **flat, **sections.get(dtype, {})})


def _build(cls: type[T], where: str, data: Mapping[str, Any]) -> T:
    """loader.build, with value errors from __post_init__ also naming where the keys came from."""
    try:
        return build(cls, where, data)
    except ConfigError as exc:
        message = str(exc)
        if message.startswith(where):
            raise
        own = f"{cls.__name__}: "
        raise ConfigError(f"{where}: {message[len(own):] if message.startswith(own) else message}") from exc
