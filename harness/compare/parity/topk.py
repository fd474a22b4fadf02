"""Logits parity from top-k logprobs: what an engine that returns only the top-k logprobs per
position (an HTTP server) still lets us judge, teacher-forced on the prefill and the decode path.

Per position, from the reference's top-k (ids R, logprobs r) and the parallel run's (ids P, logprobs p):
- top-1 agreement: R[0] == P[0];
- top-k overlap: |R & P| / k;
- logprob error: max |r_i - p_j| over the shared tokens R_i == P_j;
- KL lower bound: KL(ref || par) of the distributions coarse-grained to the shared tokens plus one
  tail bucket holding everything else (1 - the shared mass on each side). Coarse-graining never
  increases KL, so this bounds the full KL from below: a large value is a real divergence;
- near tie: a top-1 flip is benign where the reference's logprob gap between its top-1 and the
  parallel top-1 is at most the tie bound; a parallel top-1 outside the reference's top-k has a gap of
  at least r_0 - r_{k-1}.
Bounds and grading follow the full-logits check (LogitsSettings; bounds.Bound, noise-scaled by the
same metrics of the noise run): KL against kl_floor/kl_factor, logprob error against
abs_floor/abs_factor. A run with full logits is reduced to its top-k here, so engines of both kinds
compare with each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from harness.compare.parity.bounds import Bound, json_float
from harness.compare.parity.logprob_values import BadLogprobs, check_finite
from harness.compare.settings import LogitsSettings
from harness.core.errors import RunError
from harness.core.verdict import CheckResult, Verdict, worst
from harness.records import contract as c
from harness.records.artifacts import RunArtifacts

TOPK_KINDS: dict[str, tuple[str, str, str]] = {  # path -> (ids kind, logprobs kind, full-logits kind)
    "prefill": (c.PREFILL_TOPK_IDS, c.PREFILL_TOPK_LOGPROBS, c.PREFILL_LOGITS),
    "decode": (c.DECODE_TOPK_IDS, c.DECODE_TOPK_LOGPROBS, c.DECODE_LOGITS),
}
_TINY = 1e-300


def run_topk(run: RunArtifacts, path: str, index: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([T, k] ids, [T, k] float64 logprobs) of one case, best first: the run's own top-k tensors,
    else derived from its full logits; raises RunError when it has neither."""
    ids_kind, lps_kind, logits_kind = TOPK_KINDS[path]
    if c.tensor_key(ids_kind, index) in run.tensors:
        ids, lps = run.tensor(ids_kind, index), run.tensor(lps_kind, index).to(torch.float64)
        if ids.shape != lps.shape or ids.dim() != 2:
            raise RunError(f"{run.path}: {ids_kind}.{index} {list(ids.shape)} and {lps_kind}.{index} "
                           f"{list(lps.shape)} must be equal [T, k] shapes")
        return ids[:, :k], lps[:, :k]
    if c.tensor_key(logits_kind, index) not in run.tensors:
        raise RunError(f"{run.path}: neither {ids_kind}.{index} nor {logits_kind}.{index} in {c.TENSORS_FILE}")
    lp = torch.log_softmax(run.tensor(logits_kind, index).to(torch.float64), dim=-1)  # [T, V]
    top = lp.topk(min(k, lp.shape[-1]), dim=-1)  # [T, k]
    return top.indices, top.values


@dataclass(frozen=True)
class TopkMetrics:
    """Per-position metrics of one prompt; every tensor is [T] (float64 or bool)."""

    kl_lower: torch.Tensor      # KL(ref || par) over shared tokens + tail bucket (a lower bound of the full KL)
    lp_error: torch.Tensor      # max |ref - par| logprob over the shared tokens (0 when none is shared)
    top1_match: torch.Tensor    # top-1 tokens agree
    flip_gap: torch.Tensor      # reference gap from its top-1 to the parallel top-1 (0 on match)
    overlap: torch.Tensor       # shared tokens / k


