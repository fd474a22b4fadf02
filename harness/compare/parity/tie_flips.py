"""Near-tie top-1 flips as a statistical test against the noise run's flip rate.

A top-1 flip at a near tie of the reference is benign on its own (rounding decides between two almost
equal tokens), but a correct parallel run flips such ties about as often as the noise run (the reference
topology with another reduction order) does; a systematic error flips them more often. The count of the
parallel run's near-tie flips over its compared positions (or greedy steps) is held against the noise
run's flips over its own with the exact conditional test of two Poisson rates: under the null hypothesis
(equal rates), given n = k + m flips in all, the parallel run's share k is Binomial(n, N / (N + M)), where
k, N are the parallel run's flips and positions and m, M the noise run's. The check FAILs when the
one-sided p-value P(X >= k) is below `tie_flips_alpha` (the false-positive level per check) and k is above
`tie_flips_floor`. The noise run's flips get `tie_flips_prior` pseudo-flips added, so a noise run that
happened to flip nothing does not make a few flips significant; without a noise run the reference's
count is taken as 0 flips over as many positions as the parallel run compared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness.compare.settings import LogitsSettings


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), exact (summed in log space)."""
    if k <= 0:
        return 1.0
    if k > n or p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    log_p, log_q = math.log(p), math.log1p(-p)
    total = 0.0
    for i in range(k, n + 1):
        log_term = (math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
                    + i * log_p + (n - i) * log_q)
        total += math.exp(log_term)
    return min(1.0, total)


@dataclass(frozen=True)
class TieFlipTest:
    """`flips` near-tie flips in `steps` compared positions against the noise run's `noise_flips` in
    `noise_steps` (0 steps: no usable noise run)."""

    flips: int
    steps: int
    noise_flips: int
    noise_steps: int
    alpha: float
    prior: int
    floor: int

    def p_value(self, flips: int | None = None) -> float:
        """One-sided p-value of `flips` (default: the observed count) under equal flip rates."""
        k = self.flips if flips is None else flips
        if self.steps <= 0:
            return 1.0
        noise_steps = self.noise_steps if self.noise_steps > 0 else self.steps
        share = self.steps / (self.steps + noise_steps)
        return binomial_tail(k, k + self.noise_flips + self.prior, share)

    @property
    def fails(self) -> bool:
        return self.flips > self.floor and self.p_value() < self.alpha

    @property
    def limit(self) -> int:
        """The most near-tie flips these steps may have before the test FAILs (`steps` when no count
        up to `steps` would be significant); the p-value falls as the count grows, so bisect."""
        lo, hi = self.floor, max(self.floor, self.steps)  # lo passes; hi + 1 is the first candidate past
        if hi == lo or self.p_value(hi) >= self.alpha:
            return hi
        while hi - lo > 1:  # invariant: lo passes, hi fails
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.p_value(mid) >= self.alpha else (lo, mid)
        return lo

    def describe(self) -> str:
        """'8 top-1 flips at near ties in 96 steps against 2 in 96 of the noise run: p = 5.5e-02 >= 1.0e-03'."""
        noise = (f"{self.noise_flips} in {self.noise_steps} of the noise run" if self.noise_steps
                 else "no noise run")
        op = "<" if self.p_value() < self.alpha else ">="
        return (f"{self.flips} top-1 flips at near ties in {self.steps} steps against {noise} "
                f"(+{self.prior} prior): p = {self.p_value():.1e} {op} {self.alpha:.0e}, limit {self.limit}")

    def metrics(self) -> dict[str, float | int]:
        return {"tie_flip_limit": self.limit, "tie_flip_p_value": self.p_value(), "tie_flip_alpha": self.alpha,
                "noise_flips": self.noise_flips, "noise_steps": self.noise_steps}


def tie_flip_test(settings: LogitsSettings, flips: int, steps: int, noise_flips: int,
                  noise_steps: int) -> TieFlipTest:
    """The near-tie flip test of `settings` (tie_flips_alpha, tie_flips_prior, tie_flips_floor)."""
    return TieFlipTest(flips=flips, steps=steps, noise_flips=noise_flips, noise_steps=noise_steps,
                       alpha=settings.tie_flips_alpha, prior=settings.tie_flips_prior,
                       floor=settings.tie_flips_floor)
