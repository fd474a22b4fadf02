"""summary.md: the Markdown summary for CI step pages (headline, counts, matrix, corruption list).

It holds no links; user text is escaped with Markdown's own backslash escapes (not HTML entities, which
read as `&lt;` wherever the file is shown as text) so that it cannot break the table, format or inject HTML.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.core.jsonio import write_text_atomic
from harness.core.verdict import CellResult, FailureClass, Verdict
from harness.records.results import summary_counts
from harness.report.matrix import (
    Matrix,
    build_matrix,
    class_label,
    headline,
    interrupted_text,
    plural,
    provenance_items,
    suspect_text,
)

SUMMARY_FILE = "summary.md"
_MD_SPECIAL = {ch: "\\" + ch for ch in "\\|`*[]<>&"}


def md_escape(text: str) -> str:
    """Text safe inside a Markdown table cell: one line, no markup, '://' defanged (an escaped colon: no autolink)."""
    out = "".join(_MD_SPECIAL.get(ch, ch) for ch in " ".join(str(text).split()))
    return out.replace("://", "\\://")


def _table(matrix: Matrix) -> list[str]:
    headers = [*matrix.key_headers, "status", *matrix.check_names]
    lines = ["| " + " | ".join(md_escape(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    for row in matrix.rows:
        status = _verdict(row.cell.status) + (f" ({class_label(row.cell)})" if class_label(row.cell) else "")
        checks = [(_verdict(c.verdict) + (f" {md_escape(c.key)}" if c.key else "")) if c.verdict else "-"
                  for c in row.checks]
        lines.append("| " + " | ".join([*(md_escape(k) for k in row.keys), status, *checks]) + " |")
    return lines


def _verdict(v: Verdict) -> str:
    return f"**{v.value}**" if v in (Verdict.FAIL, Verdict.ERROR) else v.value


def _problems(matrix: Matrix) -> list[str]:
    out: list[str] = []
    silent = [r for r in matrix.rows if r.cell.silent_corruption]
    if silent:
        out += ["", "### Silent corruption", ""]
        for r in silent:
            failed = ", ".join(ch.name for ch in r.cell.checks if ch.verdict is Verdict.FAIL)
            out.append(f"- {md_escape(r.label)} (failed: {md_escape(failed)}): {md_escape(suspect_text(r.cell))}")
    for title, failure in (("Performance-only regressions (outputs agree)", FailureClass.PERFORMANCE),
                           ("Other failures", FailureClass.OUTPUT),
                           ("Could not run (infrastructure)", FailureClass.INFRASTRUCTURE)):
        rows = [r for r in matrix.rows if r.cell.failure_class is failure and not r.cell.silent_corruption]
        if rows:
            out += ["", f"### {title}", ""]
        for r in rows:
            bad = [ch for ch in r.cell.checks if ch.verdict in (Verdict.FAIL, Verdict.ERROR)]
            reason = "; ".join(f"{ch.name}: {ch.reason}" for ch in bad) or "no checks ran"
            out.append(f"- {md_escape(r.label)} {r.cell.status.value}: {md_escape(reason)}")
    skipped = [r for r in matrix.rows if r.cell.status is Verdict.SKIP]
    if skipped:
        out += ["", "### Skipped", ""]
        for r in skipped:
            reasons = "; ".join(ch.reason for ch in r.cell.checks if ch.verdict is Verdict.SKIP) or "no checks ran"
            out.append(f"- {md_escape(r.label)}: {md_escape(reasons)}")
    return out


def render_summary(cells: list[CellResult], provenance: dict[str, Any], run_id: str) -> str:
    matrix = build_matrix(cells)
    head = headline(cells, interrupted_text(provenance))
    counts = summary_counts(cells)
    count_line = ", ".join(f"{counts[v.value.lower()]} {v.value}" for v in Verdict)
    prov = " · ".join(f"{k} {md_escape(text)}" for k, text in provenance_items(provenance))
    status = "INTERRUPTED" if interrupted_text(provenance) else head.verdict.value
    lines = [f"## Harness report {md_escape(run_id)}: {status}", "",
             f"**{head.title}**: {md_escape(head.text)}", "",
             f"{plural(counts['cells'], 'cell')}: {count_line}; {counts['silent_corruption']} silent corruption.", "",
             *_table(matrix), *_problems(matrix)]
    if prov:
        lines += ["", f"Provenance: {prov}"]
    return "\n".join(lines) + "\n"


def write_summary(out_dir: Path, cells: list[CellResult], provenance: dict[str, Any], run_id: str) -> Path:
    path = out_dir / SUMMARY_FILE
    write_text_atomic(path, render_summary(cells, provenance, run_id))
    return path
