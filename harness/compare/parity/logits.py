"""Teacher-forced logits parity: reference [T, V] vs parallel [T, V] logits, per position.

Verdict (bounds from LogitsSettings, noise-scaled, see bounds.Bound):
- FAIL: NaN/Inf in either run's logits, a shape mismatch, max KL or max abs error beyond
  fail_ratio x its bound, or a top-1 flip outside a near tie (reference logprob gap between the
  two tokens above max(top1_tie_floor, 2 x the max-abs FAIL bound): no accepted error explains it),
  or more near-tie flips than the noise run's flip rate explains (compare/parity/tie_flips.py: a one-sided
  test at tie_flips_alpha; systematic flips are not excused as ties). Each metric is also reported
  as a multiple of the measured noise.
- WARN: max KL or max abs error between its bound and fail_ratio x bound, or mean top-k overlap
  below topk_warn, or a noise run implausible for the dtype (its difference from the reference beyond
  what rounding explains, bounds.NoiseLimit, at more than half the positions; a prompt that goes beyond
  from one position on, a discontinuity such as an MoE routing tie, is measured before it): the reason
  names it, and the bounds then fall back to that rounding limit (or their floors, if larger) instead of
  scaling from the implausible run.
- PASS otherwise; ERROR when a run lacks the tensors; SKIP without prompts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from harness.compare.parity.bounds import Bound, NoiseLimit, json_float, noise_limit, reduction_floor
from harness.compare.parity.step_rounding import HALF_DTYPES, topology_ranks
from harness.compare.parity.tie_flips import tie_flip_test
from harness.compare.settings import LogitsSettings
from harness.core.errors import RunError
from harness.core.verdict import CheckResult, Verdict, worst
from harness.records.artifacts import RunArtifacts
from harness.records.contract import tensor_key

LOGITS_PATHS: tuple[str, ...] = ("prefill", "decode")


@dataclass(frozen=True)
class PositionMetrics:
    """Per-position metrics of one prompt; every tensor is [T] (float64 or bool)."""

    kl: torch.Tensor            # KL(ref || par) of the softmax distributions, nats
    max_abs: torch.Tensor       # max over the vocabulary of |ref - par|
    mean_abs: torch.Tensor      # mean over the vocabulary of |ref - par|
    top1_match: torch.Tensor    # argmax agrees
    flip_gap: torch.Tensor      # ref logprob of ref's top-1 minus ref logprob of par's top-1 (0 on match)
    topk_overlap: torch.Tensor  # |topk(ref) & topk(par)| / k


def position_metrics(ref: torch.Tensor, par: torch.Tensor, k: int) -> PositionMetrics:
    """Metrics of finite logits `ref` and `par` of equal shape [T, V], computed in float64."""
    ref64, par64 = ref.to(torch.float64), par.to(torch.float64)
    ref_lp = torch.log_softmax(ref64, dim=-1)  # [T, V]
    par_lp = torch.log_softmax(par64, dim=-1)  # [T, V]
    kl = (ref_lp.exp() * (ref_lp - par_lp)).sum(dim=-1).clamp_min(0.0)  # [T]
    diff = (ref64 - par64).abs()  # [T, V]
    ref_top1 = ref64.argmax(dim=-1)  # [T]
    par_top1 = par64.argmax(dim=-1)  # [T]
    flip_gap = (ref_lp.gather(-1, ref_top1[:, None]) - ref_lp.gather(-1, par_top1[:, None]))[:, 0]  # [T]
    k_eff = max(1, min(k, ref64.shape[-1]))
    ref_topk = ref64.topk(k_eff, dim=-1).indices  # [T, k]
    par_topk = par64.topk(k_eff, dim=-1).indices  # [T, k]
    shared = (ref_topk[:, :, None] == par_topk[:, None, :]).any(dim=-1).sum(dim=-1)  # [T]
    return PositionMetrics(kl=kl, max_abs=diff.amax(dim=-1), mean_abs=diff.mean(dim=-1),
                           top1_match=ref_top1 == par_top1, flip_gap=flip_gap,
                           topk_overlap=shared.to(torch.float64) / k_eff)


def nonfinite_problem(who: str, logits: torch.Tensor, offset: int = 0) -> str | None:
    """'parallel logits contain 3 NaN and 0 Inf values (first at position 6)' or None when all
    finite; row r of `logits` [T, V] is sequence position offset + r."""
    bad = ~torch.isfinite(logits)
    if not bool(bad.any()):
        return None
    n_nan = int(torch.isnan(logits).sum())
    first_row = int(bad.reshape(bad.shape[0], -1).any(dim=-1).nonzero()[0, 0]) if bad.dim() > 1 else 0
    row = logits.reshape(logits.shape[0], -1)[first_row] if bad.dim() > 1 else logits.reshape(-1)  # [V]
    token = int((~torch.isfinite(row)).nonzero()[0, 0])
    return (f"{who} logits contain {n_nan} NaN and {int(bad.sum()) - n_nan} Inf values "
            f"(first at position {offset + first_row}: {float(row[token])} at token {token})")


@dataclass(frozen=True)
class _Case:
    """One prompt's comparison: metrics, or the problem that prevented them."""

    index: int
    offset: int  # sequence position of row 0 (the decode start on the decode path)
    metrics: PositionMetrics | None
    problem: str | None


