"""One cell's comparison: layout, logits (prefill, decode), generation, and localization."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from harness.artifacts import RunArtifacts
from harness.compare.generation import Decoder, check_generation
from harness.compare.layout_check import check_layout_with_pool, kv_groups_differ
from harness.compare.localize import localize
from harness.compare.logits import check_logits
from harness.compare.settings import CheckSettings, LayoutSettings
from harness.fmt import id_ranges
from harness.layout import LayoutPlan
from harness.verdict import CheckResult, Localization, Verdict

PARITY_CHECKS: tuple[str, ...] = ("logits_prefill", "logits_decode", "generation")


def check_names(with_speculator: bool) -> list[str]:
    return ["layout", *(["speculator_layout"] if with_speculator else []), *PARITY_CHECKS]


def _layout_check(plan: LayoutPlan, layout: dict[str, Any], entry: str, name: str,
                  settings: LayoutSettings) -> CheckResult:
    actual = layout.get(entry)
    if not isinstance(actual, dict):
        return CheckResult(name, Verdict.ERROR, f"layout.json has no {entry!r} entry")
    return check_layout_with_pool(plan, actual, name, settings.check_pool, settings.check_checksums)


def _failed_run(ref: RunArtifacts, par: RunArtifacts) -> str | None:
    for who, run in (("reference", ref), ("parallel", par)):
        if not run.ok:
            return f"{who} run failed: {run.manifest.get('error') or 'no error text'}"
    return None


def _prompt_details(ref: RunArtifacts, prefill: list[dict[str, Any]], decode: list[dict[str, Any]],
                    generation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_index = lambda rows: {row["index"]: row for row in rows}  # noqa: E731
    pre, dec, gen = by_index(prefill), by_index(decode), by_index(generation)
    return [{"index": c.index, "prompt": c.prompt, "prefill": pre.get(c.index), "decode": dec.get(c.index),
             "generation": gen.get(c.index)} for c in ref.cases]


def compare_cell(ref: RunArtifacts, par: RunArtifacts, noise: RunArtifacts | None, plan: LayoutPlan,
                 settings: CheckSettings, speculator_plan: LayoutPlan | None = None,
                 decode: Decoder | None = None) -> tuple[list[CheckResult], Localization | None, dict[str, Any]]:
    """All checks of one cell, its localization (only when a parity check FAILs) and the
    JSON-serialisable drill-down details. A failed reference or parallel run gives ERROR checks."""
    failed = _failed_run(ref, par)
    if failed:
        return [CheckResult(n, Verdict.ERROR, failed) for n in check_names(speculator_plan is not None)], None, {}
    noise = noise if noise is not None and noise.ok else None
    layout = _layout_check(plan, par.layout, "target", "layout", settings.layout)
    checks = [layout]
    details: dict[str, Any] = {"layout": {"planned": plan.to_dict(), "actual": par.layout.get("target")}}
    if speculator_plan is not None:
        checks.append(_layout_check(speculator_plan, par.layout, "speculator", "speculator_layout",
                                    settings.layout))
        details["speculator_layout"] = {"planned": speculator_plan.to_dict(),
                                        "actual": par.layout.get("speculator")}
    prefill, prefill_prompts = check_logits("prefill", ref, par, noise, settings.logits)
    decode_check, decode_prompts = check_logits("decode", ref, par, noise, settings.logits)
    generation, generation_prompts = check_generation(ref, par, settings.generation, noise=noise, decode=decode)
    parity = [prefill, decode_check, generation]
    checks += parity
    details["prompts"] = _prompt_details(ref, prefill_prompts, decode_prompts, generation_prompts)
    localization, loc_details = localize(ref, par, noise, plan, ref.cases, settings.localization)
    details.update(loc_details)
    if not any(c.verdict is Verdict.FAIL for c in parity):
        return checks, None, details
    groups = kv_groups_differ(layout)
    if localization is not None and groups:
        plural = "s" if len(groups) > 1 else ""
        localization = replace(localization, summary=f"{localization.summary}; KV head ids differ inside "
                                                     f"DCP group{plural} {id_ranges(groups)}")
    return checks, localization, details
