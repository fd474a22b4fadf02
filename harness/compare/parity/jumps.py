"""Jumps: greedy divergences outside near ties, held against the engine's own jump rate under rounding.

A divergence outside the near-tie bound (a clear gap, or the other token outside the baseline's top-k) is a
jump. A continuous forward pass makes none from rounding: there a jump is a FAIL. An engine whose forward
pass has discontinuities (top-k expert routing, top-k sparse-attention selection) makes some from rounding
alone: a router near tie that a one-ulp difference of the hidden state flips sends a token to another expert,
and a small model's next-token distribution can move by more than any near-tie bound (vLLM computes the router
in the model dtype too). Whether the engine has them is measured, never assumed: the evidence (JumpEvidence)
is every step where a rounding-only comparison of the reference engine chose other tokens with equal
contexts, with the gap at that step: the reference against its noise run (both as scheduled: a bug the two
share moves both alike), and each of those runs' decode against its own re-prefill (another batch
composition, as the checked copies have). The latter is admitted only while its jumps are as frequent as the
former's (the same test, no floor): a bug the reference shares on a route its re-prefills take (a stale
state slot) makes them jump far more often, and then only the cross-run comparison counts.

Where the evidence holds no jump, every jump FAILs, as before; where it does, the jumps of the checked
comparison are benign only while as frequent per compared step as the evidence's, by the exact conditional
test of two Poisson rates (compare/parity/tie_flips.py: the checked count k of n = k + m jumps is
Binomial(n, N / (N + M)) under equal rates), failing at p < `jumps_alpha`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from harness.compare.parity.tie_flips import binomial_tail


@dataclass(frozen=True)
class JumpEvidence:
    """Rounding-only comparisons of the reference engine: the gap (baseline's top-1 minus the other run's token,
    inf when outside the baseline's top-k) at each step whose tokens differ with equal contexts, over `steps`
    compared steps."""

    gaps: tuple[float, ...]
    steps: int
    own_gaps: tuple[float, ...] = ()  # each run against itself (decode vs re-prefill), admitted by counted()
    own_steps: int = 0

    def jumps(self, limit: float) -> int:
        """How many of the cross-run differing steps are outside the near-tie bound `limit` (NaN counts)."""
        return _outside(self.gaps, limit)

    def counted(self, limit: float, alpha: float) -> tuple[int, int]:
        """(jumps, steps) the checked count is tested against: the cross-run comparison's, plus each run's
        against itself where those jump as often per step as the cross-run one (one-sided p >= alpha)."""
        cross, own = self.jumps(limit), _outside(self.own_gaps, limit)
        if self.own_steps and (own == 0 or binomial_tail(own, own + cross, self.own_steps
                                                          / (self.own_steps + max(self.steps, 1))) >= alpha):
            return cross + own, self.steps + self.own_steps
        return cross, self.steps


def _outside(gaps: tuple[float, ...], limit: float) -> int:
    return sum(1 for g in gaps if not g <= limit)


NO_EVIDENCE = JumpEvidence((), 0)


def pooled(evidences: Sequence[JumpEvidence]) -> JumpEvidence:
    """One engine's rounding-only comparisons over several sets of cases (a run's greedy workloads): the jump rate
    is the engine's, model's and dtype's, so every step the reference and noise runs hold measures it."""
    return JumpEvidence(tuple(g for e in evidences for g in e.gaps), sum(e.steps for e in evidences),
                        tuple(g for e in evidences for g in e.own_gaps), sum(e.own_steps for e in evidences))


@dataclass(frozen=True)
class JumpTest:
    """`jumps` in `steps` compared steps against `noise_jumps` in `noise_steps` of the evidence."""

    jumps: int
    steps: int
    noise_jumps: int
    noise_steps: int
    alpha: float

    def p_value(self) -> float:
        """One-sided p-value of the count under equal jump rates (0 without evidence of any jump)."""
        if self.jumps == 0:
            return 1.0
        if self.noise_jumps == 0 or self.noise_steps <= 0 or self.steps <= 0:
            return 0.0
        share = self.steps / (self.steps + self.noise_steps)
        return binomial_tail(self.jumps, self.jumps + self.noise_jumps, share)

    @property
    def benign(self) -> bool:
        """No jump, or jumps as frequent as the evidence's (the evidence holding at least one)."""
        return self.p_value() >= self.alpha

    def describe(self) -> str:
        """'2 jumps in 54 steps against 2 in 295 of the rounding-only comparisons: p = 1.0e-01 >= 1e-03'."""
        op = ">=" if self.benign else "<"
        return (f"{self.jumps} jump{'s' if self.jumps != 1 else ''} in {self.steps} steps against "
                f"{self.noise_jumps} in {self.noise_steps} of the rounding-only comparisons: "
                f"p = {self.p_value():.1e} {op} {self.alpha:.0e}")

    def note(self) -> str:
        """' (the test)' where the evidence holds jumps (so the count was tested), else ''."""
        return f" ({self.describe()})" if self.noise_jumps else ""

    def metrics(self) -> dict[str, float | int]:
        return {"jumps": self.jumps, "jump_steps": self.steps, "noise_jumps": self.noise_jumps,
                "noise_jump_steps": self.noise_steps, "jumps_p_value": self.p_value(), "jumps_alpha": self.alpha}