def _compare_case(kind: str, ref: RunArtifacts, other: RunArtifacts, who: str, index: int,
                  offset: int, k: int) -> _Case:
    """Raises RunError when a tensor is missing."""
    a, b = ref.tensor(kind, index), other.tensor(kind, index)
    problem = None
    if a.shape != b.shape:
        problem = f"{who} {kind} shape {list(b.shape)} != reference {list(a.shape)}"
    else:
        problem = nonfinite_problem("reference", a, offset) or nonfinite_problem(who, b, offset)
    if problem:
        return _Case(index=index, offset=offset, metrics=None, problem=f"prompt {index}: {problem}")
    return _Case(index=index, offset=offset, metrics=position_metrics(a, b, k), problem=None)


NOISE_KEEP_SHARE = 0.5  # a noise run whose plausible positions are fewer than this share of all is implausible


@dataclass(frozen=True)
class _Noise:
    """What the noise run differs from the reference by (Nones without a usable noise run)."""

    kl: float | None = None
    abs: float | None = None
    flips: int = 0
    positions: int = 0  # positions compared (0 without a usable noise run)
    note: str | None = None
    implausible: bool = False  # measured, but beyond rounding in the dtype: not used (a WARN)
    rounding: NoiseLimit | None = None  # with `implausible`: the largest noise rounding in the dtype explains
    cuts: tuple[tuple[int, int], ...] = ()  # (prompt index, first row beyond rounding): a discontinuity's tail
    tail_limit: NoiseLimit | None = None  # with `cuts`: the rounding limit the tails' rows are held to


class _NoiseMemo:
    """The noise levels measured for the latest PAIRS (reference, noise run) pairs, by (kind, k, cases): every cell of a
    (model, seed) compares against the same pair, and each cell's checks would measure them again (a matrix
    alternates between its seeds' pairs). Keyed on the pairs' tensor dicts themselves (held here, so their identities
    stay theirs) and their manifests' dtype."""

    PAIRS = 8

    def __init__(self) -> None:
        # (id(ref tensors), id(noise tensors)) -> (the two dicts, their levels), oldest first
        self._pairs: dict[tuple[int, int], tuple[tuple[Any, Any], dict[tuple[Any, ...], _Noise]]] = {}

    def get(self, kind: str, ref: RunArtifacts, noise: RunArtifacts, k: int) -> _Noise:
        ident = (id(ref.tensors), id(noise.tensors))
        held = self._pairs.pop(ident, None)
        if held is None or held[0][0] is not ref.tensors or held[0][1] is not noise.tensors:
            held = ((ref.tensors, noise.tensors), {})
        self._pairs[ident] = held  # the newest last
        while len(self._pairs) > self.PAIRS:
            del self._pairs[next(iter(self._pairs))]
        levels = held[1]
        key = (kind, k, tuple(c.index for c in ref.cases), ref.manifest.get("dtype"), noise.ok)
        if key not in levels:
            levels[key] = _measure_noise(kind, ref, noise, k)
        return levels[key]


