"""The built-in checks' code: each takes one CellContext and returns its CheckResults
(declared in harness/checks/catalog.py, which says what each needs)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from harness.checks.context import CellContext
from harness.checks.workload_checks import workload_entry
from harness.compare.layout.attention import check_kv_capacity, check_layout_with_pool, kv_groups_differ
from harness.compare.layout.hybrid import check_hybrid_layout
from harness.compare.layout.sparse import SELECTION_KEY, check_sparse_layout
from harness.compare.parity.decode_walk import check_decode_walk
from harness.compare.parity.generation import check_generation
from harness.compare.parity.localize import localize, output_head
from harness.compare.parity.logits import check_logits
from harness.compare.parity.schedule import engine_evidence
from harness.compare.parity.topk import check_topk
from harness.compare.settings import (
    AcceptanceSettings,
    CollectiveSettings,
    GenerationSettings,
    LayoutSettings,
    LocalizationSettings,
    LogitsSettings,
    LosslessSettings,
    SpeculativeOutputSettings,
)
from harness.compare.speculative import (
    acceptance_from_runs,
    check_speculative_output,
    lossless_from_run,
    speculator_details,
)
from harness.core.checkmetrics import PARITY_CHECKS
from harness.core.details import HeadErrors, LayerErrors, LayoutDetails, PromptDetails, SpeculatorDetails
from harness.core.errors import RunError
from harness.core.fmt import id_ranges
from harness.core.verdict import CheckResult, Localization, Verdict
from harness.partition.layout import LayoutPlan
from harness.records import contract as c
from harness.records.artifacts import RunArtifacts


def prompt_details(ref: RunArtifacts, prefill: list[dict[str, Any]], decode: list[dict[str, Any]],
                   generation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The report's `prompts` rows: one per reference case with its prefill, decode and generation rows."""
    by_index = lambda rows: {row["index"]: row for row in rows}  # noqa: E731
    pre, dec, gen = by_index(prefill), by_index(decode), by_index(generation)
    return [{"index": c.index, "prompt": c.prompt, "prefill": pre.get(c.index), "decode": dec.get(c.index),
             "generation": gen.get(c.index)} for c in ref.cases]


def inputs(ctx: CellContext) -> list[CheckResult]:
    from harness.checks.inputs import check_inputs
    return [check_inputs(ctx.ref, ctx.par)]


def _layout(ctx: CellContext, entry: str, name: str) -> CheckResult:
    actual = ctx.par.layout.get(entry)
    plan = ctx.plan if entry == "target" else ctx.speculator_plan
    section = LayoutDetails(planned=plan.to_dict() if plan else None, actual=actual)
    if entry == "target":
        ctx.details.layout = section
    else:
        ctx.details.speculator_layout = section
    reason = ctx.par.layout.get(f"{entry}_reason")
    if actual is None and isinstance(reason, str) and reason:  # the engine says why it reports none
        return CheckResult(name, Verdict.SKIP, reason)
    if not isinstance(actual, dict) or plan is None:
        return CheckResult(name, Verdict.ERROR, f"layout.json has no {entry!r} entry")
    check_pool = ctx.settings.of(LayoutSettings).check_pool and ctx.par_caps.has(c.KV_POOL_SIZE)
    check = LAYOUT_CHECKS[ctx.layout_check] if entry == "target" else _attention_layout
    return check(ctx, plan, actual, name, check_pool)


def _attention_layout(ctx: CellContext, plan: LayoutPlan, actual: dict[str, Any], name: str,
                      check_pool: bool) -> CheckResult:
    moe = ctx.moe_plan if plan is ctx.plan else None  # the target's experts (an MLA model's MoE)
    return check_layout_with_pool(plan, actual, name, check_pool, ctx.settings.of(LayoutSettings).check_checksums,
                                  moe)


