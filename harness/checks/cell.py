"""One cell's comparison in one call: every registered check (harness/checks/catalog.py) over a reference
and a parallel run. The runner builds a full CellContext; compare_cell is the short form for two run
directories on the capabilities their manifests record."""

from __future__ import annotations

from typing import Any

from harness.checks.context import CellContext, CellInfo
from harness.checks.driver import run_checks
from harness.checks.settings import CheckSettings
from harness.compare.parity.generation import Decoder
from harness.core.verdict import CheckResult, Localization
from harness.partition.layout import LayoutPlan
from harness.records.artifacts import RunArtifacts, run_capabilities


def compare_cell(ref: RunArtifacts, par: RunArtifacts, noise: RunArtifacts | None, plan: LayoutPlan,
                 settings: CheckSettings, speculator_plan: LayoutPlan | None = None,
                 decode: Decoder | None = None) -> tuple[list[CheckResult], Localization | None, dict[str, Any]]:
    """The checks of one cell, its localization (only when a parity check FAILs) and the
    JSON-serialisable drill-down details. Capabilities come from each run's manifest (the embedded
    engine's when it records none); a failed reference or parallel run gives ERROR checks."""
    ctx = CellContext(ref=ref, par=par, noise=noise, plan=plan, settings=settings,
                      par_caps=run_capabilities(par), ref_caps=run_capabilities(ref),
                      info=CellInfo(speculator="draft" if speculator_plan is not None else "none"),
                      speculator_plan=speculator_plan, decode=decode)
    checks = run_checks(ctx)
    return checks, ctx.localization, ctx.details.to_dict()