_NOISE_MEMO = _NoiseMemo()


def _noise_levels(kind: str, ref: RunArtifacts, noise: RunArtifacts | None, k: int) -> _Noise:
    """Max KL, max abs error and top-1 flips of the reference against the noise run, or why not."""
    if noise is None:
        return _Noise()
    return _NOISE_MEMO.get(kind, ref, noise, k)


def _measure_noise(kind: str, ref: RunArtifacts, noise: RunArtifacts, k: int) -> _Noise:
    """_noise_levels of a noise run, measured. A prompt whose noise goes beyond rounding from some position on
    (a discontinuity: an MoE routing tie the other reduction order resolves the other way, carried by the later
    positions' attention or a recurrent state) is measured before that position; where that leaves fewer than
    NOISE_KEEP_SHARE of the positions, the run is implausible (a WARN)."""
    if not noise.ok:
        return _Noise(note="noise run failed")
    measured: list[tuple[int, PositionMetrics]] = []
    magnitude = 0.0
    try:
        for case in ref.cases:
            got = _compare_case(kind, ref, noise, "noise", case.index, 0, k)
            if got.metrics is None:
                return _Noise(note=f"noise run unusable: {got.problem}")
            measured.append((case.index, got.metrics))
            magnitude = max(magnitude, _max(ref.tensor(kind, case.index).abs()))
    except RunError as exc:
        return _Noise(note=f"noise run unusable: {exc}")
    limit = noise_limit(ref.manifest.get("dtype"), magnitude)
    kept = [(index, m, _plausible_prefix(m, limit)) for index, m in measured]
    total, plausible = sum(int(m.kl.numel()) for _, m in measured), sum(n for _, _, n in kept)
    if limit is not None and plausible < NOISE_KEEP_SHARE * total:
        max_kl = max((_max(m.kl) for _, m in measured), default=0.0)
        max_abs = max((_max(m.max_abs) for _, m in measured), default=0.0)
        problem = limit.problem(max_abs, max_kl) or f"beyond rounding at {total - plausible} of {total} positions"
        return _Noise(note=f"noise run {noise.path} implausible: {problem}, far beyond rounding; "
                           f"bounds fall back to the largest rounding the dtype explains", implausible=True,
                      rounding=limit)
    note = None
    cut = [(index, n) for index, m, n in kept if n < m.kl.numel()]
    if cut:
        where = ", ".join(f"prompt {index} from compared position {n}" for index, n in cut)
        note = (f"noise run beyond rounding at {total - plausible} of {total} positions ({where} on: a discontinuity "
                f"such as an MoE routing tie, carried by the later positions); noise measured on the "
                f"{plausible} positions before it")
    return _Noise(kl=max((_max(m.kl[:n]) for _, m, n in kept), default=0.0),
                  abs=max((_max(m.max_abs[:n]) for _, m, n in kept), default=0.0),
                  flips=sum(int((~m.top1_match[:n]).sum()) for _, m, n in kept), positions=plausible, note=note,
                  cuts=tuple(cut), tail_limit=limit if cut else None)


def _plausible_prefix(m: PositionMetrics, limit: NoiseLimit | None) -> int:
    """Positions of one prompt before its first beyond the rounding limit (all of them without a limit)."""
    if limit is None:
        return int(m.kl.numel())
    finite = torch.isfinite(m.max_abs) & torch.isfinite(m.kl)  # [T]
    beyond = ~finite | (m.max_abs > limit.abs_limit) | (m.kl > limit.kl_limit)  # [T]
    first = beyond.nonzero()
    return int(first[0, 0]) if first.numel() else int(m.kl.numel())


