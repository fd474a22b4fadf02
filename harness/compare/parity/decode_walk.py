"""Decode-path parity from greedy generations, for engines that cannot teacher-force their decode path
(HTTP servers): every generated token comes with its top-k logprobs, each computed by a decode step
through the engine's KV cache, so the two runs' top-k can be compared wherever both computed them from
the same context.

Per prompt, walk the greedy tokens of both runs from the first (as vLLM's check_logprobs_close does):
while the tokens agree, the next step's context is the same in both runs, so its top-k are compared;
at the first step where they differ the top-k are still compared (same context) and each run's token
must be in the other run's top-k; then the walk stops (the contexts differ from there on). Step 0 is
the prefill's last position (the first generated token), steps 1.. are decode steps.

The compared steps are graded like the top-k prefill path (harness/compare/parity/topk.py: KL lower bound and
logprob error against noise-scaled bounds from LogitsSettings, top-1 flips outside the reference's
near ties FAIL), with the noise measured the same way: the reference walked against its noise run.
Near-tie flips are benign only while as frequent as the noise run's, as on the teacher-forced paths
(compare/parity/tie_flips.py): the flips over the compared steps are tested against the noise walk's flips over
its own steps (the walks of the two comparisons have different lengths); a fault on the decode path
makes the walks diverge early and often, so many flips in few steps. A token missing from
the other run's top-k at the divergence FAILs, unless only one of the two is missing, the other run's top-k holds
both within the near-tie bound and the top-k it is missing from spans at most that bound (topk.crossed_tie: the
top-k does not exclude the tie; a bfloat16 model whose noise is wider than its top-5).

A sampled workload's generations are draws (`sampled`): the walk compares the top-k along their common prefix alike
(the contexts are equal there), but a drawn token may lie anywhere in the processed support, so at the divergence
neither run's token is required in the other's top-k (the sampling checks judge the draws).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from harness.compare.parity.logprob_values import BadLogprobs, check_finite
from harness.compare.parity.tie_flips import tie_flip_test
from harness.compare.parity.topk import TopkMetrics, crossed_tie, grade_topk, topk_metrics
from harness.compare.settings import LogitsSettings
from harness.core.errors import RunError
from harness.core.verdict import CheckResult, Verdict, worst
from harness.records.artifacts import RunArtifacts
from harness.records.contract import GEN_TOKENS, GEN_TOPK_IDS, GEN_TOPK_LOGPROBS

NAME = "logits_decode"


@dataclass(frozen=True)
class Walk:
    """One prompt walked along the common greedy prefix of two runs."""

    index: int
    prompt_tokens: int          # the step-0 distribution sits at sequence position prompt_tokens - 1
    steps: int                  # steps compared: the common prefix, plus the diverging step
    diverged_at: int | None     # the first step whose greedy tokens differ (None: none within both)
    missing: str | None         # at the divergence, a run's token absent from the other run's top-k
    tie_at: float | None        # with `missing` on one side only: the near-tie bound that excuses it (topk.crossed_tie)
    width: int                  # k of the compared top-k (the narrower run's)
    metrics: TopkMetrics        # over the compared steps, each tensor [steps]


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0, 0]) if differ.numel() else None


def _generation(run: RunArtifacts, who: str, index: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [N], top-k ids [N, k], float64 logprobs [N, k]) of one prompt's greedy generation."""
    tokens = run.tensor(GEN_TOKENS, index).reshape(-1)  # [N]
    ids, lps = run.tensor(GEN_TOPK_IDS, index), run.tensor(GEN_TOPK_LOGPROBS, index)
    if ids.dim() != 2 or ids.shape != lps.shape or ids.shape[0] < tokens.numel():
        raise RunError(f"{run.path}: prompt {index}: {GEN_TOPK_IDS} {list(ids.shape)} / {GEN_TOPK_LOGPROBS} "
                       f"{list(lps.shape)} must be equal [N, k] shapes covering the {tokens.numel()} tokens")
    check_finite(run, who, GEN_TOPK_LOGPROBS, index, lps, ids, unit="generation step")
    return tokens, ids[:, :k], lps[:, :k].to(torch.float64)


def walk_case(ref: RunArtifacts, other: RunArtifacts, index: int, k: int, who: str = "parallel") -> Walk:
    """Walk prompt `index` of `other` against the reference. Raises BadLogprobs on non-finite logprobs,
    RunError on missing or malformed tensors."""
    r_tok, r_ids, r_lp = _generation(ref, "reference", index, k)
    o_tok, o_ids, o_lp = _generation(other, who, index, k)
    width = min(r_ids.shape[1], o_ids.shape[1])
    r_ids, r_lp, o_ids, o_lp = r_ids[:, :width], r_lp[:, :width], o_ids[:, :width], o_lp[:, :width]
    div = _first_difference(r_tok, o_tok)
    steps = min(r_tok.numel(), o_tok.numel()) if div is None else div + 1
    missing, tie_at = None, None
    if div is not None:
        r_token, o_token = int(r_tok[div]), int(o_tok[div])
        absent = [f"{name} token {token} not in the {other_name} top-{width}"
                  for name, token, other_name, top in (("reference", r_token, who, o_ids[div]),
                                                       (who, o_token, "reference", r_ids[div]))
                  if not bool((top == token).any())]
        missing = f"prompt {index} step {div}: " + " and ".join(absent) if absent else None
        if len(absent) == 1:  # the tie seen from the side that holds both tokens
            other_missing = not bool((r_ids[div] == o_token).any())
            tie_at = (crossed_tie(r_ids[div], r_lp[div], o_ids[div], o_lp[div], r_token) if other_missing
                      else crossed_tie(o_ids[div], o_lp[div], r_ids[div], r_lp[div], o_token))
    prompt_len = next((len(c.prompt_ids) for c in ref.cases if c.index == index), 0)
    return Walk(index=index, prompt_tokens=prompt_len, steps=steps, diverged_at=div, missing=missing, tie_at=tie_at,
                width=width,
                metrics=topk_metrics(r_ids[:steps], r_lp[:steps], o_ids[:steps], o_lp[:steps]))


