"""features_on: the cell proves, from the engine's own report, that it ran every route it asked for.

A feature that is silently off passes every parity check (SGLang #30968: a masked error disabled a
fusion, so CI tested the wrong path), and a route check whose route was not taken is only a SKIP. This
check makes a requested feature that did not run a FAIL naming it. What each cell requests and where the
proof comes from:

- tp (tp > 1): the run reports tp ranks whose Q heads differ (layout.json's rank reports);
- dcp (dcp > 1): every rank reports a DCP group of dcp members, and where it reports the positions it
  stored of the probe sequence (RankReport.stored_positions), no rank whose placement share is less than
  the whole sequence stored all of it (a probe inside one interleave chunk cannot show the split: SKIP);
- placement (dcp > 1, with stored positions): what each rank stored is the placement's share
  (harness/compare/layout/placement.py);
- ep (ep > 1): the MoE ranks route different experts and none routes them all (RankReport.hybrid.moe);
- the cell's workload route (prefix_cache, chunked_prefill, preemption, batch_invariance): the engine's
  stat for it in the manifest's workload entry (prefix_hits, chunked_prompts, preemptions, max_running > 1);
  an engine that declares the route impossible in this configuration (the embedded engine's
  prefix_cacheable = 0: a hybrid model, the contiguous DCP placement) makes it unverifiable, not off;
- speculator (-draft / -mtp): verify steps in the per-step traces, or the engine's spec-decode counters.

Verdict: FAIL when a requested feature did not run (each named); SKIP when none failed but one could not be
verified (an HTTP engine without a layout probe reports no ranks; over HTTP the route stats are the
client's only), naming what is missing; PASS when every requested feature is proven on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from harness.checks.context import CellContext
from harness.checks.workload_checks import ROUTES, workload_entry
from harness.compare.layout.placement import placement_problems
from harness.compare.speculative import has_traces, speculative_manifest
from harness.core.errors import ConfigError, RunError
from harness.core.verdict import CheckResult, Verdict
from harness.partition.layout import local_positions
from harness.records.contract import SPEC_ACCEPTED
from harness.records.rankreport import RankReport, read_ranks
from harness.specs.topology import Topology

NAME = "features_on"


@dataclass(frozen=True)
class Feature:
    """One requested feature: whether it ran (True / False / None: unknown) and the evidence or what is missing."""

    name: str
    ran: bool | None
    why: str


def _ranks(ctx: CellContext) -> tuple[RankReport, ...] | None:
    entry = ctx.par.layout.get("target")
    if not isinstance(entry, Mapping) or not entry.get("ranks"):
        return None
    return read_ranks(entry, "layout.json target")


def _no_ranks(ctx: CellContext, name: str) -> Feature:
    return Feature(name, None, f"engine {ctx.info.engine} reports no ranks (layout.json has no rank reports)")


def tp_feature(ctx: CellContext, topo: Topology, ranks: tuple[RankReport, ...] | None) -> Feature:
    if ranks is None:
        return _no_ranks(ctx, "tp")
    heads = {r.q_heads for r in ranks}
    if len(ranks) != topo.tp or len(heads) < 2:
        return Feature("tp", False, f"tp={topo.tp} requested; the engine reports {len(ranks)} ranks holding "
                                    f"{len(heads)} distinct Q head sets")
    return Feature("tp", True, f"{len(ranks)} ranks hold {len(heads)} distinct Q head sets")


def dcp_feature(ctx: CellContext, topo: Topology, ranks: tuple[RankReport, ...] | None) -> Feature:
    if ranks is None:
        return _no_ranks(ctx, "dcp")
    sizes = sorted({len(r.dcp_members) for r in ranks})
    if sizes != [topo.dcp]:
        return Feature("dcp", False, f"dcp={topo.dcp} requested; the ranks report DCP groups of "
                                     f"{'/'.join(map(str, sizes))} members")
    # ranks whose placement share of the probe sequence is less than all of it: where a split is observable
    split = [(r, sp) for r in ranks if (sp := r.stored_positions) is not None
             and len(local_positions(sp.length, r.dcp_rank, topo.dcp, ctx.plan.placement, sp.prompt_len)) < sp.length]
    whole = [r.rank for r, sp in split if len(set(sp.positions)) >= sp.length]
    if whole:
        return Feature("dcp", False, f"dcp={topo.dcp} requested, but rank{'s' if len(whole) > 1 else ''} "
                                     f"{', '.join(map(str, whole))} stored every token of the probe sequence: "
                                     f"the tokens were not split over the DCP group (dcp=1 in effect)")
    if any(r.stored_positions is not None for r in ranks) and not split:
        length = max(r.stored_positions.length for r in ranks if r.stored_positions is not None)
        return Feature("dcp", None, f"the probe sequence's {length} tokens all fall on one rank of each DCP group "
                                    f"under the {ctx.plan.placement.label} placement, so whether the engine "
                                    f"split them is not observable")
    how = "; no rank stored every token" if split else " (no stored positions reported)"
    return Feature("dcp", True, f"DCP groups of {topo.dcp} members{how}")


def placement_feature(ctx: CellContext, ranks: tuple[RankReport, ...] | None) -> Feature | None:
    if ranks is None or not any(r.stored_positions is not None for r in ranks):
        return None
    problems = placement_problems(ctx.plan, {r.rank: r for r in ranks})
    label = ctx.plan.placement.label
    if problems:
        return Feature("placement", False, f"the {label} placement did not run: {problems[0]}")
    return Feature("placement", True, f"each rank stored its {label} share of the probe sequence")


def dp_feature(ctx: CellContext, topo: Topology, ranks: tuple[RankReport, ...] | None) -> Feature:
    """Attention data parallel ran when the probe sequence's KV sits on exactly one rank (its DP rank)."""
    if ranks is None:
        return _no_ranks(ctx, "dp")
    holders = [r.rank for r in ranks if r.stored_positions is not None and r.stored_positions.positions]
    if not holders:
        return Feature("dp", None, "no rank reports the probe sequence's stored positions")
    if len(holders) > 1:
        return Feature("dp", False, f"dp={topo.dp} requested; ranks {', '.join(map(str, holders))} all stored the "
                                    f"probe sequence: every rank ran the request, none is data parallel")
    return Feature("dp", True, f"the probe sequence ran on DP rank {holders[0]} only, of {topo.dp}")