def _magnitude(kind: str, ref: RunArtifacts) -> float:
    """Max |logit| of the reference's finite `kind` tensors (0 without any)."""
    best = 0.0
    for case in ref.cases:
        key = tensor_key(kind, case.index)
        if key in ref.tensors:
            values = ref.tensors[key]
            finite = values[torch.isfinite(values)]
            best = max(best, float(finite.abs().max()) if finite.numel() else 0.0)
    return best


def _max(t: torch.Tensor) -> float:
    return float(t.max()) if t.numel() else 0.0


def _mean(t: torch.Tensor, empty: float = 0.0) -> float:
    return float(t.to(torch.float64).mean()) if t.numel() else empty


def _prompt_dict(case: _Case, kl: Bound, abs_: Bound, tie_bound: float, tails: "_Tails",
                 tail: torch.Tensor | None) -> dict[str, Any]:
    if case.metrics is None:
        return {"index": case.index, "problem": case.problem, "positions": 0, "first_diverging_position": None}
    m = case.metrics
    flips = ~m.top1_match
    bad_flips = flips & (m.flip_gap > tie_bound)
    kl_limit = kl.limit if tail is None else torch.where(tail, tails.kl.limit, kl.limit)  # [T] or a scalar
    abs_limit = abs_.limit if tail is None else torch.where(tail, tails.abs.limit, abs_.limit)
    diverging = (m.kl > kl_limit) | (m.max_abs > abs_limit) | bad_flips  # [T]
    rows = diverging.nonzero()
    return {
        "index": case.index, "problem": None, "positions": int(m.kl.numel()), "offset": case.offset,
        "max_kl": _max(m.kl), "mean_kl": _mean(m.kl),
        "max_abs": _max(m.max_abs), "mean_abs": _mean(m.mean_abs),
        "top1_agreement": _mean(m.top1_match, 1.0), "topk_overlap": _mean(m.topk_overlap, 1.0),
        "top1_flips": int(flips.sum()), "benign_flips": int((flips & ~bad_flips).sum()),
        "first_diverging_position": case.offset + int(rows[0, 0]) if rows.numel() else None,
        "kl": [float(x) for x in m.kl], "max_abs_per_position": [float(x) for x in m.max_abs],
    }


