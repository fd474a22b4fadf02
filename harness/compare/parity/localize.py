"""Localization of a parity failure: the first diverging layer, then the diverging heads in it.

Relative L2 error, in float64, of the parallel run against the reference:
- residual stream hidden.{i} [L+1, P, H]: per hidden index, the max over prompts and probe
  positions of |par - ref| / |ref| over H (index 0 is the embedding output, index l+1 layer l);
- attention output attn.{i} [L, P, heads, head_dim]: per layer and head, the same over head_dim.
Before that, the collectives (harness/compare/parity/collectives.py): the first (layer, site) in execution
order whose output on some rank differs from an exact float64 recompute from its inputs beyond what
rounding in the model dtype allows names the communication step and its ranks. The noise floor is
the same error of the noise run (the reference topology with another reduction order) against the
reference; a value diverges above max(rel_floor, factor x noise) (per hidden index; per layer for
heads, the noise being the layer's largest head error). Non-finite errors count as diverging. The
divergence is placed where it began (`onset`): the earliest hidden index of the unbroken run, ending at
the first one over its bound, whose errors all stand above onset_factor x their own noise.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

from harness.compare.parity.bounds import Bound, json_float
from harness.compare.parity.collectives import collective_errors, describe, first_broken
from harness.compare.parity.collectives import details as collective_details
from harness.compare.parity.hybrid_localize import FULL, hybrid_layer_kind, hybrid_localization
from harness.compare.settings import CollectiveSettings, LocalizationSettings
from harness.core.errors import RunError
from harness.core.fmt import id_ranges
from harness.core.verdict import Localization
from harness.partition.layout import LayoutPlan, kv_of_q
from harness.records.artifacts import Case, RunArtifacts
from harness.records.contract import ATTN, HIDDEN
from harness.records.rankreport import LayoutSchemaError, read_ranks

_TINY = 1e-30


def relative_error(ref: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """|other - ref| / |ref| along the last dim, float64; NaN becomes +inf."""
    ref64, other64 = ref.to(torch.float64), other.to(torch.float64)
    err = (other64 - ref64).norm(dim=-1) / ref64.norm(dim=-1).clamp_min(_TINY)
    return torch.nan_to_num(err, nan=math.inf)


def layer_errors(ref: RunArtifacts, other: RunArtifacts, cases: Sequence[Case]) -> torch.Tensor:
    """[L+1] max over prompts and probe positions of the residual-stream relative error."""
    per_case = [relative_error(ref.tensor(HIDDEN, c.index), other.tensor(HIDDEN, c.index)).amax(dim=-1)
                for c in cases]  # each [L+1, P] -> [L+1]
    return torch.stack(per_case).amax(dim=0)  # [cases, L+1] -> [L+1]


def head_errors(ref: RunArtifacts, other: RunArtifacts, cases: Sequence[Case]) -> torch.Tensor:
    """[L, heads] max over prompts and probe positions of the attention-output relative error."""
    per_case = [relative_error(ref.tensor(ATTN, c.index), other.tensor(ATTN, c.index)).amax(dim=1)
                for c in cases]  # each [L, P, heads] -> [L, heads]
    return torch.stack(per_case).amax(dim=0)  # [cases, L, heads] -> [L, heads]


def _floats(t: torch.Tensor) -> list[Any]:
    return [_floats(row) for row in t] if t.dim() > 1 else [json_float(float(x)) for x in t]


def _noise(fn: Any, ref: RunArtifacts, noise: RunArtifacts | None, cases: Sequence[Case]) -> torch.Tensor | None:
    if noise is None or not noise.ok:
        return None
    try:
        return fn(ref, noise, cases)
    except (RunError, RuntimeError):
        return None


def _bounds(count: int, noise: torch.Tensor | None, settings: LocalizationSettings) -> list[float]:
    """One bound per entry: max(rel_floor, factor x noise), or rel_floor without a noise run."""
    noises: list[float | None] = [None] * count if noise is None else [float(n) for n in noise]
    return [Bound(settings.rel_floor, settings.factor, n).limit for n in noises]


def _listed(values: torch.Tensor | None) -> list[float] | None:
    return None if values is None else [float(v) for v in values]


def onset(errors: Sequence[float], noise: Sequence[float] | None, crossed: int,
          settings: LocalizationSettings) -> int:
    """The hidden index where the divergence that first crosses its bound at `crossed` began: walking back
    from `crossed`, the earliest index of the unbroken run of indices each above max(rel_floor, onset_factor
    x its own noise). A bug's error stands far above the noise where it enters even when it is still under
    that index's bound there (e.g. a half-precision run whose noise run measured more on one CPU's kernels
    than on another's), while a correct index sits near 1x its noise."""
    if noise is None:
        return crossed
    start = crossed
    while start > 0 and errors[start - 1] > max(settings.rel_floor, settings.onset_factor * noise[start - 1]):
        start -= 1
    return start


