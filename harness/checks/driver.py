"""Runs the registered checks of one cell: skips what the engines cannot support or the suite
switched off, and turns any exception inside a check into an ERROR for that check alone (traceback
in its metrics), so the other checks and cells keep their verdicts."""

from __future__ import annotations

import traceback
from dataclasses import replace
from typing import Callable

from harness.checks.builtin import finish_details
from harness.checks.catalog import CheckSpec, registered_checks
from harness.checks.context import CellContext
from harness.core.plugins import load_target
from harness.core.verdict import CheckResult, Verdict
from harness.specs.workload import WORKLOADS

CheckFn = Callable[[CellContext], list[CheckResult]]


def load(spec: CheckSpec) -> CheckFn:
    fn: CheckFn = load_target(spec.target)
    return fn


def belongs(spec: CheckSpec, ctx: CellContext) -> bool:
    """Whether the check is part of this cell at all (speculative checks only in -draft/-mtp cells)."""
    if spec.cells == "speculative":
        return ctx.info.speculator != "none"
    if spec.cells == "gsm8k":
        return ctx.gsm8k is not None
    if spec.cells == "route":
        return ctx.info.workload in WORKLOADS and WORKLOADS[ctx.info.workload].route == spec.name
    if spec.cells == "workloads":
        return bool(ctx.info.workloads_run)
    if spec.cells == "pd":
        return ctx.pd_plan is not None
    if spec.cells == "sampling":
        return ctx.info.workload in WORKLOADS and WORKLOADS[ctx.info.workload].sampling is not None
    if spec.cells == "teacher_forced":
        return ctx.info.workload not in WORKLOADS or not WORKLOADS[ctx.info.workload].route
    return True


def check_names(ctx: CellContext) -> list[str]:
    return [spec.name for spec in registered_checks() if belongs(spec, ctx)]


def failed_run(ctx: CellContext) -> str | None:
    for who, run in (("reference", ctx.ref), ("parallel", ctx.par)):
        if not run.ok:
            return f"{who} run failed: {run.manifest.get('error') or 'no error text'}"
    return None


def run_check(spec: CheckSpec, ctx: CellContext) -> list[CheckResult]:
    """One check: SKIP when switched off or a need is unmet, ERROR with the traceback when it raises."""
    if not ctx.enabled(spec.section):
        return [CheckResult(spec.name, Verdict.SKIP,
                            f"switched off by the suite (checks.{spec.section}.enabled: false)")]
    missing = ctx.missing(spec.requires, spec.requires_any)
    if missing:
        return [CheckResult(spec.name, Verdict.SKIP, f"{missing}: {spec.name} unavailable",
                            {"requires": spec.needs()})]
    try:
        results = list(load(spec)(ctx))
    except Exception as exc:  # a broken check must not take the cell's other verdicts with it
        return [CheckResult(spec.name, Verdict.ERROR, f"check raised {type(exc).__name__}: {exc}",
                            {"traceback": traceback.format_exc()})]
    if spec.performance_only:
        results = [replace(r, performance_only=True) for r in results]
    return [_sourced(r, ctx.noise_source) for r in results] if spec.reads_noise and ctx.noise_source else results


def _sourced(result: CheckResult, source: str) -> CheckResult:
    """A verdict whose bounds scaled from the cell's noise, naming where that noise came from (reason and metrics)."""
    if result.verdict not in (Verdict.PASS, Verdict.WARN, Verdict.FAIL):
        return result
    return replace(result, reason=f"{result.reason}; {source}", metrics={**result.metrics, "noise_source": source})


def run_checks(ctx: CellContext) -> list[CheckResult]:
    """Every check of the cell in registry order; ctx.details and ctx.localization are filled in."""
    failed = failed_run(ctx)
    if failed:
        return [CheckResult(name, Verdict.ERROR, failed) for name in check_names(ctx)]
    ctx.noise = ctx.noise if ctx.noise is not None and ctx.noise.ok else None
    for spec in registered_checks():
        if belongs(spec, ctx):
            ctx.results.extend(run_check(spec, ctx))
    try:
        finish_details(ctx)
    except Exception:  # details are for the report; verdicts stand without them
        ctx.details.note = "details unavailable: " + traceback.format_exc(limit=2)
    return ctx.results
