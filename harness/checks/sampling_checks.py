"""The sampling checks of a cell whose workload samples (Workload.sampling; harness/compare/sampling.py):
the draws' distribution against the reference, the ranks' agreement, the seeded copies' equality."""

from __future__ import annotations

from typing import Any

from harness.checks.context import CellContext
from harness.checks.workload_checks import workload_entry
from harness.compare.sampling import check_distribution, check_ranks, check_seeded
from harness.compare.settings import SamplingSettings
from harness.core.verdict import CheckResult, Verdict
from harness.specs.sampling import SamplingParams
from harness.specs.workload import WORKLOADS


def sampling_of(ctx: CellContext) -> SamplingParams | None:
    """The cell's sampling settings, from the run manifest's workload entry (None: a greedy workload)."""
    entry: dict[str, Any] | None = workload_entry(ctx)
    if entry is None or not isinstance(entry.get("sampling"), dict):
        return None
    return SamplingParams.from_dict(entry["sampling"])


def _skip(name: str, ctx: CellContext) -> list[CheckResult]:
    return [CheckResult(name, Verdict.SKIP, f"workload {ctx.info.workload}: the run recorded no sampling settings")]


def sampling_distribution(ctx: CellContext) -> list[CheckResult]:
    params = sampling_of(ctx)
    if params is None:
        return _skip("sampling_distribution", ctx)
    logits = [r for r in ctx.results if r.name in ("logits_prefill", "logits_decode")]
    agree = bool(logits) and all(r.verdict in (Verdict.PASS, Verdict.WARN) for r in logits)
    return [check_distribution(ctx.ref, ctx.par, ctx.noise, ctx.noise_base, params, ctx.settings.of(SamplingSettings),
                               agree)]


def sampling_ranks(ctx: CellContext) -> list[CheckResult]:
    if sampling_of(ctx) is None:
        return _skip("sampling_ranks", ctx)
    return [check_ranks(ctx.par)]


def sampling_seeded(ctx: CellContext) -> list[CheckResult]:
    if sampling_of(ctx) is None or ctx.info.workload not in WORKLOADS:
        return _skip("sampling_seeded", ctx)
    return [check_seeded(ctx.par, WORKLOADS[ctx.info.workload].request_seeds())]