def _owners(plan: LayoutPlan, heads: Sequence[int]) -> list[int]:
    owner = {q: r.rank for r in plan.ranks for q in r.q_heads}
    return [owner[h] for h in heads]


def actual_reads(par: RunArtifacts, plan: LayoutPlan) -> dict[int, set[int]]:
    """Global Q head -> the KV heads the parallel run really read for it, on every rank that attends
    it (its DCP group's members); the planned KV head where the run recorded nothing."""
    reads: dict[int, set[int]] = {}
    target = par.layout.get("target")
    try:
        ranks = read_ranks(target, "layout.json target") if target and target.get("ranks") else ()
    except LayoutSchemaError:  # the layout check says what is wrong with it; localize by the plan
        ranks = ()
    for rank in ranks:
        for q, kv in zip(rank.group_q_heads, rank.group_q_to_kv):
            reads.setdefault(q, set()).add(kv)
    return {q: reads.get(q) or {kv_of_q(plan.shape, q)} for q in range(plan.shape.heads)}


def _head_summary(layer: int, heads: list[int], plan: LayoutPlan,
                  reads: dict[int, set[int]]) -> tuple[list[int], list[int], str]:
    ranks = sorted(set(_owners(plan, heads)))
    kv = sorted(set().union(*(reads[h] for h in heads)))
    groups = sorted({plan.ranks[r].dcp_group for r in ranks})
    group_text = (f" (DCP group{'s' if len(groups) > 1 else ''} {id_ranges(groups)})" if plan.dcp > 1 else "")
    summary = (f"layer {layer} attention: heads {id_ranges(heads)} on rank{'s' if len(ranks) > 1 else ''} "
               f"{id_ranges(ranks)}{group_text} diverge")
    misread = [h for h in heads if reads[h] != {kv_of_q(plan.shape, h)}]
    if misread:  # name the wrong reads, not every KV head the heads touch (that narrows nothing)
        h = misread[0]
        wrong = sorted(set().union(*(reads[q] - {kv_of_q(plan.shape, q)} for q in misread)))
        summary += (f"; heads {id_ranges(misread)} read the wrong KV heads (e.g. head {h} reads "
                    f"{id_ranges(reads[h])}, planned {kv_of_q(plan.shape, h)}); wrong reads of "
                    f"KV head{'s' if len(wrong) > 1 else ''} {id_ranges(wrong)}")
    else:
        summary += f"; reads KV head{'s' if len(kv) > 1 else ''} {id_ranges(kv)}"
    return ranks, kv, summary


def held_off_at(held_off: Sequence[Mapping[str, Any]], layer: int | None) -> tuple[list[str], list[int], list[str]]:
    """(sub-blocks, ranks, tensors) of the layout check's tensors held off the plan (layout_check metrics
    "params_off") that layer `layer`'s computation reads (None: those outside the layers)."""
    hits = [p for p in held_off if (p.get("layer") == layer if layer is None
                                    else layer in (p.get("used_in") or [p.get("layer")]))]
    return (list(dict.fromkeys(str(p["block"]) for p in hits)), sorted({int(p["rank"]) for p in hits}),
            list(dict.fromkeys(str(p["param"]) for p in hits)))


