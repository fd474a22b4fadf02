"""The collectives check: each communication step against an exact recompute from its own inputs.

The engine records, on its captured decode path, every rank's error of each collective's output
(collectives.{i} [tp, L, P, sites], contract.COLLECTIVES) in unit roundoffs u of the model dtype:
all-reduces per element relative to the sum of the partials' |values|, the DCP Q gather and LSE
merge normwise. Rounding analysis bounds a correct step (CollectiveSettings.bound: a sum of tp
partials rounds at most tp - 1 times in any order), so unlike the logits check this needs no noise
run, and it catches what logits near their noise hide: an all-reduce done in a lower precision than
the model's (bf16 partials of a float16 model at tp2 move the logits by ~3x noise only).

Verdict: FAIL when any site on any rank leaves its bound (the first in execution order is named,
with its ranks); PASS otherwise, with the largest error as a fraction of its bound; SKIP for a run
without collectives (tp1) or without recorded errors.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from harness.compare.parity.bounds import json_float
from harness.compare.settings import CollectiveSettings
from harness.core.errors import RunError
from harness.core.fmt import id_ranges
from harness.core.verdict import CheckResult, Verdict
from harness.records.artifacts import Case, RunArtifacts
from harness.records.contract import COLLECTIVE_SITES, COLLECTIVES

SITE_TEXT: dict[str, str] = {
    "dcp-q-gather": "DCP Q all-gather (a rank's own Q heads are not where the gather puts them)",
    "dcp-lse-merge": "DCP LSE merge of the partial attention outputs",
    "attn-allreduce": "TP all-reduce of the attention output projection",
    "mlp-allreduce": "TP all-reduce of the MLP down projection",
}
SITE_UNIT: dict[str, str] = {  # what the recorded error is a multiple of, per site
    "dcp-q-gather": "u x |exact|", "dcp-lse-merge": "u x |exact|",
    "attn-allreduce": "u x sum|partials|", "mlp-allreduce": "u x sum|partials|",
}


def collective_errors(par: RunArtifacts, cases: Sequence[Case]) -> torch.Tensor | None:
    """[tp, L, sites]: the max over prompts and probe positions of collectives.{i}, or None when the
    run recorded none."""
    try:
        per_case = [par.tensor(COLLECTIVES, c.index).to(torch.float64).amax(dim=2) for c in cases]  # [tp, L, sites]
    except RunError:
        return None
    return torch.stack(per_case).amax(dim=0) if per_case else None  # [cases, tp, L, sites] -> [tp, L, sites]


def site_bounds(tp: int, settings: CollectiveSettings) -> list[float]:
    return [settings.bound(site, tp) for site in COLLECTIVE_SITES]


def first_broken(errors: torch.Tensor, tp: int, settings: CollectiveSettings) -> dict[str, Any] | None:
    """The first (layer, site) in execution order whose error [tp, L, sites] leaves its bound on some
    rank: {layer, site, ranks, error, bound}; None when every collective is within rounding."""
    bounds = site_bounds(tp, settings)
    for layer in range(errors.shape[1]):
        for s, site in enumerate(COLLECTIVE_SITES):
            column = errors[:, layer, s]  # [tp]
            ranks = [r for r, e in enumerate(column.tolist()) if not e <= bounds[s]]
            if ranks:
                return {"layer": layer, "site": site, "ranks": ranks, "error": float(column.max()),
                        "bound": bounds[s]}
    return None


def describe(broken: dict[str, Any]) -> str:
    """'layer 0: TP all-reduce of the attention output projection is wrong on ranks 0-1: ...'."""
    ranks = broken["ranks"]
    return (f"layer {broken['layer']}: {SITE_TEXT[broken['site']]} is wrong on rank{'s' if len(ranks) > 1 else ''} "
            f"{id_ranges(ranks)}: its output differs from an exact recompute from its inputs by "
            f"{broken['error']:.1f} {SITE_UNIT[broken['site']]} > {broken['bound']:.1f}, more than a correct "
            f"step in the model dtype can round (a lower-precision or wrong collective)")


def details(errors: torch.Tensor, tp: int, settings: CollectiveSettings) -> dict[str, Any]:
    """For the report: the sites, their bounds and the error [L, sites] (max over ranks)."""
    return {"sites": list(COLLECTIVE_SITES), "bounds": site_bounds(tp, settings), "units": "unit roundoffs",
            "error": [[json_float(float(x)) for x in row] for row in errors.amax(dim=0)]}


def check_collectives(par: RunArtifacts, cases: Sequence[Case], tp: int, dcp: int,
                      settings: CollectiveSettings) -> CheckResult:
    if tp == 1 and dcp == 1:
        return CheckResult("collectives", Verdict.SKIP, "tp1: no collectives")
    errors = collective_errors(par, cases)
    if errors is None:
        return CheckResult("collectives", Verdict.SKIP, "the run recorded no collective errors (collectives.{i})")
    metrics = details(errors, tp, settings)
    broken = first_broken(errors, tp, settings)
    if broken is not None:
        return CheckResult("collectives", Verdict.FAIL, describe(broken), {**metrics, "first_broken": broken})
    ratios = errors.amax(dim=0) / torch.tensor(site_bounds(tp, settings), dtype=torch.float64)  # [L, sites]
    worst = int(ratios.argmax())
    layer, s = divmod(worst, len(COLLECTIVE_SITES))
    fraction = float(ratios.flatten()[worst])
    metrics["max_fraction_of_bound"] = json_float(fraction)
    return CheckResult("collectives", Verdict.PASS, (
        f"every collective within rounding of an exact recompute; largest {fraction:.2f} of its bound "
        f"({COLLECTIVE_SITES[s]}, layer {layer})"), metrics)