def _hybrid_layout(ctx: CellContext, plan: LayoutPlan, actual: dict[str, Any], name: str,
                   check_pool: bool) -> CheckResult:
    if ctx.hybrid_plan is None:
        return CheckResult(name, Verdict.ERROR, "the cell's plan has no hybrid part to check its layout against")
    return check_hybrid_layout(ctx.hybrid_plan, actual, name, check_pool,
                               ctx.settings.of(LayoutSettings).check_checksums, ctx.speculator_plan)


def _sparse_layout(ctx: CellContext, plan: LayoutPlan, actual: dict[str, Any], name: str,
                   check_pool: bool) -> CheckResult:
    if ctx.indexer_plan is None:
        return CheckResult(name, Verdict.ERROR, "the cell's plan has no indexer to check its layout against")
    settings = ctx.settings.of(LayoutSettings)
    # the noise run's selection ties hold against the reference's only where it is the reference engine's own run
    noise = ctx.noise.layout.get("target") if ctx.noise is not None and ctx.noise_ref is None else None
    return check_sparse_layout(plan, ctx.indexer_plan, actual, ctx.ref.layout.get("target"), name, check_pool,
                               settings.check_checksums, settings.selection_tie, noise, settings.selection_tie_factor)


# the check of each layout_check an attention component names (harness/arch/components.py)
LAYOUT_CHECKS: dict[str, Callable[[CellContext, LayoutPlan, dict[str, Any], str, bool], CheckResult]] = {
    "attention": _attention_layout, "hybrid": _hybrid_layout, "sparse": _sparse_layout}


def layout(ctx: CellContext) -> list[CheckResult]:
    if not ctx.par_caps.has(c.LAYOUT_REPORT):  # an HTTP engine: only the KV capacity its server logged
        return [_kv_capacity(ctx)]
    return [_layout(ctx, "target", "layout")]


def _kv_capacity(ctx: CellContext) -> CheckResult:
    actual = ctx.par.layout.get("target")
    ctx.details.layout = LayoutDetails(planned=ctx.plan.to_dict(), actual=actual)
    if not isinstance(actual, dict):
        return CheckResult("layout", Verdict.ERROR, "layout.json has no 'target' entry")
    if not ctx.settings.of(LayoutSettings).check_pool:
        return CheckResult("layout", Verdict.SKIP, "the suite switches the KV pool check off (layout.check_pool)")
    return check_kv_capacity(ctx.plan, actual, ctx.speculator_plan)


def speculator_layout(ctx: CellContext) -> list[CheckResult]:
    return [_layout(ctx, "speculator", "speculator_layout")]


def _logits(ctx: CellContext, path: str) -> list[CheckResult]:
    if ctx.both_have(c.FULL_LOGITS):
        result, prompts = check_logits(path, ctx.ref, ctx.par, ctx.noise, ctx.settings.of(LogitsSettings),
                                       ctx.noise_ref)
    else:
        result, prompts = check_topk(path, ctx.ref, ctx.par, ctx.noise, ctx.settings.of(LogitsSettings), ctx.top_k,
                                     ctx.noise_ref)
    ctx.prompt_rows[path] = prompts
    return [result]


def logits_prefill(ctx: CellContext) -> list[CheckResult]:
    return _logits(ctx, "prefill")


def logits_decode(ctx: CellContext) -> list[CheckResult]:
    """The teacher-forced decode path where both runs have one; else (an HTTP engine) the decode steps of
    the greedy generations, walked along their common prefix (harness/compare/parity/decode_walk.py)."""
    if ctx.both_have(c.DECODE_PATH):
        return _logits(ctx, "decode")
    lacking = ctx.missing((c.GENERATION,), ())
    if lacking:  # one run has a decode path, the other only a generation, or neither
        return [CheckResult("logits_decode", Verdict.SKIP, f"{lacking}, and not both give {c.DECODE_PATH}: "
                            "logits_decode unavailable")]
    result, prompts = check_decode_walk(ctx.ref, ctx.par, ctx.noise, ctx.settings.of(LogitsSettings), ctx.top_k,
                                        ctx.noise_ref, sampled=_sampled(ctx))
    ctx.prompt_rows["decode"] = prompts
    return [result]