@dataclass(frozen=True)
class _Noise:
    """The reference walked against its noise run (Nones without a usable one)."""

    kl: float | None = None
    err: float | None = None
    flips: int = 0   # near-tie top-1 flips (every diverging prompt has one, at its diverging step)
    steps: int = 0   # steps compared
    note: str | None = None


def _noise(ref: RunArtifacts, noise: RunArtifacts | None, k: int) -> _Noise:
    if noise is None:
        return _Noise()
    if not noise.ok:
        return _Noise(note="noise run failed")
    try:
        walks = [walk_case(ref, noise, case.index, k, who="noise") for case in ref.cases]
    except RunError as exc:
        return _Noise(note=f"noise run unusable: {exc}")
    m = [w.metrics for w in walks if w.steps]
    return _Noise(kl=max((float(x.kl_lower.max()) for x in m), default=0.0),
                  err=max((float(x.lp_error.max()) for x in m), default=0.0),
                  flips=sum(int((~x.top1_match).sum()) for x in m), steps=sum(w.steps for w in walks))


def check_decode_walk(ref: RunArtifacts, par: RunArtifacts, noise: RunArtifacts | None, settings: LogitsSettings,
                      k: int, noise_ref: RunArtifacts | None = None,
                      sampled: bool = False) -> tuple[CheckResult, list[dict[str, Any]]]:
    """The `logits_decode` check from the greedy generations' top-k; returns the check and one row per prompt. The
    noise is `noise` walked against `noise_ref` (default: `ref`; compare/parity/noise_source.py). `sampled`: the
    generations are draws (module docstring)."""
    if not ref.cases:
        return CheckResult(NAME, Verdict.SKIP, "decode: no prompts"), []
    try:
        walks = [walk_case(ref, par, case.index, k) for case in ref.cases]
    except BadLogprobs as exc:
        return CheckResult(NAME, Verdict.FAIL, f"decode (greedy walk): {exc}"), []
    except RunError as exc:
        return CheckResult(NAME, Verdict.ERROR, f"decode (greedy walk): {exc}"), []
    k = min([k, *(w.width for w in walks)])
    compared = [w for w in walks if w.steps]
    if not compared:
        return CheckResult(NAME, Verdict.SKIP, "decode (greedy walk): no generated tokens to compare"), []
    measured = _noise(ref if noise_ref is None else noise_ref, noise, k)
    cases = [(w.index, w.prompt_tokens - 1, w.metrics) for w in compared]
    verdicts, parts, metrics, prompts = grade_topk("decode", cases, measured.kl, measured.err, measured.note,
                                                   settings, k)
    steps = sum(w.steps for w in compared)
    decode_steps = sum(w.steps - 1 for w in compared)
    diverged = [w for w in walks if w.diverged_at is not None]
    # a token outside the other run's top-k FAILs unless the other side places the two tokens within the tie bound
    missing = [w.missing for w in walks
               if w.missing and not (w.tie_at is not None and w.tie_at <= metrics["tie_bound"]) and not sampled]
    kind = "sampled" if sampled else "greedy"
    head = (f"{steps} {kind} steps compared along the common {kind} prefixes of {len(walks)} prompts "
            f"({decode_steps} decode steps; step 0 is the prefill's last position); "
            f"{len(diverged)} prompt(s) diverge" + (" (draws: the sampling checks judge them)" if sampled else ""))
    ties = tie_flip_test(settings, metrics["benign_flips"], steps, measured.flips, measured.steps)
    if ties.fails:
        verdicts.append(Verdict.FAIL)
        parts = [p for p in parts if not p.endswith("at near ties (benign)")]
        parts.append(f"{ties.describe()}: systematic, not noise")
    if missing:
        verdicts.append(Verdict.FAIL)
        parts.insert(0, f"{missing[0]}" + (f" (+{len(missing) - 1} more prompt{'s' if len(missing) > 2 else ''})"
                                         if len(missing) > 1 else ""))
    by_index = {w.index: w for w in walks}
    for row in prompts:
        w = by_index[row["index"]]
        row.update({"steps": w.steps, "diverged_at_step": w.diverged_at, "problem": w.missing})
    metrics.update({"source": "greedy walk (generation top-k logprobs)", "steps_compared": steps,
                    "decode_steps_compared": decode_steps, "prompts_diverged": len(diverged),
                    "missing_from_topk": missing, **ties.metrics(),
                    "steps_per_prompt": {str(w.index): w.steps for w in walks}})
    return CheckResult(NAME, worst(verdicts), f"decode (greedy walk, top-{k}): {head}; " + "; ".join(parts),
                       metrics), prompts