def check_logits(path: str, ref: RunArtifacts, par: RunArtifacts, noise: RunArtifacts | None,
                 settings: LogitsSettings, noise_ref: RunArtifacts | None = None,
                 ) -> tuple[CheckResult, list[dict[str, Any]]]:
    """Compare `{path}_logits.{i}` of every prompt; returns the check and one dict per prompt. The noise is `noise`
    against `noise_ref` (default: `ref`; compare/parity/noise_source.py)."""
    if path not in LOGITS_PATHS:
        raise ValueError(f"logits path {path!r} is not one of {LOGITS_PATHS}")
    name, kind = f"logits_{path}", f"{path}_logits"
    if not ref.cases:
        return CheckResult(name, Verdict.SKIP, f"{path}: no prompts"), []
    try:
        cases = [_compare_case(kind, ref, par, "parallel", c.index,
                               c.decode_start if path == "decode" else 0, settings.topk) for c in ref.cases]
    except RunError as exc:
        return CheckResult(name, Verdict.ERROR, f"{path}: {exc}"), []
    measured = _noise_levels(kind, ref if noise_ref is None else noise_ref, noise, settings.topk)
    # a noise run beyond rounding measured nothing usable (an isolated discontinuity such as an MoE routing tie, or a
    # broken run): the bounds are what rounding alone can explain in the dtype (bounds.NoiseLimit), never scaled
    # from that run
    kl_floor, abs_floor, why = settings.kl_floor, settings.abs_floor, "no noise run"
    if measured.rounding is not None:
        kl_floor, abs_floor = max(kl_floor, measured.rounding.kl_limit), max(abs_floor, measured.rounding.abs_limit)
        why = f"the noise run implausible: rounding in {measured.rounding.dtype}"
    noise_kl, noise_abs = measured.kl, measured.abs
    if measured.rounding is None and not noise_kl and not noise_abs:  # no noise, or zero: measures nothing
        floor = reduction_floor(ref.manifest.get("dtype"), _magnitude(kind, ref), topology_ranks(par))
        if floor is not None and floor.dtype in HALF_DTYPES and floor.abs_limit > abs_floor:
            kl_floor, abs_floor = max(kl_floor, floor.kl_limit), floor.abs_limit
            why = f"{why if noise_kl is None else 'the noise run measured zero'}: {floor.describe()}"
            noise_kl = noise_abs = None
    kl = Bound(kl_floor, settings.kl_factor, noise_kl, settings.fail_ratio, why)
    abs_ = Bound(abs_floor, settings.abs_factor, noise_abs, settings.fail_ratio, why)
    # each prompt's first sequence position beyond rounding in the noise run (a row of the noise comparison is the
    # same row of this path's tensor, whose row 0 is at the case's offset)
    offsets = {c.index: c.offset for c in cases}
    cuts, limit = {i: offsets[i] + row for i, row in measured.cuts if i in offsets}, measured.tail_limit
    if path == "decode":  # a discontinuity of the prefill noise marks the same positions of the decode path
        prefill = _noise_levels("prefill_logits", ref if noise_ref is None else noise_ref, noise, settings.topk)
        for index, position in prefill.cuts:
            cuts[index] = min(cuts.get(index, position), position)
        limit = limit or prefill.tail_limit
    tails = _Tails.of(cases, cuts, limit, kl, abs_, settings.fail_ratio)
    tie_bound = max(settings.top1_tie_floor, 2.0 * max(abs_.fail_limit, tails.abs.fail_limit))
    prompts = [_prompt_dict(c, kl, abs_, tie_bound, tails, tail) for c, tail in zip(cases, tails.masks)]
    return _verdict(name, path, cases, prompts, kl, abs_, tie_bound, settings, measured, tails), prompts


@dataclass(frozen=True)
class _Tails:
    """The rows of each prompt from its noise run's discontinuity on (`masks`, [T] bool per case, None where it
    has none): the noise run says nothing about them but that rounding is exceeded there, so they are held to the
    dtype's rounding limit (or the noise-scaled bound, if larger), the others to the noise-scaled bounds. `cuts`:
    per prompt index, the first sequence position of its tail."""

    masks: tuple[torch.Tensor | None, ...]
    kl: Bound
    abs: Bound

    @classmethod
    def of(cls, cases: list[_Case], cuts: dict[int, int], limit: NoiseLimit | None, kl: Bound, abs_: Bound,
           fail_ratio: float) -> "_Tails":
        masks = tuple(None if c.metrics is None or c.index not in cuts or limit is None
                      else c.offset + torch.arange(c.metrics.kl.numel()) >= cuts[c.index] for c in cases)  # [T]
        if limit is None:
            return cls(masks, kl, abs_)
        why = f"rounding in {limit.dtype} (after the noise run's discontinuity)"
        return cls(masks, Bound(max(kl.limit, limit.kl_limit), 1.0, None, fail_ratio, why),
                   Bound(max(abs_.limit, limit.abs_limit), 1.0, None, fail_ratio, why))