def _sampled(ctx: CellContext) -> bool:
    """Whether the cell's workload samples (its generated tokens are draws)."""
    entry = workload_entry(ctx)
    return entry is not None and entry.get("sampling") is not None


def generation(ctx: CellContext) -> list[CheckResult]:
    if _sampled(ctx):
        return [CheckResult("generation", Verdict.SKIP, f"workload {ctx.info.workload} samples: its tokens are "
                            "judged by the sampling checks, not against the reference's")]
    try:
        evidence = ctx.jump_evidence or engine_evidence(ctx.noise_base, ctx.noise)
    except RunError:  # a run without usable generations: the generation check says so itself
        evidence = None
    result, prompts = check_generation(ctx.ref, ctx.par, ctx.settings.of(GenerationSettings), noise=ctx.noise,
                                       decode=ctx.decode, evidence=evidence, noise_ref=ctx.noise_ref)
    ctx.prompt_rows["generation"] = prompts
    return [result]


def localization(ctx: CellContext) -> list[CheckResult]:
    """No verdict of its own: explains a parity or collectives FAIL (ctx.localization) and adds the per-layer and
    per-head errors to the details."""
    layout_result = ctx.result("layout")
    held_off = layout_result.metrics.get("params_off", []) if layout_result is not None else []
    found, loc_details = localize(ctx.ref, ctx.par, ctx.noise, ctx.plan, ctx.ref.cases,
                                  ctx.settings.of(LocalizationSettings), ctx.settings.of(CollectiveSettings), held_off,
                                  ctx.noise_ref)
    if "layer_errors" in loc_details:
        ctx.details.layer_errors = LayerErrors(**loc_details["layer_errors"])
    if "head_errors" in loc_details:
        ctx.details.head_errors = HeadErrors(**loc_details["head_errors"])
    if "note" in loc_details:
        ctx.details.note = str(loc_details["note"])
    if loc_details.get("collectives"):
        ctx.details.collectives = dict(loc_details["collectives"])
    if not any(r.name in (*PARITY_CHECKS, "collectives") and r.verdict is Verdict.FAIL for r in ctx.results):
        return []
    if found is None and "layer_errors" in loc_details:  # the logits fail, no layer does
        failing = [r.name for r in ctx.results if r.name in PARITY_CHECKS and r.verdict is Verdict.FAIL]
        found = output_head(loc_details["layer_errors"], failing, held_off)
    if found is None:
        return []
    selection = layout_result.metrics.get(SELECTION_KEY) if layout_result is not None else None
    if selection is not None and 0 <= selection["layer"] <= found.layer:  # the selection diverges first
        found = Localization(layer=selection["layer"], heads=(), ranks=(selection["rank"],), kv_heads=(),
                             summary=f"layer {selection['layer']} sparse attention: the indexer's top-k selection "
                                     f"diverges first ({selection['summary']}); the residual stream after: "
                                     f"{found.summary}")
        ctx.localization = found
        return []
    groups = kv_groups_differ(layout_result) if layout_result is not None else ()
    if groups:
        plural = "s" if len(groups) > 1 else ""
        found = replace(found, summary=f"{found.summary}; KV head ids differ inside DCP group{plural} "
                                       f"{id_ranges(groups)}")
    elif layout_result is not None and layout_result.verdict is Verdict.FAIL:  # what the ranks hold, e.g.
        found = replace(found, summary=f"{found.summary}; layout: {layout_result.reason}")  # a shard off by one
    ctx.localization = found
    return []


def collectives(ctx: CellContext) -> list[CheckResult]:
    from harness.compare.parity.collectives import check_collectives
    return [check_collectives(ctx.par, ctx.ref.cases, ctx.plan.tp, ctx.plan.dcp, ctx.settings.of(CollectiveSettings))]


