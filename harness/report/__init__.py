"""Reports of a run: results.json, index.html, junit.xml and summary.md (docs/architecture.md, Reports).

render_all writes all four into one folder; merge reads the results.json of run folders for
`harness report`. Nothing here runs a model or needs a GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.core.verdict import CellResult
from harness.records.results import exit_code, read_results, write_results
from harness.report.html import write_html
from harness.report.junit import write_junit
from harness.report.merge import merge
from harness.report.summary import write_summary
from harness.report.text import print_matrix

if TYPE_CHECKING:
    from harness.records.history import CellHistory, TrendKey

__all__ = ["exit_code", "merge", "print_matrix", "read_results", "render_all", "write_results"]


def render_all(out_dir: Path, cells: list[CellResult], provenance: dict[str, Any], run_id: str,
               histories: "dict[TrendKey, CellHistory] | None" = None) -> dict[str, Path]:
    """Write results.json, index.html, junit.xml and summary.md into out_dir; their paths by kind.
    With `histories` (harness/records/history.py) the HTML shows each cell's recent runs."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return {"results": write_results(out_dir, cells, provenance, run_id),
            "html": write_html(out_dir, cells, provenance, run_id, histories),
            "junit": write_junit(out_dir, cells),
            "summary": write_summary(out_dir, cells, provenance, run_id)}
