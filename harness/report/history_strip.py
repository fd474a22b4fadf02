"""The report's history view: per cell, its last runs as a small inline SVG strip (one square per
run coloured by the cell's verdict, and a line of its largest noise multiple), plus the marks
new failure / fixed / flaky, and a loud banner naming the flaky cells with their flip counts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from markupsafe import Markup, escape

from harness.verdict import CellResult

if TYPE_CHECKING:  # harness.history reads results through harness.report: no import cycle at run time
    from harness.history import CellHistory, CellId

COLOURS = {"PASS": "#2da44e", "WARN": "#e3b341", "FAIL": "#cf222e", "ERROR": "#8250df", "SKIP": "#afb8c1"}
BOX, GAP, LINE_H = 12, 2, 16


@dataclass(frozen=True)
class HistoryView:
    strip: Markup
    runs: int
    marks: tuple[str, ...]
    flaky: str  # '' or 'logits_decode (2 flips), ...'


def strip_svg(runs: Sequence[tuple[str, str, float | None]]) -> Markup:
    """Squares per run (oldest left) and, above them, a polyline of log10(max noise multiple)."""
    width = len(runs) * (BOX + GAP) + GAP
    height = LINE_H + BOX + 2 * GAP
    parts = []
    for i, (run_id, status, multiple) in enumerate(runs):
        x = GAP + i * (BOX + GAP)
        note = f"{run_id}: {status}" + (f", max {multiple:.3g} x noise" if multiple is not None else "")
        parts.append(f'<rect x="{x}" y="{LINE_H + GAP}" width="{BOX}" height="{BOX}" '
                     f'fill="{COLOURS.get(status, "#6e7781")}"><title>{escape(note)}</title></rect>')
    values = [(i, math.log10(m)) for i, (_, _, m) in enumerate(runs) if m is not None and m > 0]
    if values:
        lo, hi = min(v for _, v in values), max(v for _, v in values)
        span = hi - lo or 1.0
        points = " ".join(f"{GAP + i * (BOX + GAP) + BOX / 2:.1f},{LINE_H - 2 - (v - lo) / span * (LINE_H - 4):.1f}"
                          for i, v in values)
        parts.append(f'<polyline points="{points}" fill="none" stroke="#0969da" stroke-width="1.5">'
                     f'<title>largest noise multiple per run (log scale)</title></polyline>')
    label = f"last {len(runs)} runs"
    return Markup(f'<svg class="history" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
                  f'role="img" aria-label="{escape(label)}">{"".join(parts)}</svg>')


def history_view(hist: "CellHistory") -> HistoryView:
    flaky = ", ".join(f"{check} ({flips} flip{'s' if flips != 1 else ''})" for check, flips in hist.flaky_checks)
    marks = tuple(m for m, on in (("new failure", hist.new_failure), ("fixed", hist.fixed),
                                  ("FLAKY", bool(flaky))) if on)
    return HistoryView(strip=strip_svg(hist.runs), runs=len(hist.runs), marks=marks, flaky=flaky)


def cell_id(cell: CellResult) -> "CellId":
    return (cell.suite, cell.model, cell.topology, cell.seed)