def topk_metrics(ref_ids: torch.Tensor, ref_lp: torch.Tensor, par_ids: torch.Tensor,
                 par_lp: torch.Tensor) -> TopkMetrics:
    """Metrics of equal-shape [T, k] top-k ids and float64 logprobs (best first)."""
    k = ref_ids.shape[-1]
    match = ref_ids[:, :, None] == par_ids[:, None, :]  # [T, k_ref, k_par]
    shared = match.any(dim=-1)  # [T, k] reference tokens also in the parallel top-k
    par_at_ref = (match.to(torch.float64) * par_lp[:, None, :]).sum(dim=-1)  # [T, k] par logprob of ref token
    err = torch.where(shared, (ref_lp - par_at_ref).abs(), torch.zeros_like(ref_lp))  # [T, k]
    p = torch.where(shared, ref_lp.exp(), torch.zeros_like(ref_lp))  # [T, k]
    q = torch.where(shared, par_at_ref.exp(), torch.zeros_like(ref_lp))  # [T, k]
    terms = torch.where(shared, p * (ref_lp - par_at_ref), torch.zeros_like(ref_lp)).sum(dim=-1)  # [T]
    p_tail = (1.0 - p.sum(dim=-1)).clamp_min(0.0)  # [T]
    q_tail = (1.0 - q.sum(dim=-1)).clamp_min(_TINY)  # [T]
    tail = torch.where(p_tail > 0, p_tail * (p_tail.clamp_min(_TINY).log() - q_tail.log()),
                       torch.zeros_like(p_tail))  # [T]
    top1 = ref_ids[:, 0] == par_ids[:, 0]  # [T]
    in_ref = ref_ids == par_ids[:, :1]  # [T, k] where the parallel top-1 sits in the reference top-k
    gap_in = ref_lp[:, 0] - (in_ref.to(torch.float64) * ref_lp).sum(dim=-1)  # [T]
    gap_out = ref_lp[:, 0] - ref_lp[:, k - 1]  # [T] at least this when outside the reference top-k
    flip_gap = torch.where(top1, torch.zeros_like(gap_in), torch.where(in_ref.any(dim=-1), gap_in, gap_out))
    return TopkMetrics(kl_lower=(terms + tail).clamp_min(0.0), lp_error=err.amax(dim=-1), top1_match=top1,
                       flip_gap=flip_gap, overlap=shared.sum(dim=-1).to(torch.float64) / k)


def crossed_tie(ref_ids: torch.Tensor, ref_lp: torch.Tensor, other_ids: torch.Tensor, other_lp: torch.Tensor,
                ref_token: int) -> float | None:
    """A divergence where the other run's top-1 lies outside the reference's top-k ([k] ids best first, logprobs):
    the smallest near-tie bound under which it is a near tie, read from the other side: the reference's token
    `ref_token` in the other run's top-k, its gap there (the same tie seen from the other run), and at least the
    span of the reference's top-k (the least gap a token outside it has: a wider top-k excludes the tie). None
    where the reference's token is outside the other run's top-k too (a jump at any bound)."""
    hits = (other_ids == ref_token).nonzero()
    if not hits.numel():
        return None
    return max(float(ref_lp[0] - ref_lp[-1]), float(other_lp[0] - other_lp[int(hits[0, 0])]))


def _case_metrics(path: str, ref: RunArtifacts, other: RunArtifacts, index: int, k: int) -> TopkMetrics:
    r_ids, r_lp = run_topk(ref, path, index, k)
    o_ids, o_lp = run_topk(other, path, index, k)
    if r_ids.shape != o_ids.shape:
        raise RunError(f"prompt {index}: {path} top-k shape {list(o_ids.shape)} != reference {list(r_ids.shape)}")
    for who, run, ids, lp in (("reference", ref, r_ids, r_lp), ("parallel", other, o_ids, o_lp)):
        check_finite(run, who, TOPK_KINDS[path][1], index, lp, ids)
    return topk_metrics(r_ids, r_lp, o_ids, o_lp)


def _max(t: torch.Tensor) -> float:
    return float(t.max()) if t.numel() else 0.0


def _mean(t: torch.Tensor, empty: float = 1.0) -> float:
    return float(t.to(torch.float64).mean()) if t.numel() else empty


def _noise(path: str, ref: RunArtifacts, noise: RunArtifacts | None,
           k: int) -> tuple[float | None, float | None, str | None]:
    """(max KL lower bound, max logprob error) of the reference against the noise run, or Nones and why."""
    if noise is None:
        return None, None, None
    if not noise.ok:
        return None, None, "noise run failed"
    try:
        got = [_case_metrics(path, ref, noise, case.index, k) for case in ref.cases]
    except RunError as exc:
        return None, None, f"noise run unusable: {exc}"
    return (max((_max(m.kl_lower) for m in got), default=0.0),
            max((_max(m.lp_error) for m in got), default=0.0), None)


