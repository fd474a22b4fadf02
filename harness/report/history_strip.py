"""The report's history view: per cell (and per positive control: a cell with an injected fault), its last
runs as a small inline SVG strip (one square per run coloured by the cell's verdict, runs of one build
side by side, a gap between builds, and a line of its largest noise multiple), the builds' labels,
the marks new failure / fixed / flaky / control (still detected or not), and a loud banner naming
the flaky cells with their flip counts. The strip shows in the matrix's trend column (first screen)
and again in the cell's drill-down."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from markupsafe import Markup, escape

from harness.core.verdict import CellResult
from harness.specs.workload import SUITE_PROMPTS

if TYPE_CHECKING:  # harness.records.history reads results through harness.report: no import cycle at run time
    from harness.records.history import CellHistory, RunPoint, TrendKey

# One colour per verdict, everywhere: the strip's squares, and (in report.css and the sign-off page)
# the matrix, the badges and the headline use the same ERROR colour.
ERROR_COLOUR = "#5a2d91"
COLOURS = {"PASS": "#2da44e", "WARN": "#e3b341", "FAIL": "#cf222e", "ERROR": ERROR_COLOUR, "SKIP": "#afb8c1"}
BOX, GAP, BUILD_GAP, LINE_H = 12, 2, 6, 16


@dataclass(frozen=True)
class HistoryView:
    strip: Markup
    runs: int
    marks: tuple[tuple[str, str], ...]  # (text, css class suffix): new / fixed / flaky / control / lost
    flaky: str   # '' or 'logits_decode (2 flips), ...'
    builds: str  # the shown runs' builds, oldest first: 'v1 · v2 · v3'


def _xs(runs: Sequence["RunPoint"]) -> list[int]:
    """x of each run's square: side by side within a build, BUILD_GAP between builds."""
    xs, x = [], GAP
    for i, run in enumerate(runs):
        if i and run.build != runs[i - 1].build:
            x += BUILD_GAP
        xs.append(x)
        x += BOX + GAP
    return xs


def strip_svg(runs: Sequence["RunPoint"]) -> Markup:
    """Squares per run (oldest left) and, above them, a polyline of log10(max noise multiple)."""
    xs = _xs(runs)
    width = (xs[-1] + BOX + GAP) if xs else GAP
    height = LINE_H + BOX + 2 * GAP
    parts = []
    for x, run in zip(xs, runs):
        multiple = run.max_noise_multiple
        note = (f"{run.run_id} (build {run.build}): {run.status}"
                + (f", max {multiple:.3g} x noise" if multiple is not None else ""))
        parts.append(f'<rect x="{x}" y="{LINE_H + GAP}" width="{BOX}" height="{BOX}" '
                     f'fill="{COLOURS.get(run.status, "#6e7781")}"><title>{escape(note)}</title></rect>')
    values = [(x, math.log10(r.max_noise_multiple)) for x, r in zip(xs, runs)
              if r.max_noise_multiple is not None and r.max_noise_multiple > 0]
    if values:
        lo, hi = min(v for _, v in values), max(v for _, v in values)
        span = hi - lo or 1.0
        points = " ".join(f"{x + BOX / 2:.1f},{LINE_H - 2 - (v - lo) / span * (LINE_H - 4):.1f}" for x, v in values)
        parts.append(f'<polyline points="{points}" fill="none" stroke="#0969da" stroke-width="1.5">'
                     f'<title>largest noise multiple per run (log scale)</title></polyline>')
    label = f"last {len(runs)} runs"
    return Markup(f'<svg class="history" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
                  f'role="img" aria-label="{escape(label)}">{"".join(parts)}</svg>')


def history_view(hist: "CellHistory") -> HistoryView:
    flaky = ", ".join(f"{check} ({flips} flip{'s' if flips != 1 else ''})" for check, flips in hist.flaky_checks)
    marks = [(m, css) for m, css, on in (("NEW-FAIL", "new", hist.new_failure), ("FIXED", "fixed", hist.fixed),
                                         ("FLAKY", "flaky", bool(flaky))) if on]
    if hist.detected is not None:
        marks.insert(0, (f"control ({hist.fault}): still detected", "control") if hist.detected
                     else (f"control ({hist.fault}): NOT detected", "lost"))
    return HistoryView(strip=strip_svg(hist.runs), runs=len(hist.runs), marks=tuple(marks), flaky=flaky,
                       builds=" · ".join(hist.builds))


def cell_id(cell: CellResult) -> "TrendKey":
    """The history key of a report cell: the cell and its injected fault (a control has its own trend); a
    workload other than the suite's prompts is part of the topology column, as history.cell_topology stores it."""
    topology = cell.topology if cell.workload == SUITE_PROMPTS else f"{cell.topology}/{cell.workload}"
    return (cell.suite, cell.model, topology, cell.seed, cell.fault)
