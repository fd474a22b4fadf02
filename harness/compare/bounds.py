"""Noise-scaled bounds and the one rule that grades a metric against them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness.fmt import multiple as times_text
from harness.verdict import Verdict


@dataclass(frozen=True)
class Bound:
    """A tolerance: PASS at or below `limit` = max(floor, factor x noise), WARN up to
    `fail_ratio` x limit, FAIL beyond (and on NaN). `noise` is None without a noise run."""

    floor: float
    factor: float
    noise: float | None
    fail_ratio: float = 1.0

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
        """Where the bound comes from, e.g. '(noise 4.0e-08 x 50)' or '(floor; no noise run)'."""
        if self.noise is None:
            return "(floor; no noise run)"
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