def _sub_block_text(held_off: Sequence[Mapping[str, Any]], layer: int) -> str | None:
    blocks, ranks, params = held_off_at(held_off, layer)
    if not blocks:
        return None
    more = f" (+{len(params) - 2} more)" if len(params) > 2 else ""
    return (f"the {' and the '.join(blocks)}: {', '.join(params[:2])}{more} held off the plan on "
            f"rank{'s' if len(ranks) > 1 else ''} {id_ranges(ranks)}")


def localize(ref: RunArtifacts, par: RunArtifacts, noise: RunArtifacts | None, plan: LayoutPlan,
             cases: Sequence[Case], settings: LocalizationSettings,
             collective_settings: CollectiveSettings | None = None,
             held_off: Sequence[Mapping[str, Any]] = (),
             noise_ref: RunArtifacts | None = None) -> tuple[Localization | None, dict[str, Any]]:
    """The first diverging layer and heads (None when every layer is within its bound) and the
    details: {"layer_errors": {error, noise, threshold}, "head_errors": {error, noise, threshold,
    owner_ranks, kv_heads}} with one entry per hidden index / layer (non-finite values as None).
    `held_off`: the layout check's tensors held off the plan (metrics "params_off"); where a layer's
    residual stream diverges while its heads stay within noise, the sub-block whose tensors the layer
    reads off the plan is named (e.g. the attention output projection, not the MLP). The noise is `noise` against
    `noise_ref` (default: `ref`; compare/parity/noise_source.py)."""
    base = ref if noise_ref is None else noise_ref
    if not cases:
        return None, {"note": "no prompts"}
    try:
        hidden = layer_errors(ref, par, cases)  # [L+1]
    except (RunError, RuntimeError) as exc:
        return None, {"note": f"no hidden states to localize with: {exc}"}
    hidden_noise = _noise(layer_errors, base, noise, cases)
    hidden_limit = _bounds(len(hidden), hidden_noise, settings)
    details: dict[str, Any] = {"layer_errors": {
        "error": _floats(hidden), "noise": None if hidden_noise is None else _floats(hidden_noise),
        "threshold": hidden_limit}}
    try:
        heads = head_errors(ref, par, cases)  # [L, heads]
    except (RunError, RuntimeError) as exc:
        heads = None
        details["note"] = f"no attention outputs: {exc}"
    head_limit: list[float] = []
    if heads is not None:
        head_noise = _noise(head_errors, base, noise, cases)
        head_limit = _bounds(heads.shape[0], None if head_noise is None else head_noise.amax(dim=-1), settings)
        all_heads = range(heads.shape[-1])
        details["head_errors"] = {
            "error": _floats(heads), "noise": None if head_noise is None else _floats(head_noise),
            "threshold": head_limit, "owner_ranks": _owners(plan, all_heads),
            "kv_heads": [kv_of_q(plan.shape, h) for h in all_heads]}  # as planned; the summary names actual reads
    crossed = next((j for j, (e, t) in enumerate(zip(hidden.tolist(), hidden_limit)) if not e <= t), None)
    first = None if crossed is None else onset(hidden.tolist(), _listed(hidden_noise), crossed, settings)
    coll = collective_settings or CollectiveSettings()
    errors = collective_errors(par, cases)
    broken = None
    if errors is not None:
        details["collectives"] = collective_details(errors, plan.tp, coll)
        broken = first_broken(errors, plan.tp, coll)
    if broken is not None and (first is None or broken["layer"] <= first - 1):
        ranks, layer = broken["ranks"], broken["layer"]
        bad = ([h for h, e in enumerate(heads[layer].tolist()) if not e <= head_limit[layer]]
               if heads is not None and broken["site"].startswith("dcp-") else [])  # heads the attention step broke
        summary = describe(broken) + " (a communication step, not the computation around it)"
        return Localization(layer=layer, heads=tuple(bad), ranks=tuple(ranks), kv_heads=(), summary=summary), details
    if first is None:
        return None, details
    err = f"rel err {hidden[first]:.1e} > {hidden_limit[first]:.1e}"
    if first != crossed and hidden_noise is not None:  # the divergence began under its bound
        assert crossed is not None
        where = "the embedding output" if crossed == 0 else f"layer {crossed - 1}"
        err = (f"rel err {hidden[first]:.1e}, {float(hidden[first] / hidden_noise[first]):.0f}x its noise and "
               f"{float(hidden[first]) / hidden_limit[first]:.2f} of its bound {hidden_limit[first]:.1e}; the bound "
               f"is first crossed at {where}: {hidden[crossed]:.1e} > {hidden_limit[crossed]:.1e}")
    if first == 0:
        return Localization(layer=-1, heads=(), ranks=(), kv_heads=(),
                            summary=f"embeddings: the embedding output already differs ({err})"), details
    layer = first - 1
    bad = ([h for h, e in enumerate(heads[layer].tolist()) if not e <= head_limit[layer]]
           if heads is not None and layer < heads.shape[0] else [])
    kind = hybrid_layer_kind(par, layer)
    if kind is not None and not (kind == FULL and bad):  # a hybrid model: the layer's kind and sublayer
        return hybrid_localization(layer, kind, bool(bad), err), details
    if not bad:
        named = _sub_block_text(held_off, layer)
        _, off_ranks, _ = held_off_at(held_off, layer)
        return Localization(layer=layer, heads=(), ranks=tuple(off_ranks), kv_heads=(), summary=(
            f"layer {layer}: residual stream diverges ({err}) while its attention heads stay within "
            f"noise: " + (named or "MLP, norm or residual"))), details
    ranks, kv, summary = _head_summary(layer, bad, plan, actual_reads(par, plan))
    return Localization(layer=layer, heads=tuple(bad), ranks=tuple(ranks), kv_heads=tuple(kv),
                        summary=summary), details


