"""Real results for the report tests: results.json files written by `harness run` (see
tests/data/results/regenerate.sh), committed so the report tests need no launch. The drift test in
tests/test_report_real.py checks they still carry the checks and details keys a run writes today."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.core.verdict import CellResult
from harness.report import read_results

RESULTS_DIR = Path(__file__).resolve().parent / "data" / "results"
# name: what the run was (regenerate.sh has the commands)
KINDS = {
    "clean": "tp2dcp2, no fault: PASS",
    "corruption": "tp2dcp2 with dcp-tp-kv-layout: silent corruption",
    "gcd": "tiny-kv6 tp4 with gcd-naive-gqa: silent corruption, localized to the wrong reads",
    "error": "tp1 PASS and tp2 with a crashed rank: ERROR",
    "skip": "tp2 PASS and tp3, which tiny-gqa cannot split: SKIP",
}


def load(kind: str) -> tuple[list[CellResult], dict[str, Any], str]:
    """(cells, provenance, run_id) of one committed real run."""
    return read_results(RESULTS_DIR / kind)


def cell(kind: str, topology: str | None = None) -> CellResult:
    """The cell of a committed run (the one at `topology` when it holds several)."""
    cells = load(kind)[0]
    if topology is None:
        (only,) = cells
        return only
    return next(c for c in cells if c.topology == topology)