def ep_feature(ctx: CellContext, topo: Topology, ranks: tuple[RankReport, ...] | None) -> Feature:
    if ranks is None:
        return _no_ranks(ctx, "ep")
    held = [report.hybrid.moe if report.hybrid is not None else report.experts for report in ranks]
    experts = [moe.experts for moe in held if moe is not None]
    if not experts:
        return Feature("ep", False, f"ep={topo.ep} requested; no rank reports routed experts")
    every = set().union(*map(set, experts))
    split = len({tuple(e) for e in experts}) > 1 and all(len(set(e)) < len(every) for e in experts)
    if not split:
        return Feature("ep", False, f"ep={topo.ep} requested; the ranks route the same experts "
                                    f"({len(every)} experts on every rank): no expert map split them")
    return Feature("ep", True, f"{len(experts)} ranks route {min(map(len, experts))}-{max(map(len, experts))} "
                               f"of {len(every)} experts")


def route_feature(ctx: CellContext) -> Feature | None:
    entry = workload_entry(ctx) or {}
    route = entry.get("route")
    if route not in ROUTES:
        return None
    _, stat = ROUTES[route]
    stats: Mapping[str, Any] = entry.get("stats") or {}
    if stat not in stats:
        return Feature(route, None, f"engine {ctx.info.engine} reports no {stat} (only what the client saw)")
    if route == "prefix_cache" and stats.get("prefix_cacheable", 1) == 0:  # declared, not silent
        return Feature(route, None, f"engine {ctx.info.engine} declares its prefix cache unable to hold a prompt "
                                    f"block in this configuration (prefix_cacheable = 0: a hybrid model's state, "
                                    f"or a DCP placement whose blocks are not whole on every rank)")
    value = stats[stat]
    needed = 2 if stat == "max_running" else 1
    if not isinstance(value, (int, float)) or value < needed:
        return Feature(route, False, f"workload {ctx.info.workload} asks for the {route} route; the engine "
                                     f"reports {stat} = {value}")
    return Feature(route, True, f"{stat} = {value}")


# proposers that propose k tokens at every verify step, whatever the prompts: a draft model, an MTP head (a prompt
# lookup, what an HTTP engine's template may configure for -draft, may find nothing: "lookup" in its manifest)
ALWAYS_PROPOSES: frozenset[str] = frozenset({"draft", "mtp"})


