"""The checks a workload cell runs against itself (harness/compare/parity/schedule.py): the route checks, each
for the workload whose route it names (Workload.route), self_consistency for the workload that sends
prompts several times (harness/compare/parity/self_consistency.py), and decode_consistency for every workload.
On an engine that declares batch invariance (Capabilities.batch_invariant) batch_invariance and self_consistency
compare bitwise, tolerance zero (harness/compare/exact.py); the other routes change a request's own
arithmetic (cached blocks, chunks, a recomputation) and keep their noise bounds."""

from __future__ import annotations

from typing import Any

from harness.checks.context import CellContext
from harness.compare.exact import Twin, check_exact
from harness.compare.parity.schedule import GEN, TWIN, check_consistency, check_schedule, has_tensors
from harness.compare.parity.self_consistency import check_self_consistency, copies
from harness.compare.settings import ConsistencySettings, ScheduleSettings, SelfConsistencySettings
from harness.core.verdict import CheckResult, Verdict

# per route check: what it compares, and the engine stat that shows the route was taken
ROUTES: dict[str, tuple[str, str]] = {
    "batch_invariance": ("staggered into a running batch vs one batch", "max_running"),
    "prefix_cache": ("from cached prefix blocks vs computed", "prefix_hits"),
    "chunked_prefill": ("prefilled in chunks vs whole", "chunked_prompts"),
    "preemption": ("preempted and recomputed vs uninterrupted", "preemptions"),
}


def workload_entry(ctx: CellContext) -> dict[str, Any] | None:
    """The run manifest's entry of the cell's workload (harness/cases.py: workload_manifest), or None."""
    entries = ctx.par.manifest.get("workloads")
    if not isinstance(entries, list):
        return None
    return next((e for e in entries if isinstance(e, dict) and e.get("name") == ctx.info.workload), None)


def _route(ctx: CellContext, name: str) -> list[CheckResult]:
    what, stat = ROUTES[name]
    entry = workload_entry(ctx)
    if entry is None:
        return [CheckResult(name, Verdict.SKIP, f"workload {ctx.info.workload} sends no {name} route")]
    if entry.get("route") != name:
        return [CheckResult(name, Verdict.SKIP, f"workload {ctx.info.workload} takes no {name} route")]
    stats = entry.get("stats") or {}
    if stat not in stats:  # an engine behind HTTP: what it did inside (batches, hits, chunks) is not reported
        return [unknown_route(name, stat, stats, _schedule(ctx, name, what))]
    taken = stats.get(stat, 0) > (1 if stat == "max_running" else 0)
    if not taken:
        return [CheckResult(name, Verdict.SKIP, f"the engine took no {name} route on workload "
                            f"{ctx.info.workload} ({stat} = {stats.get(stat)})")]
    extra = {"route": {k: stats[k] for k in (stat, "steps") if k in stats}}
    return [_schedule(ctx, name, what, extra)]


def _schedule(ctx: CellContext, name: str, what: str, extra: dict[str, Any] | None = None) -> CheckResult:
    """The route's scheduled generations against their one-batch twins: bitwise on an engine that declares
    batch invariance (batch_invariance only), else within the noise bound."""
    if name == "batch_invariance" and ctx.par_caps.batch_invariant and has_tensors(ctx.par, (*GEN, *TWIN)):
        return check_exact(name, ctx.par, [Twin((c.index, TWIN), (c.index, GEN), "its one-batch twin")
                                           for c in ctx.par.cases], what,
                           extra)
    return check_schedule(name, ctx.par, ctx.noise_base, ctx.noise, ctx.settings.of(ScheduleSettings), what, extra,
                          ctx.jump_evidence)


def unknown_route(name: str, stat: str, stats: dict[str, Any], result: CheckResult) -> CheckResult:
    """The comparison of a run whose engine reports no route stats: a difference between the two schedules
    is a FAIL whatever route the engine took; agreement is a SKIP, since whether the route was taken (and so
    whether the agreement says anything about it) is unknown."""
    seen = stats.get("max_in_flight_seen")
    client = f"; the client had up to {seen} requests open at once" if seen is not None else ""
    unknown = f"the engine reports no {stat}, so whether it took the {name} route is unknown{client}"
    if result.verdict is not Verdict.PASS:
        return CheckResult(name, result.verdict, f"{result.reason} ({unknown})", result.metrics)
    return CheckResult(name, Verdict.SKIP, f"{unknown}; its outputs agree with the one-batch twin ({result.reason})",
                       result.metrics)


def batch_invariance(ctx: CellContext) -> list[CheckResult]:
    return _route(ctx, "batch_invariance")


def prefix_cache(ctx: CellContext) -> list[CheckResult]:
    return _route(ctx, "prefix_cache")


def chunked_prefill(ctx: CellContext) -> list[CheckResult]:
    return _route(ctx, "chunked_prefill")


def preemption(ctx: CellContext) -> list[CheckResult]:
    return _route(ctx, "preemption")


def self_consistency(ctx: CellContext) -> list[CheckResult]:
    entry = workload_entry(ctx)
    if entry is None or entry.get("route") != "self_consistency":
        return [CheckResult("self_consistency", Verdict.SKIP, f"workload {ctx.info.workload} sends no copies")]
    stats = entry.get("stats") or {}
    extra = {"route": {k: stats[k] for k in ("steps", "max_running") if k in stats}}
    if ctx.par_caps.batch_invariant and has_tensors(ctx.par, (*GEN, *TWIN)) and copies(ctx.par):
        groups = copies(ctx.par)
        twins = [Twin((g[0], GEN), (i, GEN), f"its first copy, request {g[0]}") for g in groups for i in g[1:]]
        twins += [Twin((g[0], GEN), (g[0], TWIN), "its one-batch twin") for g in groups]
        return [check_exact("self_consistency", ctx.par, twins, "copies and one-batch twins against the first copy",
                            extra)]
    return [check_self_consistency(ctx.par, ctx.noise_base, ctx.noise, ctx.settings.of(SelfConsistencySettings), extra,
                                   ctx.jump_evidence)]


def decode_consistency(ctx: CellContext) -> list[CheckResult]:
    if workload_entry(ctx) is None:
        return [CheckResult("decode_consistency", Verdict.SKIP, "the run holds no workload re-prefill")]
    sampled = (workload_entry(ctx) or {}).get("sampling") is not None  # its tokens are draws, not the top-1
    return [check_consistency(ctx.par, ctx.noise_base, ctx.noise, ctx.settings.of(ConsistencySettings), sampled,
                              None if sampled else ctx.jump_evidence)]
