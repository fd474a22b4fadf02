"""What rounding in the dtype explains of a per-step logprob difference between two rounding-only runs.

The noise-scaled step checks (decode_consistency, the schedule routes, self_consistency, speculative_logprobs and
speculative_consistency, compare/parity/schedule.grade) scale their bounds from the same difference measured in the
reference run and between the reference and its noise run. That measurement is evidence of noise only where rounding
can explain it: a logprob is a logit minus the log-sum-exp of all logits, so two runs whose logits differ by at most
d differ in any logprob by at most 2 d, and rounding moves the logits by at most bounds.NoiseLimit.abs_limit
(2^10 unit roundoffs x max |logit|). A larger step difference in a float32 reference (0.67 nats where the limit is
~1e-3) is not noise: the reference disagrees with itself, a finding the check reports (naming the steps), never a
wider tolerance. The one exception is a forward pass with a discontinuous component (top-k expert routing, top-k
sparse-attention selection), where a near tie that rounding flips moves the output by more than rounding: there the
step is left out of the noise (the bound is never widened by it) and its token change, if any, is judged by the jump
test (compare/parity/jumps.py).

The logits' magnitude comes from the reference's prefill logits where it holds them, else from its top-k logprobs
(the logits span at least their spread, so max |logit| is at least half of it; 1 at the least).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from harness.compare.parity.bounds import NoiseLimit, ReductionFloor, noise_limit, reduction_floor
from harness.records.artifacts import RunArtifacts
from harness.records.contract import GEN_TOPK_LOGPROBS, PREFILL_LOGITS, tensor_key


@dataclass(frozen=True)
class StepRounding:
    """The largest per-step logprob difference rounding in `rounding.dtype` explains, and whether the model has a
    discontinuous component (`discontinuous`: its name, '' without one)."""

    rounding: NoiseLimit
    discontinuous: str = ""

    @property
    def logprob_limit(self) -> float:
        return 2.0 * self.rounding.abs_limit

    def explains(self, value: float) -> bool:
        return math.isfinite(value) and value <= self.logprob_limit

    def reduction(self) -> ReductionFloor | None:
        """The half-precision floor of a rescheduled repeat (one rank's reduction order changed), None in float32."""
        dtype = self.rounding.dtype
        return reduction_floor(dtype, self.rounding.magnitude, 1) if dtype in HALF_DTYPES else None

    def describe(self) -> str:
        """'3.8e-03 (2 x 2^10 u x max |logit| 18.8 for float32)'."""
        return (f"{self.logprob_limit:.1e} (2 x 2^10 u x max |logit| {max(self.rounding.magnitude, 1.0):.1f} "
                f"for {self.rounding.dtype})")


def discontinuity(model: Mapping[str, Any] | None) -> str:
    """The discontinuous component of a model (its manifest's `model` dict), '' without one."""
    model = model or {}
    hybrid = model.get("hybrid") or {}
    if model.get("moe") or (isinstance(hybrid, Mapping) and int(hybrid.get("experts") or 0) > 0):
        return "top-k expert routing"
    if model.get("sparse"):
        return "top-k sparse-attention selection"
    return ""


def step_rounding(run: RunArtifacts | None) -> StepRounding | None:
    """The StepRounding of a reference run, None without one or for a dtype without a known unit roundoff."""
    if run is None:
        return None
    manifest = run.manifest or {}
    limit = noise_limit(manifest.get("dtype"), _magnitude(run))
    if limit is None:
        return None
    model = manifest.get("model")
    return StepRounding(limit, discontinuity(model if isinstance(model, Mapping) else None))


def _magnitude(run: RunArtifacts) -> float:
    """Max |logit| of the run's prefill logits, else half the spread of its finite top-k logprobs (at least 1)."""
    best = 1.0
    for case in run.cases:
        logits = run.tensors.get(tensor_key(PREFILL_LOGITS, case.index))
        if logits is not None and logits.numel():
            finite = logits[torch.isfinite(logits)]
            if finite.numel():
                best = max(best, float(finite.abs().max()))
            continue
        lps = run.tensors.get(tensor_key(GEN_TOPK_LOGPROBS, case.index))
        if lps is not None and lps.numel():
            finite = lps[torch.isfinite(lps)].to(torch.float64)
            if finite.numel():
                best = max(best, 0.5 * float(finite.max() - finite.min()))
    return best


HALF_DTYPES: frozenset[str] = frozenset({"bfloat16", "float16"})


def topology_ranks(run: RunArtifacts) -> int:
    """tp x dcp of the run's topology (its manifest), 1 where it names none."""
    topology = run.manifest.get("topology") or {}
    try:
        return max(1, int(topology.get("tp") or 1)) * max(1, int(topology.get("dcp") or 1))
    except (TypeError, ValueError, AttributeError):
        return 1


def half_floor(ref: RunArtifacts | None, ranks: int = 1) -> ReductionFloor | None:
    """Where a half-precision step comparison's noise measured nothing (absent or zero), what rounding in its dtype
    over `ranks` ranks explains (bounds.ReductionFloor; a logprob or a top-2 gap moves by at most twice the
    logits' difference); None for float32 and float64, whose floors are their settings'."""
    if ref is None or ref.manifest.get("dtype") not in HALF_DTYPES:
        return None
    return reduction_floor(ref.manifest.get("dtype"), _magnitude(ref), ranks)
