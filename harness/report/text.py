"""The compact terminal matrix printed by `harness run` and `harness report`."""

from __future__ import annotations

from harness.fmt import table
from harness.report.matrix import build_matrix, headline
from harness.verdict import CellResult, Verdict

ABBREV: dict[Verdict, str] = {Verdict.PASS: "ok", Verdict.WARN: "warn", Verdict.FAIL: "FAIL",
                              Verdict.ERROR: "ERR", Verdict.SKIP: "skip"}


def print_matrix(cells: list[CellResult]) -> str:
    """Rows = cells (model/topology[/fault]), columns = status and checks, verdict abbreviations."""
    matrix = build_matrix(cells)
    headers = [*matrix.key_headers, "status", *matrix.check_names]
    rows = []
    for row in matrix.rows:
        status = ABBREV[row.cell.status] + (" (silent corruption)" if row.cell.silent_corruption else "")
        checks = [ABBREV[c.verdict] if c.verdict else "-" for c in row.checks]
        rows.append([*row.keys, status, *checks])
    head = headline(cells)
    legend = "ok=PASS warn=WARN FAIL ERR=ERROR skip=SKIP -=not run"
    return "\n".join([table(headers, rows), legend, f"{head.title}: {head.text}"])
