"""Noise-scaled bounds and the one rule that grades a metric against them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness.core.fmt import multiple as times_text
from harness.core.verdict import Verdict


@dataclass(frozen=True)
class Bound:
    """A tolerance: PASS at or below `limit` = max(floor, factor x noise), WARN up to
    `fail_ratio` x limit, FAIL beyond (and on NaN). `noise` is None without a noise run."""

    floor: float
    factor: float
    noise: float | None
    fail_ratio: float = 1.0
    no_noise: str = "no noise run"  # why `noise` is None, as describe() says it

    @property
    def limit(self) -> float:
        if self.noise is None or not math.isfinite(self.noise):
            return self.floor
        return max(self.floor, self.factor * self.noise)

    @property
    def fail_limit(self) -> float:
        return self.limit * self.fail_ratio

    def grade(self, value: float) -> Verdict:
        if math.isnan(value) or value > self.fail_limit:
            return Verdict.FAIL
        return Verdict.PASS if value <= self.limit else Verdict.WARN

    def noise_multiple(self, value: float) -> float | None:
        """`value` as a multiple of the measured noise (None without a noise run or with zero noise)."""
        if self.noise is None or not math.isfinite(self.noise) or self.noise <= 0:
            return None
        return json_float(value / self.noise)

    def describe(self) -> str:
        """Where the bound comes from, e.g. '(noise 4.0e-08 x 50)', '(floor; no noise run)' or, for a
        non-finite noise, '(floor; noise inf unusable)'."""
        if self.noise is None:
            return f"(floor; {self.no_noise})"
        if not math.isfinite(self.noise):
            return f"(floor; noise {self.noise} unusable)"
        if self.factor * self.noise > self.floor:
            return f"(noise {self.noise:.1e} x {self.factor:g})"
        return f"(floor; noise {self.noise:.1e})"

    def compare(self, label: str, value: float) -> str:
        """'max KL 3.1e-01 (7.8e6x noise) > 2.0e-06 (noise 4.0e-08 x 50)'."""
        op = "<=" if value <= self.limit else ">"
        multiple = self.noise_multiple(value)
        times = f" ({times_text(multiple)} noise)" if multiple is not None else ""
        return f"{label} {value:.1e}{times} {op} {self.limit:.1e} {self.describe()}"

    def to_dict(self) -> dict[str, float | None]:
        return {"limit": self.limit, "fail_limit": self.fail_limit, "floor": self.floor,
                "factor": self.factor, "noise": json_float(self.noise) if self.noise is not None else None}


def json_float(value: float) -> float | None:
    """A float for JSON: non-finite values (NaN, +-Inf) become None."""
    value = float(value)
    return value if math.isfinite(value) else None


# Unit roundoff u (half the machine epsilon) of each dtype a run computes in.
UNIT_ROUNDOFF: dict[str, float] = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11,
                                   "bfloat16": 2.0 ** -8}
# A noise run differs from its reference only by rounding (another reduction order, a precision twin or
# a rescheduled repeat), so its max abs logit difference stays within a modest multiple of u x the
# logits' magnitude: the shipped tiny models measure ~13 u x max|logit| in float32, float16 and bfloat16
# alike. 2^10 of them (~80x that) cannot be rounding: the noise run (or the reference) is broken, and a
# bound scaled from it would excuse anything. For KL, Hoeffding's lemma gives KL(p||q) <= max|dlogit|^2 / 2.
NOISE_PLAUSIBLE_ROUNDOFFS = 2.0 ** 10


@dataclass(frozen=True)
class NoiseLimit:
    """The largest noise rounding in `dtype` explains for logits of magnitude `magnitude`."""

    dtype: str
    magnitude: float  # max |logit| of the reference

    @property
    def abs_limit(self) -> float:
        return NOISE_PLAUSIBLE_ROUNDOFFS * UNIT_ROUNDOFF[self.dtype] * max(self.magnitude, 1.0)

    @property
    def kl_limit(self) -> float:
        return 0.5 * self.abs_limit ** 2

    def problem(self, max_abs: float, max_kl: float) -> str | None:
        """'max abs 5.2e+00 > 1.2e-03 (2^10 u x max |logit| 18.8) for float32', or None when plausible."""
        why = f"(2^10 u x max |logit| {max(self.magnitude, 1.0):.1f}) for {self.dtype}"
        if not math.isfinite(max_abs) or max_abs > self.abs_limit:
            return f"max abs {max_abs:.1e} > {self.abs_limit:.1e} {why}"
        if not math.isfinite(max_kl) or max_kl > self.kl_limit:
            return f"max KL {max_kl:.1e} > {self.kl_limit:.1e} (half the square of the max abs limit {why})"
        return None


def noise_limit(dtype: str | None, magnitude: float) -> NoiseLimit | None:
    """The plausibility limit of a noise run in `dtype`, or None for a dtype without a known unit roundoff."""
    return NoiseLimit(dtype, magnitude) if dtype in UNIT_ROUNDOFF else None


# Without a noise measurement (no noise run, or one that measures zero: a deterministic engine's twin) the floors
# are what rounding in the dtype does to a topology's changed reduction order: the shipped tiny models' noise runs
# measure ~13 u x max |logit| (above), and each doubling of the ranks a sum is split over (the TP all-reduce, the
# DCP log-sum-exp merge) adds one more level of partial sums. So a bfloat16 or float16 cell is never held to a
# float32-like floor only because its noise run measured nothing.
REDUCTION_FLOOR_ROUNDOFFS = 16.0


@dataclass(frozen=True)
class ReductionFloor:
    """The largest logits difference rounding in `dtype` explains when a sum over `ranks` ranks is reordered."""

    dtype: str
    magnitude: float  # max |logit| of the reference
    ranks: int        # tp x dcp of the compared topology (1: a rescheduled repeat)

    @property
    def abs_limit(self) -> float:
        levels = 1.0 + math.log2(max(self.ranks, 1))
        return REDUCTION_FLOOR_ROUNDOFFS * levels * UNIT_ROUNDOFF[self.dtype] * max(self.magnitude, 1.0)

    @property
    def kl_limit(self) -> float:
        return 0.5 * self.abs_limit ** 2  # Hoeffding's lemma: KL(p||q) <= max |dlogit|^2 / 2

    def describe(self) -> str:
        """'rounding in bfloat16 over 2 ranks (16 x 2 levels u x max |logit| 9.4)'."""
        levels = 1.0 + math.log2(max(self.ranks, 1))
        return (f"rounding in {self.dtype} over {self.ranks} rank{'s' if self.ranks != 1 else ''} "
                f"({REDUCTION_FLOOR_ROUNDOFFS:g} x {levels:g} levels u x max |logit| {max(self.magnitude, 1.0):.1f})")


def reduction_floor(dtype: str | None, magnitude: float, ranks: int) -> ReductionFloor | None:
    """The ReductionFloor of a cell, None for a dtype without a known unit roundoff."""
    return ReductionFloor(dtype, magnitude, ranks) if dtype in UNIT_ROUNDOFF else None
