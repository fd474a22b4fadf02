"""The compact terminal matrix printed by `harness run` and `harness report`."""

from __future__ import annotations

from harness.core.fmt import table
from harness.core.verdict import CellResult, Verdict
from harness.report.matrix import Matrix, build_matrix, class_label, headline, suspect_text

ABBREV: dict[Verdict, str] = {Verdict.PASS: "ok", Verdict.WARN: "warn", Verdict.FAIL: "FAIL",
                              Verdict.ERROR: "ERR", Verdict.SKIP: "skip"}


def print_matrix(cells: list[CellResult]) -> str:
    """Rows = cells (model/topology[/fault]), columns = status and checks, verdict abbreviations."""
    matrix = build_matrix(cells)
    headers = [*matrix.key_headers, "status", *matrix.check_names]
    rows = []
    for row in matrix.rows:
        status = ABBREV[row.cell.status] + (f" ({class_label(row.cell)})" if class_label(row.cell) else "")
        checks = [ABBREV[c.verdict] if c.verdict else "-" for c in row.checks]
        rows.append([*row.keys, status, *checks])
    head = headline(cells)
    legend = "ok=PASS warn=WARN FAIL ERR=ERROR skip=SKIP -=not run"
    return "\n".join([table(headers, rows), legend, *failing_lines(matrix), f"{head.title}: {head.text}"])


def failing_lines(matrix: Matrix) -> list[str]:
    """Per failing or broken cell: its label and failure class, where the failure is, and the command
    that reruns it alone."""
    out: list[str] = []
    for row in matrix.rows:
        if row.cell.status not in (Verdict.FAIL, Verdict.ERROR):
            continue
        out += [f"{row.label}: {row.cell.status.value} ({class_label(row.cell)}): {suspect_text(row.cell)}",
                f"  rerun: {row.cell.command}" if row.cell.command else "  rerun: (no command recorded)"]
    return out