def _verdict(name: str, path: str, cases: list[_Case], prompts: list[dict[str, Any]], kl: Bound,
             abs_: Bound, tie_bound: float, settings: LogitsSettings, measured: _Noise, tails: _Tails) -> CheckResult:
    noise_note = measured.note
    problems = [c.problem for c in cases if c.problem]
    valid = [c.metrics for c in cases if c.metrics is not None]
    tail_rows = [t if t is not None else torch.zeros(c.metrics.kl.numel(), dtype=torch.bool)
                 for c, t in zip(cases, tails.masks) if c.metrics is not None]
    verdicts: list[Verdict] = [Verdict.FAIL] if problems else []
    parts = [problems[0] + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "")] if problems else []
    metrics: dict[str, Any] = {"path": path, "problems": problems, "k": settings.topk, "tie_bound": tie_bound,
                               "kl_bound": kl.to_dict(), "abs_bound": abs_.to_dict(), "first_divergence": None,
                               "noise_note": noise_note, "noise_flips": measured.flips,
                               "noise_implausible": measured.implausible}
    if measured.implausible:
        verdicts.append(Verdict.WARN)
    if valid:
        def cat(attr: str) -> torch.Tensor:
            return torch.cat([getattr(m, attr) for m in valid])  # [T] per prompt -> [sum of T]

        tail = torch.cat(tail_rows)  # [sum of T]: rows from a noise discontinuity on, held to tails' bounds
        max_kl, max_abs = _max(cat("kl")[~tail]), _max(cat("max_abs")[~tail])
        top1, topk = _mean(cat("top1_match"), 1.0), _mean(cat("topk_overlap"), 1.0)
        flips = sum(p.get("top1_flips", 0) for p in prompts)
        bad = flips - sum(p.get("benign_flips", 0) for p in prompts)
        first = next(({"prompt": p["index"], "position": p["first_diverging_position"]} for p in prompts
                      if p["first_diverging_position"] is not None), None)
        verdicts += [kl.grade(max_kl), abs_.grade(max_abs)]
        parts += [kl.compare("max KL", max_kl), abs_.compare("max abs", max_abs), f"top-1 agreement {top1:.2f}"]
        if bool(tail.any()):
            tail_kl, tail_abs = _max(cat("kl")[tail]), _max(cat("max_abs")[tail])
            verdicts += [tails.kl.grade(tail_kl), tails.abs.grade(tail_abs)]
            parts.append(f"{int(tail.sum())} rows after the noise run's discontinuity: "
                         f"{tails.kl.compare('max KL', tail_kl)}, {tails.abs.compare('max abs', tail_abs)}")
            metrics.update({"tail_rows": int(tail.sum()), "tail_max_kl": tail_kl, "tail_max_abs": tail_abs})
        positions = int(cat("kl").numel())
        ties = tie_flip_test(settings, flips - bad, positions, measured.flips, measured.positions)
        metrics.update(ties.metrics())
        if bad:
            verdicts.append(Verdict.FAIL)
            parts.append(f"{bad} top-1 flip(s) outside near ties (gap > {tie_bound:.1e})")
        if ties.fails:
            verdicts.append(Verdict.FAIL)
            parts.append(f"{ties.describe()}: systematic, not noise")
        elif ties.flips and not bad:
            parts.append(f"{ties.flips} top-1 flip(s) at near ties (benign)")
        if topk < settings.topk_warn:
            verdicts.append(Verdict.WARN)
            parts.append(f"top-{settings.topk} overlap {topk:.2f} < {settings.topk_warn:.2f}")
        metrics.update({"positions": positions, "max_kl": max_kl, "mean_kl": _mean(cat("kl")),
                        "max_abs": max_abs, "mean_abs": _mean(cat("mean_abs")), "top1_agreement": top1,
                        "topk_overlap": topk, "top1_flips": flips, "benign_flips": flips - bad,
                        "first_divergence": first, "kl_noise_multiple": kl.noise_multiple(max_kl),
                        "abs_noise_multiple": abs_.noise_multiple(max_abs)})
    if noise_note:
        parts.append(noise_note)
    verdict = worst(verdicts) if verdicts else Verdict.PASS
    return CheckResult(name, verdict, f"{path}: " + "; ".join(parts), {k: _jsonable(v) for k, v in metrics.items()})


def _jsonable(value: Any) -> Any:
    return json_float(value) if isinstance(value, float) else value
