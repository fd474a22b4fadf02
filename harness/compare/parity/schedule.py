"""A run against itself: checks that need no second topology.

- Route checks (batch_invariance, prefix_cache, chunked_prefill, preemption): each workload case is
  generated twice in one run, as its workload schedules it (gen_*) and in one plain batch (twin_*). A
  correct engine gives the same greedy tokens either way except where the plain batch's top-2 gap is a
  near tie, and along the common tokens (up to and including a divergence, where the contexts are still
  equal) the same top-1 logprob up to rounding.
- decode_consistency: every generated step's decode-time top-k (gen_*) against a re-prefill of prompt +
  generated tokens of the same run (reprefill_*): the same context, so the same top-1 token except at
  near ties and the generated token's logprob equal up to rounding.
Noise: the same differences measured in the reference run and between the reference and its noise run
(bounds.Bound: max(floor, factor x noise)). NaN anywhere is a FAIL. A noise measurement that is not finite
at a position (the noise run's token outside its re-prefill's top-k, a -inf logprob) measures nothing
there: the noise is the max over the finite positions, and the skipped ones are counted (never an inf
noise, which would leave the bound at its floor). A divergence outside the near ties (a jump) FAILs unless
the reference engine's rounding-only comparisons make jumps as often (compare/parity/jumps.py: a discontinuous
forward pass, e.g. top-k expert routing); benign jumps are left out of the logprob difference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from harness.compare.parity.bounds import Bound, json_float
from harness.compare.parity.generation import first_divergence, top2_gaps
from harness.compare.parity.jumps import JumpEvidence, JumpTest
from harness.compare.parity.step_rounding import StepRounding, step_rounding
from harness.compare.parity.topk import crossed_tie
from harness.compare.settings import ConsistencySettings, ScheduleSettings, SelfConsistencySettings
from harness.core.errors import RunError
from harness.core.verdict import CheckResult, Verdict
from harness.records.artifacts import RunArtifacts
from harness.records.contract import (
    GEN_TOKENS,
    GEN_TOPK_IDS,
    GEN_TOPK_LOGPROBS,
    REPREFILL_TOPK_IDS,
    REPREFILL_TOPK_LOGPROBS,
    TWIN_TOKENS,
    TWIN_TOPK_IDS,
    TWIN_TOPK_LOGPROBS,
    tensor_key,
)

GEN = (GEN_TOKENS, GEN_TOPK_IDS, GEN_TOPK_LOGPROBS)
TWIN = (TWIN_TOKENS, TWIN_TOPK_IDS, TWIN_TOPK_LOGPROBS)


@dataclass(frozen=True)
class Steps:
    """One generation of one case: tokens [N], top-k ids [N, k] and logprobs [N, k] (float64)."""

    tokens: list[int]
    ids: torch.Tensor
    lps: torch.Tensor


@dataclass(frozen=True)
class Pair:
    """Two generations of one case compared: first divergence (step or None), whether it is a near tie of
    the baseline (gap: its top-1 minus the other token's logprob, inf when outside its top-k), the max
    logprob difference and the max top-2 gap difference over the steps with equal contexts (NaN or inf
    where any step's is: what a graded run is held to). As a noise measurement: the same maxima over the
    steps where they are finite (None without any) and how many steps' logprob difference is not."""

    index: int
    steps: int
    divergence: int | None
    gap: float
    lp_diff: float
    gap_diff: float
    lp_noise: float | None
    gap_noise: float | None
    unmeasured: int
    diffs: tuple[tuple[int, float], ...] = ()  # (step, gap) of each step whose tokens differ with equal contexts
    lps: tuple[float, ...] = ()  # the logprob difference per compared step

    def lp_without(self, skip: set[int]) -> float:
        """The max logprob difference over the steps not in `skip` (NaN if any is NaN, 0 when none)."""
        return _max(torch.tensor([v for i, v in enumerate(self.lps) if i not in skip], dtype=torch.float64))


def steps_of(run: RunArtifacts, index: int, kinds: tuple[str, str, str]) -> Steps:
    tokens_kind, ids_kind, lps_kind = kinds
    return Steps([int(t) for t in run.tensor(tokens_kind, index).tolist()], run.tensor(ids_kind, index),
                 run.tensor(lps_kind, index).to(torch.float64))


def _max(values: torch.Tensor) -> float:
    """Max of a float tensor, NaN if any is NaN, 0 when empty."""
    if values.numel() == 0:
        return 0.0
    if bool(torch.isnan(values).any()):
        return math.nan
    return float(values.max())


def _finite_max(values: torch.Tensor) -> float | None:
    """Max of the finite entries of a float tensor, None without any."""
    finite = values[torch.isfinite(values)]
    return float(finite.max()) if finite.numel() else None


def _pair(index: int, steps: int, div: int | None, gap: float, lp: torch.Tensor, gaps: torch.Tensor,
          diffs: tuple[tuple[int, float], ...]) -> Pair:
    """The Pair of per-step logprob differences `lp` [steps] and top-2 gap differences `gaps`."""
    return Pair(index, steps, div, gap, _max(lp), _max(gaps), _finite_max(lp), _finite_max(gaps),
                int((~torch.isfinite(lp)).sum()), diffs, tuple(float(v) for v in lp.tolist()))


def _gap_to(base: Steps, step: int, token: int) -> float:
    """base's top-1 logprob minus its logprob of `token` at `step` (inf when outside its top-k)."""
    hits = (base.ids[step] == token).nonzero()
    return float(base.lps[step, 0] - base.lps[step, int(hits[0, 0])]) if hits.numel() else math.inf


def _divergence_gap(base: Steps, other: Steps, step: int) -> tuple[float, bool]:
    """(gap, crossed) of a step where `other` took another token than base's top-1: base's gap to that token; where
    the token (other's top-1) lies outside base's top-k, the same tie read from the other side (topk.crossed_tie:
    base's top-1 in other's top-k, at least the span of base's top-k; inf where it is outside that top-k too),
    crossed True."""
    gap = _gap_to(base, step, other.tokens[step])
    if not math.isinf(gap) or step >= other.ids.shape[0] or int(other.ids[step, 0]) != other.tokens[step]:
        return gap, False  # a token that is not other's own top-1 there is read from base's side only
    seen = crossed_tie(base.ids[step], base.lps[step], other.ids[step], other.lps[step], int(base.ids[step, 0]))
    return (math.inf, False) if seen is None else (seen, True)


def compare_schedules(index: int, base: Steps, other: Steps) -> Pair:
    """`other` (as scheduled) against `base` (the plain batch): contexts equal up to the first divergence."""
    div = first_divergence(base.tokens, other.tokens)
    n = min(len(base.tokens), len(other.tokens), base.lps.shape[0], other.lps.shape[0])
    n = n if div is None else min(n, div + 1)
    lp = (base.lps[:n, 0] - other.lps[:n, 0]).abs()  # [n]
    gaps = (top2_gaps(base.lps[:n]) - top2_gaps(other.lps[:n])).abs()  # [n]
    gaps = gaps[torch.isfinite(top2_gaps(base.lps[:n])) | torch.isnan(gaps)]
    gap = math.inf
    if div is not None and div < n and div < len(other.tokens):
        gap, _ = _divergence_gap(base, other, div)
    return _pair(index, n, div, gap, lp, gaps, () if div is None else ((div, gap),))


def compare_consistency(index: int, decode: Steps, prefill: Steps) -> Pair:
    """Decode-time steps against the re-prefill of the same tokens: every step has the same context."""
    n = min(len(decode.tokens), prefill.lps.shape[0], decode.lps.shape[0])
    top = [int(t) for t in prefill.ids[:n, 0].tolist()]
    div = first_divergence(top, decode.tokens[:n])
    steps = [_divergence_gap(prefill, decode, t) if decode.tokens[t] != top[t] else (0.0, False) for t in range(n)]
    # |decode's logprob of its token - re-prefill's logprob of that token|; where the token is outside the re-prefill's
    # top-k at a tie seen from the decode side, the two top-1 logprobs (the tied maxima: equal up to rounding)
    lp_vals = [abs(float(decode.lps[t, 0]) - float(prefill.lps[t, 0]) + (0.0 if crossed else gap))
               for t, (gap, crossed) in enumerate(steps)]
    lp = torch.tensor(lp_vals, dtype=torch.float64)
    gaps = (top2_gaps(decode.lps[:n]) - top2_gaps(prefill.lps[:n])).abs()  # [n]
    gaps = gaps[torch.isfinite(top2_gaps(prefill.lps[:n])) | torch.isnan(gaps)]
    gap = steps[div][0] if div is not None else math.inf
    diffs = tuple((t, steps[t][0]) for t in range(n) if decode.tokens[t] != top[t])
    return _pair(index, n, div, gap, lp, gaps, diffs)


def schedule_pairs(run: RunArtifacts) -> list[Pair]:
    return [compare_schedules(c.index, steps_of(run, c.index, TWIN), steps_of(run, c.index, GEN)) for c in run.cases]


def consistency_pairs(run: RunArtifacts, sampled: bool = False) -> list[Pair]:
    return [_consistency_case(run, c.index, sampled) for c in run.cases]


def _consistency_case(run: RunArtifacts, index: int, sampled: bool = False) -> Pair:
    decode = steps_of(run, index, GEN)
    if sampled:  # the decode-time top-1 of each step, the drawn token being the context of the next step only
        decode = Steps([int(t) for t in decode.ids[:, 0].tolist()], decode.ids, decode.lps)
    ids, lps = run.tensor(REPREFILL_TOPK_IDS, index), run.tensor(REPREFILL_TOPK_LOGPROBS, index).to(torch.float64)
    prefill = Steps([int(t) for t in ids[:, 0].tolist()], ids, lps)
    return compare_consistency(index, decode, prefill)


def has_tensors(run: RunArtifacts, kinds: Sequence[str]) -> bool:
    return bool(run.cases) and all(tensor_key(k, c.index) in run.tensors for c in run.cases for k in kinds)


def evidence_of(pairs: list[list[Pair]]) -> JumpEvidence:
    """Every differing step of these rounding-only comparisons with its gap, over all their steps."""
    flat = [p for group in pairs for p in group]
    return JumpEvidence(tuple(g for p in flat for _, g in p.diffs), sum(p.steps for p in flat))


def engine_evidence(ref: RunArtifacts, noise: RunArtifacts | None) -> JumpEvidence:
    """The reference engine's jumps under rounding alone: the reference's generations against its noise run's
    (both as scheduled), and apart each run's decode against its own re-prefill, where the runs hold them."""
    cross: list[list[Pair]] = []
    if noise is not None and has_tensors(ref, GEN) and has_tensors(noise, GEN):
        cross.append([compare_schedules(c.index, steps_of(ref, c.index, GEN), steps_of(noise, c.index, GEN))
                      for c in ref.cases])
    kinds = (*GEN, REPREFILL_TOPK_IDS, REPREFILL_TOPK_LOGPROBS)
    own = evidence_of([consistency_pairs(r) for r in (ref, noise) if r is not None and has_tensors(r, kinds)])
    found = evidence_of(cross)
    return JumpEvidence(found.gaps, found.steps, own.gaps, own.steps)


def _noise(pairs: list[list[Pair]], rounding: StepRounding | None = None
           ) -> tuple[float | None, float | None, int, list[tuple[int, int, float]]]:
    """(logprob noise, top-2 gap noise, steps skipped, steps beyond rounding): the max over the noise
    measurements' pairs of their finite steps that rounding in the dtype explains (`rounding`; every finite
    step without it; None without any), how many steps' logprob difference was not finite, and (prompt,
    step, difference) of each finite step beyond what rounding explains (never counted as noise)."""
    flat = [p for group in pairs for p in group]
    beyond = [(p.index, step, v) for p in flat for step, v in enumerate(p.lps)
              if rounding is not None and math.isfinite(v) and not rounding.explains(v)]
    if beyond:
        lps = [v for p in flat for v in p.lps if math.isfinite(v) and rounding is not None and rounding.explains(v)]
    else:
        lps = [p.lp_noise for p in flat if p.lp_noise is not None]
    gaps = [p.gap_noise for p in flat if p.gap_noise is not None]
    return max(lps, default=None), max(gaps, default=None), sum(p.unmeasured for p in flat), beyond


def _beyond_text(beyond: list[tuple[int, int, float]], rounding: StepRounding) -> str:
    """'logprob difference 6.7e-01 > 3.8e-03 (...) at prompt 1 step 5 (3 steps in 2 prompts)'."""
    index, step, value = max(beyond, key=lambda b: b[2])
    prompts = len({b[0] for b in beyond})
    return (f"logprob difference {value:.1e} > {rounding.describe()} at prompt {index} step {step} "
            f"({len(beyond)} step{'s' if len(beyond) != 1 else ''} in {prompts} prompt{'s' if prompts != 1 else ''})")


def grade(name: str, pairs: list[Pair], noise: list[list[Pair]],
          settings: ScheduleSettings | ConsistencySettings | SelfConsistencySettings, what: str,
          extra: dict[str, Any] | None = None, evidence: JumpEvidence | None = None,
          rounding: StepRounding | None = None) -> CheckResult:
    """The verdict over every case's Pair: FAIL on a divergence outside the near-tie bound (a jump) unless the
    jumps are as frequent as those of `evidence` (default: the noise comparisons), or on a logprob
    difference over its bound (NaN included; benign jumps' steps left out). The noise comparisons count only
    where rounding in the dtype explains them (`rounding`, compare/parity/step_rounding.py): a step beyond it
    is a FAIL naming the check and the step (the reference disagrees with itself), or, in a model with a
    discontinuous component, left out of the noise."""
    lp_noise, gap_noise, unmeasured, beyond = _noise(noise, rounding)
    if beyond and rounding is not None and not rounding.discontinuous:
        return CheckResult(name, Verdict.FAIL, f"the reference disagrees with itself beyond rounding "
                           f"({what}, its rounding-only comparisons): {_beyond_text(beyond, rounding)}; a finding, "
                           f"not noise", {"noise_beyond_rounding": [list(b) for b in beyond[:20]],
                                          "noise_rounding_limit": rounding.logprob_limit, **(extra or {})})
    tie_floor, lp_floor, why = settings.near_tie, settings.logprob_floor, "no noise run"
    half = rounding.reduction() if rounding is not None and not lp_noise else None  # measured nothing, half dtype
    if half is not None:  # held to the dtype's rounding, not to float32-like floors
        why = f"{'no noise run' if lp_noise is None else 'noise measured zero'}: 2 x {half.describe()}"
        tie_floor, lp_floor = max(tie_floor, 2.0 * half.abs_limit), max(lp_floor, 2.0 * half.abs_limit)
        lp_noise = gap_noise = None
    tie = Bound(tie_floor, settings.near_tie_factor, gap_noise, no_noise=why)
    bound = Bound(lp_floor, settings.logprob_factor, lp_noise, no_noise=why)
    ev = evidence_of(noise) if evidence is None else evidence
    jumps = [{s for s, g in p.diffs if not g <= tie.limit} for p in pairs]  # per pair, its jumping steps
    steps = sum(p.steps for p in pairs)
    noise_jumps, noise_steps = ev.counted(tie.limit, settings.jumps_alpha)
    test = JumpTest(sum(len(v) for v in jumps), steps, noise_jumps, noise_steps, settings.jumps_alpha)
    jumped = [i for i, p in enumerate(pairs) if jumps[i]]
    bad_div = [] if test.benign else jumped
    diffs = [p.lp_without(jumps[i]) if test.benign else p.lp_diff for i, p in enumerate(pairs)]
    w = max(range(len(pairs)), key=lambda i: math.inf if math.isnan(diffs[i]) else diffs[i])
    worst, worst_diff = pairs[w], diffs[w]
    lp_bad = bound.grade(worst_diff) is Verdict.FAIL
    benign = [p for i, p in enumerate(pairs) if p.divergence is not None and not jumps[i]]
    metrics = {"prompts": len(pairs), "steps_compared": steps, "divergences": len(bad_div),
               "benign_divergences": len(benign), "benign_jumps": len(jumped) if test.benign else 0,
               "max_logprob_diff": json_float(worst_diff),
               "logprob_bound": bound.to_dict(), "near_tie_bound": tie.to_dict(), **test.metrics(),
               "first_divergence": ({"prompt": pairs[bad_div[0]].index, "step": min(jumps[bad_div[0]])}
                                    if bad_div else None),
               "noise_steps_unmeasured": unmeasured, **(extra or {})}
    if bad_div:
        p = pairs[bad_div[0]]
        step = min(jumps[bad_div[0]])
        gap = dict(p.diffs)[step]
        gap_text = "outside its top-k" if math.isinf(gap) else f"gap {gap:.1e} > near-tie {tie.limit:.1e}"
        return CheckResult(name, Verdict.FAIL, f"prompt {p.index} {what} diverges at generation step {step} "
                           f"({gap_text}); {len(bad_div)}/{len(pairs)} prompts diverge outside near ties"
                           + test.note(), metrics)
    skipped = (f"; noise not finite at {unmeasured} step{'s' if unmeasured > 1 else ''}, skipped"
               if unmeasured else "")
    if beyond and rounding is not None:
        metrics["noise_beyond_rounding"] = [list(b) for b in beyond[:20]]
        skipped += (f"; noise beyond rounding left out ({rounding.discontinuous}): "
                    f"{_beyond_text(beyond, rounding)}")
    if lp_bad:
        label = f"prompt {worst.index} {what}: logprob difference"
        return CheckResult(name, Verdict.FAIL, bound.compare(label, worst_diff) + f" over {worst.steps} steps"
                           + skipped, metrics)
    ties = f"; {len(benign)} diverge at near ties" if benign else ""
    ties += f"; {len(jumped)} jump as often as rounding does ({test.describe()})" if jumped else ""
    return CheckResult(name, Verdict.PASS, f"{len(pairs)} prompts, {steps} steps {what}: "
                       + bound.compare("max logprob difference", worst_diff) + ties + skipped, metrics)


def check_schedule(name: str, run: RunArtifacts, ref: RunArtifacts, noise: RunArtifacts | None,
                   settings: ScheduleSettings, what: str, extra: dict[str, Any] | None = None,
                   evidence: JumpEvidence | None = None) -> CheckResult:
    """`run`'s scheduled generation against its plain batch; noise from the reference run's own pair and
    the reference against the noise run (both as scheduled); `evidence`: the engine's jumps under rounding over
    more cases than these (None: engine_evidence of `ref` and `noise`)."""
    if not has_tensors(run, (*GEN, *TWIN)):
        return CheckResult(name, Verdict.SKIP, "the run holds no plain-batch twin (twin_*) of its workload")
    try:
        pairs = schedule_pairs(run)
        measured = [schedule_pairs(ref)] if has_tensors(ref, (*GEN, *TWIN)) else []
        if noise is not None and has_tensors(noise, GEN):
            measured.append([compare_schedules(c.index, steps_of(ref, c.index, GEN), steps_of(noise, c.index, GEN))
                             for c in ref.cases])
        evidence = engine_evidence(ref, noise) if evidence is None else evidence
    except RunError as exc:
        return CheckResult(name, Verdict.ERROR, str(exc))
    return grade(name, pairs, measured, settings, what, extra, evidence, step_rounding(ref))


def check_consistency(run: RunArtifacts, ref: RunArtifacts, noise: RunArtifacts | None,
                      settings: ConsistencySettings, sampled: bool = False,
                      evidence: JumpEvidence | None = None) -> CheckResult:
    """decode_consistency of `run`; noise: the same comparison in the reference and the noise run. `sampled`: the
    generations are draws, so each step's decode-time top-1 (not the drawn token) is held to the re-prefill's."""
    name, kinds = "decode_consistency", (*GEN, REPREFILL_TOPK_IDS, REPREFILL_TOPK_LOGPROBS)
    if not has_tensors(run, kinds):
        return CheckResult(name, Verdict.SKIP, "the run holds no re-prefill (reprefill_topk_*) of its generations")
    try:
        pairs = consistency_pairs(run, sampled)
        measured = [consistency_pairs(r, sampled) for r in (ref, noise) if r is not None and has_tensors(r, kinds)]
        evidence = engine_evidence(ref, noise) if evidence is None else evidence
    except RunError as exc:
        return CheckResult(name, Verdict.ERROR, str(exc))
    return grade(name, pairs, measured, settings, "decode vs re-prefill", evidence=evidence,
                 rounding=step_rounding(ref))