def output_head(layer_errors: dict[str, Any], failing: Sequence[str] = ("logits_prefill",),
                held_off: Sequence[Mapping[str, Any]] = ()) -> Localization:
    """A parity FAIL whose residual stream stays within its bound at every layer of the teacher-forced
    prompts (`localize` found nothing). `failing`: the parity checks that FAIL; `held_off`: the layout
    check's tensors held off the plan. The output head (final norm, vocab-parallel lm_head shards, logits
    all-gather) when its tensors are held off the plan or the prefill logits themselves FAIL; otherwise a
    cache route: the same prompts' logits agree when computed in one prefill, and only what is read back
    from the KV cache or state (decode steps, prefix hits, reused slots) diverges, which the output head,
    shared by both, cannot explain. layer_errors: localize's details["layer_errors"]."""
    errors, limits = layer_errors["error"], layer_errors["threshold"]
    worst = max((e / t for e, t in zip(errors, limits) if e is not None and t), default=0.0)
    blocks, ranks, params = held_off_at(held_off, None)
    if "logits_prefill" in failing or params:
        off = (f"; {', '.join(params[:2])} held off the plan on rank{'s' if len(ranks) > 1 else ''} "
               f"{id_ranges(ranks)}" if params else "")
        return Localization(layer=len(errors) - 1, heads=(), ranks=tuple(ranks), kv_heads=(), summary=(
            f"output head: every layer's residual stream stays within its bound (at most {worst:.2f}x), so the "
            f"final norm, the vocab-parallel lm_head shards or the logits all-gather{off}"))
    return Localization(layer=-1, heads=(), ranks=(), kv_heads=(), summary=(
        f"a cache route: every layer's residual stream (at most {worst:.2f}x its bound) and the prefill logits "
        f"stay within bounds, only {', '.join(failing)} diverge: what is written to and read back from the KV "
        f"cache or state (decode steps, prefix hits, reused slots), not the output head both share"))