def speculator_feature(ctx: CellContext, topo: Topology) -> Feature:
    name = f"speculator ({topo.speculator})"
    spec = speculative_manifest(ctx.par)
    if spec is None:
        return Feature(name, False, "the run recorded no speculative decoding")
    if has_traces(ctx.par):
        steps = sum(int(ctx.par.tensor(SPEC_ACCEPTED, c.index).numel()) for c in ctx.par.cases)
        return Feature(name, steps > 0, f"{steps} verify steps in the accept traces")
    if spec.get("source") in (None, "none"):
        return Feature(name, None, f"engine {ctx.info.engine} exported no per-step traces and no spec-decode "
                                   "counters")
    steps = spec.get("drafts", spec.get("verify_steps"))
    if not isinstance(steps, (int, float)):
        return Feature(name, None, f"the engine's {spec.get('source')} give no verify step count")
    if steps == 0 and spec.get("proposer", topo.speculator) in ALWAYS_PROPOSES:  # proposes at every verify step
        return Feature(name, False, f"the engine's {spec.get('source')} counted no drafts, though a {topo.speculator} "
                                    f"speculator proposes at every verify step: speculative decoding silently off")
    if steps == 0:  # as acceptance: a proposer may propose nothing (n-gram lookup finding no match), so aggregate
        # counters of zero cannot tell a speculator that ran from one that is off
        return Feature(name, None, f"the engine's {spec.get('source')} counted no drafts: a proposer that found "
                                   "nothing to propose cannot be told from one that is off")
    return Feature(name, True, f"{steps:g} verify steps counted by the engine ({spec.get('source')})")


def requested_features(ctx: CellContext, topo: Topology) -> list[Feature]:
    ranks = _ranks(ctx)
    out: list[Feature | None] = []
    if topo.tp > 1 and topo.dp == 1:
        out.append(tp_feature(ctx, topo, ranks))
    if topo.dp > 1:
        out.append(dp_feature(ctx, topo, ranks))
    if topo.dcp > 1:
        out += [dcp_feature(ctx, topo, ranks), placement_feature(ctx, ranks)]
    if topo.ep > 1:
        out.append(ep_feature(ctx, topo, ranks))
    out.append(route_feature(ctx))
    if topo.speculator != "none":
        out.append(speculator_feature(ctx, topo))
    return [f for f in out if f is not None]


def requested_topology(ctx: CellContext) -> Topology:
    """What the cell asked the engine for: the job's topology the run recorded, else (an in-memory run
    without one) the plan's tp, dcp and placement with the cell's speculator."""
    recorded = ctx.par.manifest.get("topology")
    if isinstance(recorded, Mapping):
        return Topology.from_dict(recorded, "manifest topology")
    placement = ctx.plan.placement
    return Topology(tp=ctx.plan.tp, dcp=ctx.plan.dcp, speculator=ctx.info.speculator,
                    interleave=placement.size if placement.kind == "interleave" else 1,
                    contiguous=placement.kind == "contiguous", q_replicated=ctx.plan.q_replicated)


def features_on(ctx: CellContext) -> list[CheckResult]:
    try:
        topo = requested_topology(ctx)
        features = requested_features(ctx, topo)
    except (RunError, ConfigError) as exc:
        return [CheckResult(NAME, Verdict.ERROR, f"cannot read what the engine ran: {exc}")]
    metrics: dict[str, Any] = {"features": [{"feature": f.name, "ran": f.ran, "evidence": f.why} for f in features]}
    off = [f for f in features if f.ran is False]
    unknown = [f for f in features if f.ran is None]
    on = [f for f in features if f.ran]
    if off:
        return [CheckResult(NAME, Verdict.FAIL, "requested but not run: " + "; ".join(
            f"{f.name}: {f.why}" for f in off), metrics)]
    if unknown:
        proven = f"; proven on: {', '.join(f.name for f in on)}" if on else ""
        return [CheckResult(NAME, Verdict.SKIP, "cannot verify " + "; ".join(f"{f.name}: {f.why}" for f in unknown)
                            + proven, metrics)]
    if not features:
        return [CheckResult(NAME, Verdict.PASS, "no parallel feature or route requested (one rank, no route)",
                            metrics)]
    return [CheckResult(NAME, Verdict.PASS, "; ".join(f"{f.name} on ({f.why})" for f in on), metrics)]