def check_topk(path: str, ref: RunArtifacts, par: RunArtifacts, noise: RunArtifacts | None,
               settings: LogitsSettings, k: int,
               noise_ref: RunArtifacts | None = None) -> tuple[CheckResult, list[dict[str, Any]]]:
    """The `logits_{path}` check from top-k logprobs; returns the check and one dict per prompt. The noise is
    `noise` against `noise_ref` (default: `ref`; compare/parity/noise_source.py)."""
    if path not in TOPK_KINDS:
        raise ValueError(f"logits path {path!r} is not one of {tuple(TOPK_KINDS)}")
    name = f"logits_{path}"
    if not ref.cases:
        return CheckResult(name, Verdict.SKIP, f"{path}: no prompts"), []
    try:
        cases = [(case.index, case.decode_start if path == "decode" else 0,
                  _case_metrics(path, ref, par, case.index, k)) for case in ref.cases]
    except RunError as exc:
        bad = isinstance(exc, BadLogprobs) or "shape" in str(exc)
        return CheckResult(name, Verdict.FAIL if bad else Verdict.ERROR, f"{path} (top-{k}): {exc}"), []
    noise_kl, noise_err, note = _noise(path, ref if noise_ref is None else noise_ref, noise, k)
    verdicts, parts, metrics, prompts = grade_topk(path, cases, noise_kl, noise_err, note, settings, k)
    return CheckResult(name, worst(verdicts), f"{path} (top-{k}): " + "; ".join(parts), metrics), prompts


def grade_topk(path: str, cases: list[tuple[int, int, TopkMetrics]], noise_kl: float | None,
               noise_err: float | None, note: str | None, settings: LogitsSettings,
               k: int) -> tuple[list[Verdict], list[str], dict[str, Any], list[dict[str, Any]]]:
    """Verdicts, reason parts, metrics and per-prompt rows of per-prompt top-k metrics `cases` ((prompt
    index, position of row 0, metrics)) against the noise-scaled bounds: KL lower bound and logprob
    error graded by bounds.Bound, top-1 flips outside near ties FAIL, low top-k overlap WARNs."""
    kl = Bound(settings.kl_floor, settings.kl_factor, noise_kl, settings.fail_ratio)
    err = Bound(settings.abs_floor, settings.abs_factor, noise_err, settings.fail_ratio)
    tie = max(settings.top1_tie_floor, 2.0 * err.fail_limit)
    prompts = [_prompt(i, offset, m, kl, err, tie) for i, offset, m in cases]
    allm = [m for _, _, m in cases]

    def cat(attr: str) -> torch.Tensor:
        return torch.cat([getattr(m, attr) for m in allm])  # [T] per prompt -> [sum of T]

    max_kl, max_err = _max(cat("kl_lower")), _max(cat("lp_error"))
    top1, overlap = _mean(cat("top1_match")), _mean(cat("overlap"))
    flips = int((~cat("top1_match")).sum())
    bad = int(((~cat("top1_match")) & (cat("flip_gap") > tie)).sum())
    verdicts = [kl.grade(max_kl), err.grade(max_err)]
    parts = [kl.compare(f"KL lower bound (top-{k} + tail)", max_kl), err.compare("max logprob error", max_err),
             f"top-1 agreement {top1:.2f}", f"top-{k} overlap {overlap:.2f}"]
    if bad:
        verdicts.append(Verdict.FAIL)
        parts.append(f"{bad} top-1 flip(s) outside near ties of the reference top-{k} (gap > {tie:.1e})")
    elif flips:
        parts.append(f"{flips} top-1 flip(s) at near ties (benign)")
    if overlap < settings.topk_warn:
        verdicts.append(Verdict.WARN)
        parts.append(f"top-{k} overlap {overlap:.2f} < {settings.topk_warn:.2f}")
    if note:
        parts.append(note)
    first = next(({"prompt": p["index"], "position": p["first_diverging_position"]} for p in prompts
                  if p["first_diverging_position"] is not None), None)
    metrics: dict[str, Any] = {
        "path": path, "source": "top-k logprobs", "k": k, "positions": int(cat("kl_lower").numel()),
        "max_kl_lower_bound": json_float(max_kl), "max_logprob_error": json_float(max_err),
        "top1_agreement": top1, "topk_overlap": overlap, "top1_flips": flips, "benign_flips": flips - bad,
        "tie_bound": tie, "kl_bound": kl.to_dict(), "logprob_error_bound": err.to_dict(),
        "first_divergence": first, "noise_note": note}
    return verdicts, parts, metrics, prompts


def _prompt(index: int, offset: int, m: TopkMetrics, kl: Bound, err: Bound, tie: float) -> dict[str, Any]:
    bad_flip = ~m.top1_match & (m.flip_gap > tie)
    rows = ((m.kl_lower > kl.limit) | (m.lp_error > err.limit) | bad_flip).nonzero()  # diverging positions
    return {"index": index, "problem": None, "positions": int(m.kl_lower.numel()), "offset": offset,
            "max_kl": json_float(_max(m.kl_lower)), "max_logprob_error": json_float(_max(m.lp_error)),
            "top1_agreement": _mean(m.top1_match), "topk_overlap": _mean(m.overlap),
            "top1_flips": int((~m.top1_match).sum()), "benign_flips": int((~m.top1_match & ~bad_flip).sum()),
            "first_diverging_position": offset + int(rows[0, 0]) if rows.numel() else None,
            "kl": [json_float(float(x)) for x in m.kl_lower]}
