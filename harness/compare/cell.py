"""One cell's comparison: every registered check (harness/checks/catalog.py) over a reference and a
parallel run, with the report's per-prompt rows. The runner builds a full CellContext; compare_cell
is the short form for two run directories on the embedded engine's capabilities."""

from __future__ import annotations

from typing import Any

from harness.artifacts import RunArtifacts
from harness.compare.generation import Decoder
from harness.compare.settings import CheckSettings
from harness.layout import LayoutPlan
from harness.verdict import CheckResult, Localization

PARITY_CHECKS: tuple[str, ...] = ("logits_prefill", "logits_decode", "generation")


def prompt_details(ref: RunArtifacts, prefill: list[dict[str, Any]], decode: list[dict[str, Any]],
                   generation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The report's `prompts` rows: one per reference case with its prefill, decode and generation rows."""
    by_index = lambda rows: {row["index"]: row for row in rows}  # noqa: E731
    pre, dec, gen = by_index(prefill), by_index(decode), by_index(generation)
    return [{"index": c.index, "prompt": c.prompt, "prefill": pre.get(c.index), "decode": dec.get(c.index),
             "generation": gen.get(c.index)} for c in ref.cases]


def compare_cell(ref: RunArtifacts, par: RunArtifacts, noise: RunArtifacts | None, plan: LayoutPlan,
                 settings: CheckSettings, speculator_plan: LayoutPlan | None = None,
                 decode: Decoder | None = None) -> tuple[list[CheckResult], Localization | None, dict[str, Any]]:
    """The checks of one cell, its localization (only when a parity check FAILs) and the
    JSON-serialisable drill-down details. Capabilities come from each run's manifest (the embedded
    engine's when it records none); a failed reference or parallel run gives ERROR checks."""
    from harness.checks.context import CellContext, CellInfo
    from harness.checks.driver import run_checks
    from harness.checks.runs import run_capabilities

    ctx = CellContext(ref=ref, par=par, noise=noise, plan=plan, settings=settings,
                      par_caps=run_capabilities(par), ref_caps=run_capabilities(ref),
                      info=CellInfo(speculator="draft" if speculator_plan is not None else "none"),
                      speculator_plan=speculator_plan, decode=decode)
    checks = run_checks(ctx)
    return checks, ctx.localization, ctx.details.to_dict()