def lossless(ctx: CellContext) -> list[CheckResult]:
    return [lossless_from_run(ctx.par, ctx.settings.of(LosslessSettings), ctx.noise_base, ctx.noise)]


def speculative_logprobs(ctx: CellContext) -> list[CheckResult]:
    return check_speculative_output(ctx.par, ctx.ref, ctx.settings.of(SpeculativeOutputSettings))


def acceptance(ctx: CellContext) -> list[CheckResult]:
    """Against the reference with the same speculator, and against the stored acceptance baseline
    (baselines/acceptance.yaml), which also sees bugs in code the reference runs too."""
    from harness.baselines.acceptance_baseline import baseline_check, key_of_run, load_acceptance
    from harness.baselines.baseline_store import update_command

    result = acceptance_from_runs(ctx.ref, ctx.par, ctx.settings.of(AcceptanceSettings))
    command = update_command(ctx.info.report_dir or "RUN_DIR", ctx.info.suite)
    gate = baseline_check(ctx.par, result, ctx.info.model, ctx.info.engine, load_acceptance(ctx.info.baselines_dir),
                          ctx.settings.of(AcceptanceSettings), command)
    try:
        ref_key = key_of_run(ctx.ref, ctx.info.model, ctx.info.reference_engine).to_dict()
    except RunError:
        ref_key = None
    ctx.details.speculator = SpeculatorDetails(**speculator_details(result, ctx.info.speculator, gate, ref_key))
    return [result, gate]


def reference_baseline(ctx: CellContext) -> list[CheckResult]:
    """The cell's reference against the one recorded from an earlier build (baselines/references.yaml), within
    the dtype's rounding: it sees a bug in code the reference runs too, which every parity check shares."""
    from harness.baselines.reference_baseline import gate_reference, load_references

    return [gate_reference(load_references(ctx.info.baselines_dir), ctx.info.baselines_dir, ctx.ref, ctx.info.model,
                           ctx.info.report_dir or "RUN_DIR", ctx.info.suite)]


def gsm8k(ctx: CellContext) -> list[CheckResult]:
    from harness.checks.gsm8k import gsm8k_checks

    if ctx.gsm8k is None:  # the catalog runs it only in suites with gsm8k
        raise RunError("gsm8k check in a cell without GSM8K settings")
    checks, ctx.details.gsm8k = gsm8k_checks(ctx.ref.path, ctx.par.path, ctx.gsm8k, ctx.info.suite,
                                                ctx.info.model, ctx.info.topology, ctx.info.report_dir,
                                                ctx.info.baselines_dir)
    return checks


def _sent(manifest: dict[str, Any], workload: str) -> dict[str, Any] | None:
    """The request record of an HTTP run: the run's `requests`, else its workload's entry's (a run with
    workloads sends each workload by its own schedule); None when the run records none."""
    if isinstance(manifest.get("requests"), dict):
        return manifest["requests"]  # type: ignore[no-any-return]
    entries = manifest.get("workloads")
    entry = next((e for e in entries if isinstance(e, dict) and e.get("name") == workload), None) \
        if isinstance(entries, list) else None
    return entry["requests"] if entry is not None and isinstance(entry.get("requests"), dict) else None


def finish_details(ctx: CellContext) -> None:
    """Fold the per-path prompt rows into the report's `prompts` section."""
    sent = {who: record for who, run in (("parallel", ctx.par), ("reference", ctx.ref))
            if (record := _sent(run.manifest, ctx.info.workload)) is not None}
    if sent:  # an HTTP run sent by a request schedule (or its workload's): its order and times
        ctx.details.requests = sent
    rows = ctx.prompt_rows
    if rows:
        ctx.details.prompts = [PromptDetails(**p) for p in prompt_details(
            ctx.ref, rows.get("prefill", []), rows.get("decode", []), rows.get("generation", []))]
